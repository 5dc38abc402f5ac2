"""The run loop: start -> watch -> trigger -> checkpoint -> stop -> restart, requeue or exit.

One run is a sequence of cycles (starts of the command). Each cycle is watched until the
command exits, or until a signal or the deadline asks for a checkpoint, the checkpoint is
confirmed and the command stopped; then the restart policy (restart.py, or the Slurm one)
says whether to restart here, requeue, or exit. Signals reach the loop through a wakeup pipe
(signals.py, which has the table of what each one means); no handler acts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ..durations import format_duration
from ..errors import EX_AUDIT, EX_DATAERR, EX_IOERR, EX_USAGE
from ..protocol import control as ctl
from ..protocol import group
from ..protocol.events import append_event
from ..protocol.group import LeaderBoard
from ..store import CheckpointStore
from . import pid1
from .child import Child
from .config import RunConfig
from .deadline import Deadline
from .decide import (
    OWN_EXIT_CODES,
    Action,
    RunSoFar,
    Step,
    after_cycle,
    after_node_loss,
    after_verdict,
    procckpt_code,
)
from .engines import Engine
from .engines.choice import imports_procckpt
from .hang import HangWatch, dump_stacks
from .loop import RunLoop
from .plan import CheckpointPlan
from .restart import RestartPolicy, StopCause
from .results import CycleOutcome, ExitReason, RunResult, exit_words
from .said import newest_intact, restart_number, resumes_from
from .signals import HANDLED_SIGNALS, SignalPipe, signal_actions
from .tier import LauncherTier
from .warm import WarmRestarts
from .watch import CycleWatch, log_confirmed

__all__ = ["Supervisor", "RunResult", "ExitReason", "CycleOutcome"]

logger = logging.getLogger(__name__)

#: Restarts after a failure: the same failure from the same checkpoint this often in a row
#: stops the run; before each restart the launcher waits, twice as long each time.
SAME_FAILURE_LIMIT = 3
BACKOFF_FIRST = 2.0
BACKOFF_MAX = 60.0
#: Where torch.compile (Inductor, and Triton under it) keeps compiled kernels: in the
#: checkpoint dir, unless the environment says otherwise.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_CACHE_DIR = "compile-cache"


class Supervisor(RunLoop):
    """Runs one ``procckpt run`` invocation to its end.

    ``clock``, ``child_factory``, ``wait_signals`` and ``stack_dumper`` are seams for unit
    tests (a fake clock, a fake child, a wait that advances the fake clock instead of sleeping,
    returning the signals that "arrived", and a record of whose stacks were asked for); the
    end-to-end tests run real processes with real signals.
    """

    def __init__(self, config: RunConfig, store: CheckpointStore, engine: Engine,
                 deadline: Deadline, policy: RestartPolicy, *,
                 extra_env: dict[str, str] | None = None,
                 tier: LauncherTier | None = None,
                 warm: WarmRestarts | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 child_factory: Callable[..., Child] = Child,
                 wait_signals: Callable[[float], list[int]] | None = None,
                 stack_dumper: Callable[[int], None] = dump_stacks) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.deadline = deadline
        self.policy = policy
        #: The memory tier (tier.py): the newest state the training kept there is copied to
        #: the store after each cycle where it is newer than the newest checkpoint.
        self.tier = tier
        self.extra_env = {**(extra_env or {}), **(tier.env() if tier is not None else {})}
        #: A spare interpreter for the next restart (warm.py), where the command allows one.
        self.warm = warm
        self._clock = clock
        self._child_factory = child_factory
        self._wait = wait_signals
        self._dump_stacks = stack_dumper
        self._actions = signal_actions(config.checkpoint_signal)
        #: As PID 1 (a container's entrypoint) orphans are ours to reap; see pid1.py.
        self._reap_orphans = pid1.is_init()
        #: The period of checkpoints and the deadline's lead, from what checkpoints cost here.
        self.plan = CheckpointPlan(config, deadline, store.events_path)
        self.hangs = HangWatch(config.hang_timeout)
        #: Signals that arrived while a hung command printed its stacks: for the next cycle.
        self._carried_signals: list[int] = []
        self._signals = SignalPipe((*HANDLED_SIGNALS,
                                    getattr(signal, f"SIG{config.checkpoint_signal}")))
        self.cycles = 0
        #: Failures restarted by --restart-on-failure: the last one's (exit code, newest
        #: checkpoint's step), and how often in a row it came so.
        self._last_failure: int | None = None  # the newest checkpoint's step at the last
        self._same_failures = 0  # failures in a row from there, and their exit codes:
        self._failure_codes: list[int] = []
        #: The newest checkpoint's step when the current cycle began: a crash after a newer
        #: one is restarted by default.
        self._cycle_from: int | None = None
        #: Wall-clock time the last cycle's command was seen to end: the next cycle's
        #: recovery is timed from there (training/link/timing.py).
        self._cycle_ended: float | None = None
        #: A run on several nodes, each with its launcher: this one, node 0's, leads.
        self.board = LeaderBoard(store.control_dir, config.nodes) if config.nodes > 1 else None

    # -- the whole run ---------------------------------------------------------------------
    def _run(self) -> RunResult:
        restarts = self.policy.initial_restarts
        last_step: int | None = self._latest_step()
        stalled = 0
        append_event(self.store.events_path, "start", argv=self.config.command,
                     engine=self.engine.name, deadline=self.deadline.source, restart=restarts,
                     job_id=os.environ.get("SLURM_JOB_ID"))
        logger.info("checkpoint dir %s: the command %s", self.store.root,
                    resumes_from(self.store).replace("(no checkpoint yet)",
                                                 "(nothing was saved there yet)"))
        room = self.store.room_shortfall()
        if room is not None:
            logger.warning("%s", room)
        if self.hangs.enabled and not self.engine.reports_progress:
            if not isinstance(self.config.hang_timeout, str):
                logger.warning("--hang-timeout needs the hooks engine (the training reports its "
                               "steps through procckpt.Checkpointer); the %s engine cannot see "
                               "steps, so hangs go undetected", self.engine.name)
            self.hangs.setting = None
        while True:
            self.cycles += 1
            outcome = self._run_cycle(restarts)
            if self.tier is not None:
                self.tier.keep_newest(self.store, self.cycles)
            # A command that has checkpointed before, or whose script imports procckpt, and
            # merely started too slowly (torchrun and its workers under load) makes no
            # progress; it is not unable to.
            slow = None if outcome.connected or outcome.confirmed or outcome.stop_cause is None \
                else self._slow_start()
            step = after_cycle(outcome, RunSoFar(restarts, self.config.max_restarts, last_step,
                                                 self.engine.stuck, slow))
            progress, verdict_message = None, ""
            if step.action is Action.ASK_POLICY:
                progress = outcome.confirmed.progress if outcome.confirmed else None
                if progress is None or (last_step is not None and progress <= last_step):
                    stalled += 1
                    logger.warning("cycle %d %s; the next cycle %s", self.cycles,
                                   (slow or "ended without a checkpoint") if progress is None
                                   else "made no progress: its checkpoint is no further than "
                                   "the one before it", resumes_from(self.store))
                else:
                    stalled, last_step = 0, progress
                cause = outcome.stop_cause or StopCause.CHILD
                verdict = self.policy.after_stop(cause, outcome.stop_signal, restarts)
                verdict_message = verdict.message
                step = after_verdict(verdict.decision, stalled, saved=progress is not None)
            if step.action is Action.RETRY:
                logger.warning("%s", outcome.retry)
                append_event(self.store.events_path, "fallback", message=outcome.retry,
                             cycle=self.cycles)
                continue
            if step.action is Action.NODE_LOSS:
                return self._after_node_loss(outcome.lost_nodes, restarts)
            if step.action is Action.UNREQUESTED:
                # (A pod's SIGTERM may also fall into the failure's back-off there.)
                result = self._after_unrequested_exit(outcome, restarts) \
                    or self._stop_asked_between_cycles()
                if result is not None:
                    return result
                restarts += 1
                continue
            if step.action is Action.RESTART:
                asked = self._stop_asked_between_cycles()
                if asked is not None:
                    return asked
                restarts += 1
                self._restarting(step, outcome, restarts, progress, verdict_message)
                continue
            return self._ending(step, outcome, verdict_message, stalled, restarts)

    def _stop_asked_between_cycles(self) -> RunResult | None:
        """The run's end, when another node's launcher asked every node to stop (its pod's
        SIGTERM) after the last cycle's last look: that node would not join the next cycle,
        which would wait for its ranks until the node is taken for lost. None otherwise."""
        asked = group.stop_name(self.board.stop_requests()) if self.board is not None else None
        if asked is None:
            return None
        append_event(self.store.events_path, "stop-signal", signal=asked, during="restart",
                     cycle=self.cycles)
        return self._exit(ExitReason.CHECKPOINTED, f"stopped after {asked}, before a restart; "
                          f"running the same command again {resumes_from(self.store)}")

    def _restarting(self, step: Step, outcome: CycleOutcome, restarts: int,
                    progress: int | None, verdict: str) -> None:
        """Say and journal a restart here: after a hang, or after a stop."""
        if step.why == "hang":
            logger.warning("restarting the hung command: the next cycle %s",
                           resumes_from(self.store))
            append_event(self.store.events_path, "restart", restart=restarts, cause="hang",
                         step=self.hangs.last_step)
            return
        number = restart_number(self.store, restarts)
        logger.info("restarting (%s)", verdict if number == restarts else
                    f"restart {number} of the training; {verdict} in this launch")
        cause = outcome.stop_cause or StopCause.CHILD
        append_event(self.store.events_path, "restart", restart=restarts, cause=cause.value,
                     step=progress if outcome.confirmed and outcome.confirmed.step is not None
                     else None)

    def _ending(self, step: Step, outcome: CycleOutcome, verdict: str, stalled: int,
                restarts: int) -> RunResult:
        """The run's end, in words, with the exit code of decide.py's table."""
        reason = step.reason
        assert reason is not None
        failed = outcome.confirmed
        if failed is not None and failed.checkpoint is None and failed.error:
            unsaved = (f"the checkpoint after {outcome.stop_text} failed ({failed.error}), so "
                       "the work since the last checkpoint is lost; ")
        else:
            unsaved = (f"no checkpoint was taken after {outcome.stop_text}: the command "
                       "reached no safe point before it was stopped, so the work since the "
                       "last checkpoint is lost; ")
        if step.why == "engine-stuck":
            message = (f"{self.engine.stuck}. Running the same command again "
                       f"{resumes_from(self.store)}")
        elif step.why == "never-connected":
            message = (f"the command was stopped ({outcome.stop_text}) but it never connected "
                       "to procckpt, so nothing was saved and a rerun starts from the "
                       "beginning: use procckpt.Checkpointer in the script, or --engine dmtcp")
        elif step.why == "finished-then-failed":
            message = f"training finished but the command then exited with {outcome.exit_code}"
        elif reason is ExitReason.HUNG:
            message = (f"the command hung again after {restarts} restarts "
                       f"(--max-restarts {self.config.max_restarts}); its stacks are in the "
                       "log above")
        elif reason is ExitReason.STORAGE_FAILED:
            message = (f"the training could not read or write its checkpoints in "
                       f"{self.store.root} (its error is above); that would fail again, so it "
                       f"is not restarted; {newest_intact(self.store)}: fix the storage, then "
                       "run the same command again to resume")
        elif reason is ExitReason.CHECKPOINTS_UNUSABLE:
            message = (f"no checkpoint of {self.store.root} can be used (the training's error "
                       "above says why); a restart would find the same, so it is not "
                       "restarted")
        elif reason is ExitReason.AUDIT_REFUSED:
            message = ("the resumed training stopped before its first batch (--audit strict): "
                       "that batch was not the one the interrupted run was about to train on "
                       "(the training's line above says which); a restart would resume the same "
                       "way, so it is not restarted: make the data order resumable, or run with "
                       "--audit warn to go on")
        elif reason is ExitReason.FINISHED:
            message = "training finished"
        elif reason is ExitReason.NO_PROGRESS:
            message = (f"{stalled} cycles in a row made no progress: the time left before the "
                       "checkpoint is too short to start and train; raise --time-limit or "
                       "lower --grace")
        elif reason is ExitReason.UNSAVED_STOP:
            message = f"{unsaved}running the same command again {resumes_from(self.store)}"
        else:  # the policy's words: requeued, budget exhausted, checkpointed
            saved = outcome.confirmed is not None and outcome.confirmed.progress is not None
            message = verdict if saved else unsaved + verdict
        quiet = reason in (ExitReason.FINISHED, ExitReason.REQUEUED, ExitReason.CHECKPOINTED,
                           ExitReason.NO_PROGRESS)
        return self._exit(reason, message, error=not quiet, command_code=outcome.exit_code)

    def _lost_nodes(self, outcome: CycleOutcome) -> list[object]:
        """The nodes of the job lost by the end of a cycle that failed, hung or never had its
        stop confirmed (the policy asks the scheduler); [] otherwise."""
        if outcome.lost_nodes:
            return outcome.lost_nodes
        if outcome.finished or outcome.confirmed is not None or outcome.forwarded \
                or outcome.audit_refused:
            return []
        if outcome.hung or outcome.stop_cause is not None or (
                outcome.exit_code != 0 and outcome.procckpt_code not in (EX_IOERR, EX_DATAERR)):
            # A stop a signal asked for ended the cycle whatever a silent launcher elsewhere
            # means (one that never started, say): the signal is what the end is said of.
            return self._find_lost_nodes(silent=outcome.stop_cause is not StopCause.SIGNAL)
        return []

    def _find_lost_nodes(self, silent: bool = True) -> list[object]:
        """The scheduler's lost nodes; on several nodes with a launcher each, also (with
        ``silent``) the nodes whose launcher went silent."""
        lost = list(self.policy.lost_nodes())
        if self.board is not None and silent:
            lost += self.board.silent_nodes()
        return lost

    def _after_node_loss(self, lost: list[object], restarts: int) -> RunResult:
        """A node of the job is gone: the work since the newest checkpoint is lost with it;
        the policy requeues the job (Slurm starts it again once it has the nodes)."""
        logger.error("the job lost %s: the work since the newest checkpoint is lost with it; "
                     "the next cycle %s", ", ".join(map(str, lost)), resumes_from(self.store))
        append_event(self.store.events_path, "node-lost", cycle=self.cycles,
                     nodes=[str(node) for node in lost])
        verdict = self.policy.after_node_loss(lost, restarts)
        reason = after_node_loss(verdict.decision)
        return self._exit(reason, verdict.message, error=reason is not ExitReason.REQUEUED)

    def _after_unrequested_exit(self, outcome: CycleOutcome, restarts: int) -> RunResult | None:
        """The result for a command that exited without being asked to; None to restart it."""
        code = outcome.exit_code
        if outcome.forwarded:
            return self._exit(ExitReason.INTERRUPTED, command_code=code, message=
                              f"the command exited with {code} after "
                              f"{', '.join(outcome.forwarded)}")
        if code == 0:
            if not outcome.connected:
                return self._exit(ExitReason.FINISHED, "the command exited 0")
            if os.environ.get(ctl.ENV_CHECK):
                return self._exit(ExitReason.FINISHED, "the command exited 0 at the step "
                                  "procckpt check ended it")
            return self._exit(ExitReason.ENDED_EARLY,
                              "the command exited 0 before the end of its training loop, so "
                              "the training is not finished "
                              "(ckpt.epochs(), steps() or batches(); a break?) and the run is "
                              "not marked complete: running it again "
                              f"{resumes_from(self.store, verb='resumes')}; to end training early, "
                              "call ckpt.finish() before break")
        ended = exit_words(code)
        asked = self.config.restart_on_failure
        # By default a crash is restarted only after a checkpoint of its own cycle: an OOM
        # kill at hour 30 goes on, a bug that crashes again before saving anything ends here.
        where = self._latest_step()
        saved = where != self._cycle_from
        own = (f" (the command's own code: procckpt's {code} would have said why above)"
               if code in OWN_EXIT_CODES and outcome.procckpt_code is None else "")
        if outcome.usage_error:
            return self._exit(ExitReason.FAILED, command_code=code, message=
                              f"the command {ended}: procckpt ended it for the usage error "
                              "above, which a restart would meet again: not restarted. Fix "
                              "the script; running the same command again "
                              f"{resumes_from(self.store, verb='resumes')}", error=True)
        if asked is None and not saved:
            return self._exit(ExitReason.FAILED, command_code=code, message=
                              f"the command {ended}{own} before it saved a checkpoint in this "
                              "cycle, so a restart would most likely fail the same way: not "
                              "restarted (--restart-on-failure restarts it anyway). Fix the "
                              "cause; running the same command again "
                              f"{resumes_from(self.store, verb='resumes')}", error=True)
        if asked is not False and restarts < self.config.max_restarts:
            # Failures with no new checkpoint in between, whatever their exit codes (a crash
            # whose code alternates is no progress either): they will most likely repeat.
            self._same_failures = self._same_failures + 1 \
                if self._failure_codes and where == self._last_failure else 1
            self._failure_codes = [*self._failure_codes[:self._same_failures - 1], code]
            self._last_failure = where
            if self._same_failures >= SAME_FAILURE_LIMIT:
                codes = sorted(set(self._failure_codes))
                return self._exit(ExitReason.FAILED, command_code=code, message=
                                  f"the command failed {self._same_failures} times in a row "
                                  f"(exit code{'s' if len(codes) > 1 else ''} "
                                  f"{', '.join(map(str, codes))}) with no new checkpoint in "
                                  "between, so it would fail again: not restarted. Fix the "
                                  "cause; running the same command again "
                                  f"{resumes_from(self.store, verb='resumes')}", error=True)
            # The first failure after progress restarts at once (a crash costs its restart's
            # start-up, no more); one after no new checkpoint waits 2 s, then 4 s, ...
            delay = 0.0 if self._same_failures == 1 else \
                min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self._same_failures - 2))
            why = "--restart-on-failure" if asked else \
                "it saved a checkpoint in this cycle; --no-restart-on-failure ends the run instead"
            logger.warning("the command %s; restarting %s (%s): the next cycle %s", ended,
                           f"in {format_duration(delay)}" if delay else "at once", why,
                           resumes_from(self.store))
            append_event(self.store.events_path, "restart", restart=restarts + 1,
                         cause="failure", exit_code=code)
            self._carried_signals += self._sleep(delay)
            return None
        hint = (f", and --max-restarts {self.config.max_restarts} is spent ({restarts} "
                f"restart{'' if restarts == 1 else 's'} in this launch)"
                if asked is not False else ", not restarted (--no-restart-on-failure)")
        return self._exit(ExitReason.FAILED, command_code=code, message=
                          f"the command {ended}{own}{hint}; running the same command again "
                          f"{resumes_from(self.store, verb='resumes')}", error=True)

    def _sleep(self, seconds: float) -> list[int]:
        """Wait ``seconds`` between cycles, or until a signal comes (it is for the next)."""
        until = self._clock() + seconds
        while (left := until - self._clock()) > 0:
            signals = self._wait(left)  # type: ignore[misc]
            if signals:
                return signals
        return []

    def _slow_start(self) -> str | None:
        """Why a cycle that ended before the command connected was a slow start (its script
        imports procckpt), or None: a command without procckpt."""
        script = imports_procckpt(self.config.command, Path.cwd()) \
            if self.engine.name == "hooks" else None
        return None if script is None else ("ended before the command connected to procckpt:"
                                            f" a slow start ({script} imports procckpt)")

    def _exit(self, reason: ExitReason, message: str, error: bool = False,
              command_code: int = 0) -> RunResult:
        """End the run (loop.py), journalled and handed to node 0's followers."""
        result = self._end(reason, message, error, command_code)
        if self.board is not None:
            self.board.exited(result.exit_code, message)
        append_event(self.store.events_path, "exit", code=result.exit_code, reason=reason.value,
                     message=message, cycles=self.cycles, by="command" if reason in (
                         ExitReason.FAILED, ExitReason.INTERRUPTED, ExitReason.ENDED_EARLY)
                     else "procckpt")
        return result

    def _latest_step(self) -> int | None:
        """The newest checkpoint's step (its number for engines that know no steps), as
        :attr:`Confirmation.progress` counts."""
        infos = self.store.checkpoints()
        if not infos:
            return None
        return infos[0].step if infos[0].step is not None else infos[0].seq

    # -- one cycle -------------------------------------------------------------------------
    def _spare_for_next(self, env: dict[str, str]) -> Callable[[int | None], None] | None:
        """Once this cycle's training stepped (its start-up no longer competes for the
        processors), the spare interpreter for a restart is started (warm.py)."""
        warm = self.warm
        if warm is None:
            return None
        return lambda step: warm.prepare(env) if step is not None else None

    def _run_cycle(self, restarts: int) -> CycleOutcome:
        token = uuid.uuid4().hex
        self._cycle_from = self._latest_step()
        self.store.clean_temporaries()  # what a killed command of the last cycle left half-written
        argv, engine_env = self.engine.start_cycle(self.config.command, token)
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(engine_env)
        # A torch.compile'd model would compile again after every restart (on a new node, a
        # fresh /tmp): its kernels are kept beside the checkpoints unless the user chose a place.
        env.setdefault(INDUCTOR_CACHE_ENV, str(self.store.root / INDUCTOR_CACHE_DIR))
        env.update({ctl.ENV_DIR: str(self.store.root),
                    ctl.ENV_RESTART: str(restart_number(self.store, restarts)),
                    ctl.ENV_CYCLE: str(self.cycles), ctl.ENV_ENGINE: self.engine.name,
                    ctl.ENV_AUDIT: self.config.audit})
        env.pop(ctl.ENV_RECOVERY, None)
        if self._cycle_ended is not None:  # a restart here: its phases are timed from the end
            env[ctl.ENV_RECOVERY] = json.dumps({"seen": self._cycle_ended, "spawned": time.time()})
        if self.board is not None:  # the other nodes start their part with the same env
            self.board.running(token, self.cycles, {
                k: env[k] for k in (*engine_env, ctl.ENV_DIR, ctl.ENV_RESTART, ctl.ENV_CYCLE,
                                    ctl.ENV_ENGINE, ctl.ENV_AUDIT)})
        spare = self.warm.take(argv, env) if self.warm is not None \
            and argv == self.config.command else None
        child = spare or self._child_factory(argv, env)
        self.hangs.start_cycle()
        started = self._clock()
        child.start()
        warm = spare is not None and spare.warm  # (False where it fell back to a cold start)
        self.engine.child_started(child.pid)
        end = self.deadline.end(started, started)  # (a scheduler's limit is known from here)
        self.plan.refresh(self.hangs.step_seconds, self.hangs.longest_gap,
                          cycle=self.cycles, start=True)
        logger.info("cycle %d: started %s (pid %d, %s%s%s)", self.cycles, " ".join(argv),
                    child.pid, "warm: in the spare interpreter, torch imported; "
                    if warm else "", self.deadline.source,
                    f", checkpoint at {format_duration(end - started - self.plan.lead.seconds)}"
                    if end is not None else "")
        # The lead and period in force, and (for the first cycle) when the scheduler started
        # the job: procckpt status and report read them (inspect/goodput.py).
        job_started = self.deadline.job_started if self.cycles == 1 else None
        append_event(self.store.events_path, "cycle", cycle=self.cycles, pid=child.pid,
                     restart=restarts, engine=self.engine.name,
                     lead=round(self.plan.lead.seconds, 3), interval=self.plan.period.seconds,
                     **({} if job_started is None else {"job_started": job_started}),
                     **({"warm": True} if warm else {}))
        watch = CycleWatch(child, started, self.cycles, self.engine, self.deadline, self.plan,
                           self.hangs, self.store, self._actions, self._clock,
                           self._wait,  # type: ignore[arg-type]
                           term_timeout=self.config.term_timeout,
                           reap_orphans=self._reap_orphans, dump_stacks=self._dump_stacks,
                           lost_nodes=self._find_lost_nodes,
                           peer_stops=self.board.stop_requests if self.board else None,
                           unheard_peers=self.board.unheard if self.board else None,
                           on_look=self._spare_for_next(env))
        carried, self._carried_signals = self._carried_signals, []
        outcome = watch.run(carried)
        self._cycle_ended = time.time()  # (the command's exit was seen just now)
        self._carried_signals = watch.carried
        outcome.connected = outcome.connected or self.engine.connected()
        final = self.engine.end_cycle()
        if outcome.confirmed is None and final is not None:
            # The command confirmed and exited between two looks of the watch loop (or it
            # stopped itself): the journal still gets its confirmation.
            outcome.confirmed = final
            since = outcome.stop_started if outcome.stop_started is not None else started
            log_confirmed(self.store, final, self._clock() - since, self.cycles)
        requested = outcome.stop_cause is not None or outcome.confirmed is not None
        signalled = child.signalled or bool(outcome.forwarded)
        outcome.retry = self.engine.after_exit(outcome.exit_code, requested or signalled,
                                               signalled)
        complete = self.store.completion()
        outcome.finished = bool(complete) and (complete or {}).get("token") in (token, None)
        notes = self.engine.procckpt_exits()
        outcome.procckpt_code = procckpt_code(notes, outcome.exit_code)
        outcome.usage_error = any(note.get("code") == EX_USAGE for note in notes or [])
        outcome.audit_refused = outcome.procckpt_code == EX_AUDIT or any(
            str(f.get("error", "")).startswith(ctl.AUDIT_REFUSED) for f in self.engine.failures())
        outcome.lost_nodes = self._lost_nodes(outcome)
        if self.board is not None:
            self.board.between()
        append_event(self.store.events_path, "cycle-end", cycle=self.cycles,
                     code=outcome.exit_code, ended=outcome.ending)
        return outcome
