"""The run loop: start -> watch -> trigger -> checkpoint -> stop -> restart, requeue or exit.

Signals the launcher handles (the one table; README.md repeats it for users):

    signal          what procckpt run does
    -------------   -------------------------------------------------------------------------
    SIGTERM         checkpoint now, then stop the command (Slurm's time limit, preemption,
                    scancel, Kubernetes' pod termination all start with SIGTERM)
    SIGUSR1         the same: checkpoint now, then stop. Default of --checkpoint-signal, which
                    `procckpt sbatch` asks Slurm to send (`--signal=B:USR1@grace`)
    SIGUSR2         checkpoint now and keep training (a snapshot on demand)
    SIGINT, SIGHUP  forwarded to the command's process group; a second SIGINT kills it
    SIGCONT         forwarded (Slurm sends it with SIGTERM to wake suspended jobs)

USR1/USR2 are never forwarded raw: NCCL installs a SIGUSR1 handler and DMTCP uses SIGUSR2
internally, so the request reaches the training process through ``control/`` instead. Under
``--engine dmtcp`` DMTCP's own checkpoint signal is moved to SIGRTMIN+6 (engines/dmtcp/engine.py).
Handlers only record the signal (via the wakeup pipe); the loop below acts on it.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..protocol import control as ctl
from . import pid1
from .child import Child
from .config import RunConfig
from .deadline import Deadline
from ..durations import format_duration
from .engines import Confirmation, Engine, RequestUndelivered
from ..errors import EX_IOERR, EX_NOT_SAVED, EX_TEMPFAIL
from ..protocol.events import append_event
from .restart import Decision, RestartPolicy, StopCause
from ..store import CheckpointStore

__all__ = ["Supervisor", "RunResult", "ExitReason", "CycleOutcome"]

logger = logging.getLogger(__name__)

#: The loop wakes at least this often (to poll the child and the deadline).
TICK = 1.0
#: Cycles in a row without a new checkpoint after which a local restart loop gives up.
NO_PROGRESS_CYCLES = 3
#: After the checkpoint is confirmed, the command gets this long to exit by itself.
EXIT_AFTER_CONFIRM = 15.0

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT,
                   signal.SIGHUP, signal.SIGCONT)


class Action(enum.Enum):
    CHECKPOINT_STOP = "checkpoint-stop"
    CHECKPOINT = "checkpoint"
    FORWARD = "forward"


def signal_actions(checkpoint_signal: str) -> dict[int, Action]:
    table = {
        signal.SIGTERM: Action.CHECKPOINT_STOP,
        signal.SIGUSR1: Action.CHECKPOINT_STOP,
        signal.SIGUSR2: Action.CHECKPOINT,
        signal.SIGINT: Action.FORWARD,
        signal.SIGHUP: Action.FORWARD,
        signal.SIGCONT: Action.FORWARD,
    }
    table[getattr(signal, f"SIG{checkpoint_signal}")] = Action.CHECKPOINT_STOP
    return table


class ExitReason(enum.Enum):
    FINISHED = "finished"
    ALREADY_COMPLETE = "already-complete"
    CHECKPOINTED = "checkpointed"  # stopped with a checkpoint, resume later (exit 75)
    REQUEUED = "requeued"  # the scheduler will start it again (exit 0)
    BUDGET_EXHAUSTED = "budget-exhausted"
    NO_PROGRESS = "no-progress"
    NOT_CHECKPOINTABLE = "not-checkpointable"  # stopped, nothing could be saved (exit 124)
    STORAGE_FAILED = "storage-failed"  # no space, no permission, a read error (exit 74)
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass
class RunResult:
    exit_code: int
    reason: ExitReason
    cycles: int
    message: str = ""


@dataclass
class CycleOutcome:
    exit_code: int
    stop_cause: StopCause | None = None  # why we stopped it (None: it exited on its own)
    stop_signal: str | None = None
    confirmed: Confirmation | None = None  # the stop's checkpoint, if one was confirmed
    finished: bool = False
    connected: bool = False
    forwarded: list[str] = field(default_factory=list)
    retry: str | None = None  # the engine runs the next cycle differently (why), see after_exit
    stop_started: float | None = None  # when the stop's checkpoint was asked for


class Supervisor:
    """Runs one ``procckpt run`` invocation to its end.

    ``clock``, ``child_factory`` and ``wait_signals`` are seams for unit tests (a fake clock,
    a fake child, and a wait that advances the fake clock instead of sleeping, returning the
    signals that "arrived"); the end-to-end tests run real processes with real signals.
    """

    def __init__(self, config: RunConfig, store: CheckpointStore, engine: Engine,
                 deadline: Deadline, policy: RestartPolicy, *,
                 extra_env: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 child_factory: Callable[..., Child] = Child,
                 wait_signals: Callable[[float], list[int]] | None = None) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.deadline = deadline
        self.policy = policy
        self.extra_env = extra_env or {}
        self._clock = clock
        self._child_factory = child_factory
        self._wait = wait_signals
        self._actions = signal_actions(config.checkpoint_signal)
        #: As PID 1 (a container's entrypoint) orphans are ours to reap; see pid1.py.
        self._reap_orphans = pid1.is_init()
        self._wakeup_r = -1
        self._old_handlers: dict[int, Any] = {}
        self.cycles = 0

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> RunResult:
        if self._wait is not None:  # a test drives the signals
            return self._run()
        self._install_signals()
        self._wait = self._wait_signals
        try:
            return self._run()
        finally:
            self._restore_signals()
            self._wait = None

    def _run(self) -> RunResult:
        restarts = self.policy.initial_restarts
        last_step: int | None = self._latest_step()
        stalled = 0
        append_event(self.store.events_path, "start", argv=self.config.command,
                     engine=self.engine.name, deadline=self.deadline.source, restart=restarts,
                     job_id=os.environ.get("SLURM_JOB_ID"))
        while True:
            self.cycles += 1
            outcome = self._run_cycle(restarts)
            if outcome.retry is not None:
                logger.warning("%s", outcome.retry)
                append_event(self.store.events_path, "fallback", message=outcome.retry,
                             cycle=self.cycles)
                continue
            if outcome.exit_code == EX_IOERR and not outcome.finished:
                return self._exit(EX_IOERR, ExitReason.STORAGE_FAILED,
                                  f"the training could not read or write its checkpoints in "
                                  f"{self.store.root} (its error is above); that would fail "
                                  "again, so it is not restarted: fix the storage, then run the "
                                  "same command again to resume", error=True)
            if outcome.finished:
                # A run that marked itself complete and was then stopped by us (the deadline
                # came while it was exiting: torchrun and its workers take seconds) finished.
                if outcome.exit_code == 0 or outcome.stop_cause is not None:
                    return self._exit(0, ExitReason.FINISHED, "training finished")
                return self._exit(outcome.exit_code, ExitReason.FAILED,
                                  f"training finished but the command then exited with "
                                  f"{outcome.exit_code}")
            if outcome.stop_cause is None and outcome.confirmed is None:
                result = self._after_unrequested_exit(outcome, restarts)
                if result is not None:
                    return result
                restarts += 1
                continue
            # A command that has checkpointed before and merely started too slowly this time
            # (torchrun and its workers under load) makes no progress; it is not unable to.
            if outcome.confirmed is None and not outcome.connected and last_step is None:
                return self._exit(EX_NOT_SAVED, ExitReason.NOT_CHECKPOINTABLE,
                                  f"the command was stopped ({_cause_text(outcome)}) but it "
                                  "never connected to procckpt, so nothing was saved and a "
                                  "rerun starts from the beginning: use procckpt.Checkpointer "
                                  "in the script, or --engine dmtcp", error=True)
            step = outcome.confirmed.step if outcome.confirmed else None
            if step is None or (last_step is not None and step <= last_step):
                stalled += 1
                logger.warning("cycle %d ended without a new checkpoint; the next cycle %s",
                               self.cycles, self._resumes_from())
            else:
                stalled = 0
                last_step = step
            cause = outcome.stop_cause or StopCause.CHILD
            verdict = self.policy.after_stop(cause, outcome.stop_signal, restarts)
            if verdict.decision is Decision.RESTART_HERE and stalled >= NO_PROGRESS_CYCLES:
                return self._exit(EX_TEMPFAIL, ExitReason.NO_PROGRESS,
                                  f"{stalled} cycles in a row made no progress: the time left "
                                  "before the checkpoint is too short to start and train; raise "
                                  "--time-limit or lower --grace")
            if verdict.decision is Decision.RESTART_HERE:
                restarts += 1
                logger.info("restarting (%s)", verdict.message)
                append_event(self.store.events_path, "restart", restart=restarts,
                             cause=cause.value, step=last_step)
                continue
            if verdict.decision is Decision.REQUEUED:
                return self._exit(0, ExitReason.REQUEUED, verdict.message)
            if verdict.decision is Decision.BUDGET_EXHAUSTED:
                return self._exit(EX_TEMPFAIL, ExitReason.BUDGET_EXHAUSTED, verdict.message,
                                  error=True)
            return self._exit(EX_TEMPFAIL, ExitReason.CHECKPOINTED, verdict.message)

    def _after_unrequested_exit(self, outcome: CycleOutcome, restarts: int) -> RunResult | None:
        """The result for a command that exited without being asked to; None to restart it."""
        code = outcome.exit_code
        if outcome.forwarded:
            return self._exit(code, ExitReason.INTERRUPTED,
                              f"the command exited with {code} after "
                              f"{', '.join(outcome.forwarded)}")
        if code == 0:
            if not outcome.connected:
                return self._exit(0, ExitReason.FINISHED, "the command exited 0")
            return self._exit(0, ExitReason.FINISHED,
                              "the command exited 0 before the end of its ckpt.epochs() loop "
                              "(a break?), so the run is not marked complete and running it "
                              f"again {self._resumes_from(verb='resumes')}; to end training "
                              "early, call ckpt.finish() before break")
        ended = _ending(code)
        if self.config.restart_on_failure and restarts < self.config.max_restarts:
            logger.warning("the command %s; restarting (--restart-on-failure): the next cycle "
                           "%s", ended, self._resumes_from())
            append_event(self.store.events_path, "restart", restart=restarts + 1,
                         cause="failure", exit_code=code)
            return None
        hint = ("" if self.config.restart_on_failure
                else ", not restarted (see --restart-on-failure)")
        return self._exit(code, ExitReason.FAILED,
                          f"the command {ended}{hint}; running the same command again "
                          f"{self._resumes_from(verb='resumes')}", error=True)

    def _resumes_from(self, verb: str = "resumes") -> str:
        """Where the next start of the command begins, in words: 'resumes from ckpt-N
        (step S)' or 'starts from the beginning (no checkpoint yet)'."""
        try:
            infos = self.store.checkpoints()
        except OSError:
            infos = []
        if not infos:
            return "starts from the beginning (no checkpoint yet)"
        step = f" (step {infos[0].step})" if infos[0].step is not None else ""
        return f"{verb} from {infos[0].name}{step}"

    def _exit(self, code: int, reason: ExitReason, message: str, error: bool = False,
              ) -> RunResult:
        append_event(self.store.events_path, "exit", code=code, reason=reason.value,
                     message=message, cycles=self.cycles)
        (logger.error if error else logger.info)("%s", message)
        return RunResult(code, reason, self.cycles, message)

    def _latest_step(self) -> int | None:
        infos = self.store.checkpoints()
        return infos[0].step if infos else None

    # -- one cycle -------------------------------------------------------------------------
    def _run_cycle(self, restarts: int) -> CycleOutcome:
        token = uuid.uuid4().hex
        self.store.clean_temporaries()  # what a killed command of the last cycle left half-written
        argv, engine_env = self.engine.start_cycle(self.config.command, token)
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(engine_env)
        env.update({ctl.ENV_DIR: str(self.store.root), ctl.ENV_RESTART: str(restarts),
                    ctl.ENV_CYCLE: str(self.cycles), ctl.ENV_ENGINE: self.engine.name})
        child = self._child_factory(argv, env)
        started = self._clock()
        child.start()
        notify_started = getattr(self.engine, "child_started", None)
        if notify_started is not None:
            notify_started(child.pid)
        end = self.deadline.end(started, started)
        logger.info("cycle %d: started %s (pid %d, %s%s)", self.cycles, " ".join(argv),
                    child.pid, self.deadline.source,
                    f", checkpoint at {format_duration(end - started - self._grace())}"
                    if end is not None else "")
        append_event(self.store.events_path, "cycle", cycle=self.cycles, pid=child.pid,
                     restart=restarts, engine=self.engine.name)
        outcome = self._watch(child, started)
        outcome.connected = outcome.connected or self.engine.connected()
        final = self.engine.end_cycle()
        if outcome.confirmed is None and final is not None:
            # The command confirmed and exited between two looks of the watch loop (or it
            # stopped itself): the journal still gets its confirmation.
            outcome.confirmed = final
            since = outcome.stop_started if outcome.stop_started is not None else started
            self._log_confirmed(final, self._clock() - since)
        after_exit = getattr(self.engine, "after_exit", None)
        if after_exit is not None:
            requested = (outcome.stop_cause is not None or outcome.confirmed is not None
                         or bool(outcome.forwarded))
            outcome.retry = after_exit(outcome.exit_code, requested)
        complete = self.store.is_complete()
        outcome.finished = bool(complete) and complete.get("token") in (token, None)
        return outcome

    def _grace(self) -> float:
        limit = getattr(self.deadline, "limit", None)
        return self.config.grace_for(limit)

    def _watch(self, child: Child, started: float) -> CycleOutcome:
        outcome = CycleOutcome(exit_code=-1)
        interval = self.config.interval
        next_interval = started + interval if interval else None
        stop_seq: int | None = None
        give_up_at = 0.0
        exit_by = 0.0
        sigints = 0
        while True:
            now = self._clock()
            end = self.deadline.end(started, now)
            trigger_at = end - self._grace() if end is not None else None
            waits = [TICK]
            for t in (trigger_at if stop_seq is None else None, next_interval,
                      give_up_at if stop_seq is not None else None):
                if t is not None:
                    waits.append(max(0.0, t - now))
            for signum in self._wait(min(waits)):  # type: ignore[misc]
                action = self._actions.get(signum)
                name = signal.Signals(signum).name
                if action is Action.FORWARD:
                    sigints += signum == signal.SIGINT
                    if sigints >= 2:
                        logger.warning("second SIGINT: killing the command")
                        child.kill_leftovers()
                    else:
                        child.signal(signum)
                        if signum != signal.SIGCONT:
                            outcome.forwarded.append(name)
                elif action is Action.CHECKPOINT_STOP and stop_seq is None:
                    outcome.stop_cause, outcome.stop_signal = StopCause.SIGNAL, name
                    stop_seq, give_up_at = self._begin_stop(name, now, child)
                    outcome.stop_started = now
                elif action is Action.CHECKPOINT and stop_seq is None:
                    self._trigger("checkpoint", name, child)
            if self._reap_orphans:
                pid1.reap_orphans({child.pid})
            rc = child.poll()
            if rc is not None:
                outcome.exit_code = rc
                child.kill_leftovers()
                break
            now = self._clock()
            if stop_seq is None and trigger_at is not None and now >= trigger_at:
                outcome.stop_cause = StopCause.DEADLINE
                stop_seq, give_up_at = self._begin_stop("deadline", now, child)
                outcome.stop_started = now
            if next_interval is not None and now >= next_interval:
                next_interval = now + interval  # type: ignore[operator]
                if stop_seq is None:
                    self._trigger("checkpoint", "interval", child)
            if stop_seq is None:
                continue
            if outcome.confirmed is None:
                outcome.confirmed = self.engine.confirmation(stop_seq)
                if outcome.confirmed is not None:
                    outcome.connected = True
                    exit_by = now + EXIT_AFTER_CONFIRM
                    self._log_confirmed(outcome.confirmed, now - (give_up_at - self._grace()))
                elif now >= give_up_at:
                    connected = outcome.connected or self.engine.connected()
                    logger.warning("no checkpoint confirmed within the %s grace%s; stopping the "
                                   "command", format_duration(self._grace()),
                                   "" if connected else " (the command never connected to "
                                   "procckpt)")
                    append_event(self.store.events_path, "unconfirmed", cycle=self.cycles)
                    outcome.exit_code = self._stop_child(child)
                    break
            elif now >= exit_by:
                outcome.exit_code = self._stop_child(child)
                break
        return outcome

    def _begin_stop(self, reason: str, now: float, child: Child) -> tuple[int, float]:
        seq = self._trigger("stop", reason, child)
        return seq, now + self._grace()

    def _trigger(self, action: str, reason: str, child: Child) -> int:
        logger.info("asking for a checkpoint%s (%s)", " then stop" if action == "stop" else "",
                    reason)
        append_event(self.store.events_path, "trigger", action=action, reason=reason,
                     cycle=self.cycles)
        try:
            return self.engine.request(action, reason)
        except RequestUndelivered as e:
            # The launcher goes on supervising: a stop is then asked for the way a scheduler
            # would, with SIGTERM, which the Checkpointer also takes as "checkpoint, then stop".
            logger.warning("%s%s", e, "; sending SIGTERM instead" if action == "stop" else "")
            if action == "stop":
                child.signal(signal.SIGTERM)
            return e.seq

    def _log_confirmed(self, c: Confirmation, waited: float) -> None:
        if c.checkpoint is None:
            logger.warning("the checkpoint failed after %.1fs: %s", waited, c.error or "unknown")
        else:
            logger.info("checkpoint %s confirmed (step %s) after %.1fs", c.checkpoint, c.step,
                        waited)
        append_event(self.store.events_path, "confirmed", checkpoint=c.checkpoint, step=c.step,
                     seconds=round(waited, 3), cycle=self.cycles)

    def _stop_child(self, child: Child) -> int:
        rc = child.stop(term_timeout=self.config.term_timeout)
        return rc if rc is not None else 128 + signal.SIGKILL

    # -- signals ---------------------------------------------------------------------------
    def _install_signals(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wakeup_r, self._wakeup_w = r, w
        for signum in (*HANDLED_SIGNALS, signal.SIGCHLD,
                       getattr(signal, f"SIG{self.config.checkpoint_signal}")):
            # The handler does nothing: the C-level handler already wrote the signal's number
            # into the wakeup pipe, which the loop reads. Nothing runs inside the handler.
            self._old_handlers[signum] = signal.signal(signum, _record_only)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def _restore_signals(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        os.close(self._wakeup_r)
        os.close(self._wakeup_w)

    def _wait_signals(self, timeout: float) -> list[int]:
        try:
            ready, _, _ = select.select([self._wakeup_r], [], [], timeout)
        except InterruptedError:
            ready = [self._wakeup_r]
        if not ready:
            return []
        try:
            data = os.read(self._wakeup_r, 4096)
        except BlockingIOError:
            return []
        return [b for b in data if b != signal.SIGCHLD]


def _record_only(signum: int, frame: object) -> None:
    pass


def _ending(code: int) -> str:
    """How the command ended, in words: 'was killed by signal 9 (SIGKILL)' or 'failed with
    exit code 3'."""
    if code > 128:
        try:
            return f"was killed by signal {code - 128} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"failed with exit code {code}"


def _cause_text(outcome: CycleOutcome) -> str:
    if outcome.stop_cause is StopCause.DEADLINE:
        return "its time limit was near"
    return outcome.stop_signal or "stop request"

