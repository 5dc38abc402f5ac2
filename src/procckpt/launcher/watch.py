"""Watching one cycle's command: signals, deadline, periodic checkpoints, the stop's grace, hangs.

The watch ends when the command exits, or when the launcher stopped it: after its checkpoint
was confirmed (or the grace ran out), or after it hung. What happened is its
:class:`~procckpt.launcher.results.CycleOutcome`; the supervisor decides what follows.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..durations import format_duration
from ..protocol import group
from ..protocol.control import AUDIT_REFUSED
from ..protocol.events import append_event
from ..store import CheckpointStore
from . import pid1
from .child import Child
from .deadline import Deadline
from .engines import Confirmation, Engine, RequestUndelivered
from .hang import HangWatch
from .plan import CheckpointPlan
from .restart import StopCause
from .results import CycleOutcome
from .signals import Action

__all__ = ["CycleWatch", "log_confirmed"]

logger = logging.getLogger(__name__)

#: The loop wakes at least this often (to poll the child and the deadline).
TICK = 1.0
#: After the checkpoint is confirmed, the command gets this long to exit by itself.
EXIT_AFTER_CONFIRM = 15.0
#: After asking a hung command for its stacks, this long for them to reach the log.
STACK_DUMP_WAIT = 2.0
#: How often the ranks' failure reports are looked for; once one came and the command still
#: runs this long after, whether a node of the job is lost is asked, then at every check.
FAILURE_POLL = 5.0
PEER_WAIT = 10.0
NODE_CHECK_EVERY = 30.0
#: A stop asked while the command is still starting (its imports, its process group) waits
#: this long at most for it to connect and save, never past the deadline: Slurm sends its
#: B: signal up to a minute before the time asked for, and a slow start under load must not
#: cost the cycle (or, in the first one, be taken for a script without the Checkpointer).
STARTUP_WAIT = 120.0


@dataclass
class _Stop:
    """A checkpoint-then-stop in progress."""

    seq: int  # the engine's request number, to match its confirmation
    asked_at: float
    give_up_at: float  # no confirmation by then: the command is stopped anyway
    exit_by: float | None = None  # once confirmed: the command has until then to exit (or run)
    #: Past give_up_at, the engine's image was still being written: waited for, not cut.
    waiting_for_image: bool = False


@dataclass
class CycleWatch:
    """Watches ``child`` from ``started`` until it exits or is stopped; see :meth:`run`."""

    child: Child
    started: float
    cycle: int
    engine: Engine
    deadline: Deadline
    plan: CheckpointPlan
    hangs: HangWatch
    store: CheckpointStore
    actions: dict[int, Action]
    clock: Callable[[], float]
    wait: Callable[[float], list[int]]
    term_timeout: float = 10.0
    reap_orphans: bool = False
    dump_stacks: Callable[[int], None] = lambda pid: None
    #: The nodes of the job that are lost (the restart policy's view); None: cannot be told.
    lost_nodes: Callable[[], Sequence[object]] | None = None
    #: What the other nodes' launchers asked of this cycle (protocol/group.py), on several.
    peer_stops: Callable[[], list[dict[str, Any]]] | None = None
    #: The other nodes whose launcher has not been heard from since this one started.
    unheard_peers: Callable[[], list[int]] | None = None
    outcome: CycleOutcome = field(default_factory=lambda: CycleOutcome(exit_code=-1))
    stop: _Stop | None = None
    sigints: int = 0
    said_unheard: bool = False
    #: Signals that arrived while a hung command printed its stacks: for the next cycle.
    carried: list[int] = field(default_factory=list)
    #: Called at each look while the command runs, with the step it reached (None before
    #: its first): the launcher starts a warm restart's spare from here (warm.py).
    on_look: Callable[[int | None], None] | None = None

    def __post_init__(self) -> None:
        self.interval_from = self.started  # the last periodic checkpoint, or the start
        self.interval_seq: int | None = None  # the last periodic request, until answered
        period = self.plan.period.seconds
        self.next_interval = self.started + period if period is not None else None
        self.rank_failed: float | None = None  # when a rank's failure was first seen
        self.next_failure_look = self.started

    def run(self, signals: Iterable[int] = ()) -> CycleOutcome:
        """Watch until the command is gone; ``signals`` arrived before (a previous cycle's)."""
        for signum in signals:
            self._on_signal(signum, self.started)
        child = self.child
        while True:
            now = self.clock()
            end = self.deadline.end(self.started, now)
            trigger_at = end - self.plan.lead.seconds if end is not None else None
            for signum in self.wait(self._next_wake(now, trigger_at)):
                self._on_signal(signum, now)
            if self.reap_orphans:
                pid1.reap_orphans({child.pid})
            rc = child.poll()
            if rc is None:
                now = self.clock()
                self._learn()
                self._on_time(now, trigger_at)
                self._on_peer_stop(now)
                self._on_unheard_peers()
                rc = self._follow_stop(now)
                if rc is None and self.stop is None:
                    rc = self._check_hang(now)
                if rc is None:
                    rc = self._check_peers(now)
                if rc is None and self.on_look is not None:
                    self.on_look(self.hangs.last_step)
            else:
                child.kill_leftovers()
                if self.stop is not None:  # asked on another node after the last look
                    self._on_peer_stop(self.clock())
            if rc is not None:
                self.outcome.exit_code = rc
                return self.outcome

    def _next_wake(self, now: float, trigger_at: float | None) -> float:
        """Seconds until the loop has something to do, if no signal comes first."""
        moments = [self.next_interval,
                   trigger_at if self.stop is None
                   else None if self.stop.waiting_for_image else self.stop.give_up_at]
        return min([TICK] + [max(0.0, t - now) for t in moments if t is not None])

    def _on_signal(self, signum: int, now: float) -> None:
        action = self.actions.get(signum)
        name = signal.Signals(signum).name
        outcome = self.outcome
        if signum in (signal.SIGUSR1, signal.SIGUSR2) and action is not Action.FORWARD \
                and self.stop is None and self.store.completion() is not None:
            # The training finished and took its final checkpoint: what runs now is the
            # script's own code after it (an evaluation, an export), which a checkpoint
            # request would only wait on and then kill. (SIGTERM still ends the command.)
            logger.info("%s after the training finished: nothing left to checkpoint; the "
                        "command's code after the training goes on", name)
            return
        if action is Action.INTERRUPT:
            self.sigints += 1
            if self.sigints >= 2:
                logger.warning("second Ctrl-C (SIGINT): killing the command now")
                self.child.kill_leftovers()
            elif self.stop is None and self._connected():
                logger.warning("Ctrl-C (SIGINT): checkpoint at the next safe point, then stop "
                               "(run the same command again to resume); Ctrl-C again to kill "
                               "the command now")
                outcome.stop_cause, outcome.stop_signal = StopCause.SIGNAL, name
                self._begin_stop(name, now)
            elif self.stop is None:  # nothing to save: the command's own business
                self.child.signal(signum)
                outcome.forwarded.append(name)
            else:
                self._keep_stop(name, "Ctrl-C (SIGINT): a checkpoint is already being taken "
                                "before the stop; the run stops after it (Ctrl-C again to "
                                "kill the command now)")
        elif action is Action.FORWARD:
            self.child.signal(signum)
            if signum != signal.SIGCONT:
                outcome.forwarded.append(name)
        elif action is Action.CHECKPOINT_STOP and self.stop is None:
            outcome.stop_cause, outcome.stop_signal = StopCause.SIGNAL, name
            self.deadline.stop_asked(name)
            # SIGTERM comes with the scheduler's kill close behind; USR1 is a warning.
            self._begin_stop(name, now, warned=signum != signal.SIGTERM)
        elif action is Action.CHECKPOINT_STOP:
            self.deadline.stop_asked(name)
            self._keep_stop(name, f"{name}: a checkpoint is already being taken before the "
                            "stop; the run stops after it")
        elif action is Action.CHECKPOINT and self.stop is None:
            self._trigger("checkpoint", name)

    def _keep_stop(self, name: str, said: str) -> None:
        """A stop signal while the deadline's stop is being taken: the one checkpoint serves
        both, and the run then ends as after that signal (it is not restarted)."""
        outcome = self.outcome
        if outcome.stop_cause is StopCause.SIGNAL:
            return  # a signal's stop already: it ends the run
        logger.warning("%s", said)
        append_event(self.store.events_path, "stop-signal", signal=name, during=(
            outcome.stop_cause.value if outcome.stop_cause else "stop"), cycle=self.cycle)
        outcome.stop_cause, outcome.stop_signal = StopCause.SIGNAL, name

    def _on_time(self, now: float, trigger_at: float | None) -> None:
        """The deadline's checkpoint, and the periodic one, when their time has come."""
        if self.stop is None and trigger_at is not None and now >= trigger_at:
            self.outcome.stop_cause = StopCause.DEADLINE
            self._begin_stop("deadline", now)
        if self.next_interval is not None and now >= self.next_interval:
            self.interval_from = now
            period = self.plan.period.seconds
            self.next_interval = now + period if period is not None else None
            # Not before the training can answer (a plain command would be asked in vain), and
            # not again before it answered the last one (a stuck or slow one).
            if self.interval_seq is not None and \
                    self.engine.confirmation(self.interval_seq) is not None:
                self.interval_seq = None
            if self.stop is None and self.interval_seq is None and self._connected() \
                    and self.store.completion() is None \
                    and not self._deadline_first(now, trigger_at):
                self.interval_seq = self._trigger("checkpoint", "interval")

    def _deadline_first(self, now: float, trigger_at: float | None) -> bool:
        """Whether the deadline's checkpoint will be asked for before a periodic one begun
        ``now`` is durable (as long as the slowest recent one took): that one would only be
        written over by the deadline's, and the deadline's would wait for it, eating into
        its lead. It is left out, and said."""
        durable = self.plan.costs.longest_durable
        if trigger_at is None or durable is None or now + durable[0] < trigger_at:
            return False
        logger.info("no periodic checkpoint now: the deadline's is asked for in %s, before "
                    "this one (%.1fs) would be durable", format_duration(trigger_at - now),
                    durable[0])
        return True

    def _on_peer_stop(self, now: float) -> None:
        """Another node's launcher was asked to stop (its pod's SIGTERM): every node
        checkpoints, then stops, as after a SIGTERM here. Asked while the deadline's stop is
        being taken, its one checkpoint serves both, and the run ends instead of restarting:
        that node's launcher is gone and would not join the next cycle."""
        if self.peer_stops is None or self.outcome.stop_cause is StopCause.SIGNAL:
            return
        name = group.stop_name(self.peer_stops())
        if name is None:
            return
        if self.stop is None:
            self.outcome.stop_cause, self.outcome.stop_signal = StopCause.SIGNAL, name
            self._begin_stop(name, now)
        else:
            self._keep_stop(name, f"{name}: a checkpoint is already being taken before the "
                            "stop; every node stops after it")

    def _on_unheard_peers(self) -> None:
        """Say once a cycle which nodes' launchers never started: their ranks are waited for."""
        if self.unheard_peers is None or self.said_unheard:
            return
        unheard = self.unheard_peers()
        if unheard:
            self.said_unheard = True
            nodes = ", ".join(map(str, unheard))
            logger.warning("the launcher of node%s %s has not been heard from since this one "
                           "started: the command waits for the ranks there. Start procckpt run "
                           "--nodes N --node-rank K with the same --dir on each node",
                           "s" if len(unheard) > 1 else "", nodes)

    def _learn(self) -> None:
        """Follow the journal: a measured checkpoint may change the period and the lead."""
        if self.plan.refresh(self.hangs.step_seconds, self.hangs.longest_gap, cycle=self.cycle):
            period = self.plan.period.seconds
            self.next_interval = self.interval_from + period if period is not None else None

    def _connected(self) -> bool:
        self.outcome.connected = self.outcome.connected or self.engine.connected()
        return self.outcome.connected

    def _check_hang(self, now: float) -> int | None:
        """Stop a command that stopped making progress, after printing its stacks; its exit
        code. The heartbeat is followed with the hang detection off too: it measures the
        longest stretch between safe points, which the deadline's lead must cover."""
        if not self.engine.reports_progress:
            return None
        self.hangs.observe(self.engine.progress(), self._connected(), now)
        quiet = self.hangs.stuck_for(now)
        if quiet is None:
            return None
        step = self.hangs.last_step
        logger.error("no step completed for %s and the training thread's stack did not move "
                     "(%s): the training looks stuck. The stacks of its processes follow, then "
                     "it is stopped and restarted from its last checkpoint",
                     format_duration(quiet),
                     "before its first step" if step is None else f"last step {step}")
        append_event(self.store.events_path, "hang", step=step, seconds=round(quiet, 3),
                     timeout=self.hangs.timeout, cycle=self.cycle)
        self.dump_stacks(self.child.pid)
        self.carried += self.wait(STACK_DUMP_WAIT)
        self.outcome.hung = True
        return self._stop_child()

    def _check_peers(self, now: float) -> int | None:
        """A rank ended by an exception while the command runs on: its peers may be waiting
        for a rank that died with its node. Stop the command when a node of the job is lost;
        its exit code then."""
        if self.lost_nodes is None or now < self.next_failure_look:
            return None
        if self.rank_failed is None:
            self.next_failure_look = now + FAILURE_POLL
            # A rank the audit stopped (--audit strict) said why itself, and its peers stop too.
            found = [f for f in self.engine.failures()
                     if not str(f.get("error", "")).startswith(AUDIT_REFUSED)]
            if not found:
                return None
            first = found[0]
            logger.info("rank %s on %s ended with %s; the command runs on", first.get("rank"),
                        first.get("host"), first.get("error"))
            append_event(self.store.events_path, "rank-failed", rank=first.get("rank"),
                         node=first.get("host"), error=first.get("error"), cycle=self.cycle)
            self.rank_failed, self.next_failure_look = now, now + PEER_WAIT
            return None
        self.next_failure_look = now + NODE_CHECK_EVERY
        lost = list(self.lost_nodes())
        if not lost:
            return None
        self.outcome.lost_nodes = lost
        logger.error("the job lost %s: the command waits in vain for its ranks there; "
                     "stopping it", ", ".join(map(str, lost)))
        return self._stop_child()

    def _follow_stop(self, now: float) -> int | None:
        """Follow a stop in progress; the command's exit code once we stopped it."""
        stop, outcome = self.stop, self.outcome
        if stop is None:
            return None
        if stop.exit_by is None:
            outcome.confirmed = self.engine.confirmation(stop.seq)
            if outcome.confirmed is None:
                if now < stop.give_up_at:
                    return None
                if self.engine.writing(stop.seq):
                    if not stop.waiting_for_image:
                        stop.waiting_for_image = True
                        logger.warning("the stop's image is still being written after %s; "
                                       "waiting for it (stopping the command now would leave "
                                       "no image)", format_duration(now - stop.asked_at))
                    return None
                logger.warning("no checkpoint confirmed within %s%s; stopping the command",
                               format_duration(stop.give_up_at - stop.asked_at),
                               "" if self._connected() else " (the command never connected "
                               "to procckpt)")
                append_event(self.store.events_path, "unconfirmed", cycle=self.cycle,
                             connected=self._connected())
                return self._stop_child()
            outcome.connected = True
            # Confirmed: the command may still exit by itself. One that was never told to stop
            # (no checkpoint: DMTCP took no image of it) may still finish, until the stop's
            # wait would end; it is stopped then, its exit bounded (term_timeout) before that.
            stop.exit_by = now + EXIT_AFTER_CONFIRM if outcome.confirmed.stopping \
                else max(now, stop.give_up_at - self.term_timeout)
            log_confirmed(self.store, outcome.confirmed, now - stop.asked_at, self.cycle)
        return self._stop_child() if now >= stop.exit_by else None

    def _begin_stop(self, reason: str, now: float, warned: bool = False) -> None:
        self.outcome.stop_started = now
        seq = self._trigger("stop", reason)
        self.stop = _Stop(seq, asked_at=now, give_up_at=self._give_up_at(now, warned))

    def _give_up_at(self, now: float, warned: bool) -> float:
        """When a stop asked at ``now`` stops waiting for its checkpoint: the lead later; but
        a warning (USR1) to a command that has not connected yet waits as long as STARTUP_WAIT
        allows, and stopping it still ends before the deadline (the request waits in the
        control dir for its first safe point)."""
        give_up = now + self.plan.lead.seconds
        end = self.deadline.end(self.started, now)
        if not warned or end is None or self._connected():
            return give_up
        return max(give_up, min(end - self.term_timeout, now + STARTUP_WAIT))

    def _trigger(self, action: str, reason: str) -> int:
        logger.info("asking for a checkpoint%s (%s)", " then stop" if action == "stop" else "",
                    reason)
        append_event(self.store.events_path, "trigger", action=action, reason=reason,
                     cycle=self.cycle)
        try:
            return self.engine.request(action, reason)
        except RequestUndelivered as e:
            # The launcher goes on supervising: a stop is then asked for the way a scheduler
            # would, with SIGTERM, which the Checkpointer also takes as "checkpoint, then stop".
            logger.warning("%s%s", e, "; sending SIGTERM instead" if action == "stop" else "")
            if action == "stop":
                self.child.signal(signal.SIGTERM)
            elif e.lasting and self.stop is None:
                # No checkpoint can be written there either: training on would be lost. The
                # stop's own checkpoint fails too, and ends the run with its one line.
                self._begin_stop("the checkpoint dir's file system takes no more writes",
                                 self.clock())
            return e.seq

    def _stop_child(self) -> int:
        rc = self.child.stop(term_timeout=self.term_timeout)
        return rc if rc is not None else 128 + signal.SIGKILL


def log_confirmed(store: CheckpointStore, c: Confirmation, waited: float, cycle: int) -> None:
    """Say (and journal) that the engine confirmed checkpoint ``c`` after ``waited`` seconds."""
    if c.checkpoint is None:
        logger.warning("the checkpoint failed after %.1fs: %s", waited, c.error or "unknown")
    else:
        logger.info("checkpoint %s confirmed%s after %.1fs", c.checkpoint,
                    "" if c.step is None else f" (step {c.step})", waited)
    append_event(store.events_path, "confirmed", checkpoint=c.checkpoint, step=c.step,
                 seconds=round(waited, 3), cycle=cycle)
