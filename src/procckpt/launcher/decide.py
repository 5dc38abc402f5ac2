"""What follows a cycle, as data: a pure function from how the cycle ended and the run so far
to the next step, and the one table from how a run ends to its exit code.

The supervisor acts on the steps (starts the command again, asks the restart policy, logs and
journals); every choice between them is made here, where a unit test can hold each row
(tests/test_decide.py), and the exit codes are checked against docs/cli.md's table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import EX_AUDIT, EX_DATAERR, EX_IOERR, EX_NOT_SAVED, EX_TEMPFAIL
from .restart import Decision
from .results import CycleOutcome, ExitReason

__all__ = ["EXIT_CODES", "Action", "Step", "RunSoFar", "after_cycle", "after_verdict",
           "after_node_loss", "NO_PROGRESS_CYCLES", "procckpt_code", "OWN_EXIT_CODES"]

#: Cycles in a row without a new checkpoint after which a local restart loop gives up.
NO_PROGRESS_CYCLES = 3

#: How a run ends -> its exit code; None: the command's own (128+N when a signal killed it).
EXIT_CODES: dict[ExitReason, int | None] = {
    ExitReason.FINISHED: 0,
    ExitReason.ALREADY_COMPLETE: 0,
    ExitReason.REQUEUED: 0,
    ExitReason.HUNG: 1,
    ExitReason.CHECKPOINTS_UNUSABLE: EX_DATAERR,
    ExitReason.AUDIT_REFUSED: EX_AUDIT,
    ExitReason.STORAGE_FAILED: EX_IOERR,
    ExitReason.CHECKPOINTED: EX_TEMPFAIL,
    ExitReason.BUDGET_EXHAUSTED: EX_TEMPFAIL,
    ExitReason.NO_PROGRESS: EX_TEMPFAIL,
    ExitReason.UNSAVED_STOP: EX_TEMPFAIL,
    ExitReason.NOT_CHECKPOINTABLE: EX_NOT_SAVED,
    ExitReason.FAILED: None,
    ExitReason.ENDED_EARLY: None,
    ExitReason.INTERRUPTED: None,
}


#: The exit codes procckpt ends a training with, in the order one wins when ranks were ended
#: with several: storage, then unusable checkpoints, then the audit.
OWN_EXIT_CODES = (EX_IOERR, EX_DATAERR, EX_AUDIT)


def procckpt_code(notes: list[dict[str, object]] | None, exit_code: int) -> int | None:
    """The exit code procckpt itself ended the command's ranks with, from the notes they left
    (protocol/exits.py), whatever the command exited with (torchrun: 1); None when procckpt
    ended none (a 74 of the script's own is the script's). ``notes`` None: the engine could
    not tell, and the command's exit code is taken for procckpt's where it is one of its."""
    if notes is None:
        return exit_code if exit_code in OWN_EXIT_CODES else None
    codes = {note.get("code") for note in notes}
    return next((code for code in OWN_EXIT_CODES if code in codes), None)


class Action(enum.Enum):
    RETRY = "retry"  # the engine runs the next cycle differently (a fallback)
    RESTART = "restart"  # start the command again here
    EXIT = "exit"  # the run ends: Step.reason says how
    ASK_POLICY = "ask-policy"  # a stop: the restart policy (Slurm's requeue) decides
    NODE_LOSS = "node-loss"  # nodes of the job are gone: the policy decides
    UNREQUESTED = "unrequested"  # the command exited unasked: --restart-on-failure decides


@dataclass(frozen=True)
class Step:
    """What to do next. ``why`` tells apart the ways to one reason (for the message)."""

    action: Action
    reason: ExitReason | None = None
    why: str = ""


@dataclass(frozen=True)
class RunSoFar:
    restarts: int
    max_restarts: int
    last_step: int | None  # the newest checkpoint's progress before this cycle
    stuck: str | None = None  # the engine cannot image this command (why)
    slow_start: str | None = None  # a cycle that never connected was a slow start (why)


def _exit(reason: ExitReason, why: str = "") -> Step:
    return Step(Action.EXIT, reason, why)


def after_cycle(outcome: CycleOutcome, run: RunSoFar) -> Step:
    """The next step after a cycle, from how it ended, the policy not asked yet."""
    if outcome.retry is not None:
        return Step(Action.RETRY)
    saved = outcome.confirmed is not None and outcome.confirmed.checkpoint is not None
    if run.stuck and not outcome.finished and not saved:
        return _exit(ExitReason.NOT_CHECKPOINTABLE, "engine-stuck")  # every cycle would
    if outcome.lost_nodes:
        return Step(Action.NODE_LOSS)
    if outcome.hung and not outcome.finished:
        if run.restarts >= run.max_restarts:
            return _exit(ExitReason.HUNG)
        return Step(Action.RESTART, why="hang")
    if outcome.procckpt_code == EX_IOERR and not outcome.finished:
        return _exit(ExitReason.STORAGE_FAILED)  # no space, no permission: would repeat
    if outcome.procckpt_code == EX_DATAERR and not outcome.finished:
        return _exit(ExitReason.CHECKPOINTS_UNUSABLE)  # a restart would find the same
    if outcome.audit_refused and not outcome.finished:
        return _exit(ExitReason.AUDIT_REFUSED)  # a restart would resume the same way
    if outcome.finished:
        # A run that marked itself complete and was then stopped by us (the deadline came
        # while it was exiting: torchrun and its workers take seconds) finished.
        if outcome.exit_code == 0 or outcome.stop_cause is not None:
            return _exit(ExitReason.FINISHED)
        return _exit(ExitReason.FAILED, "finished-then-failed")
    if outcome.stop_cause is None and outcome.confirmed is None:
        return Step(Action.UNREQUESTED)
    if outcome.confirmed is None and not outcome.connected and run.last_step is None \
            and run.slow_start is None:
        return _exit(ExitReason.NOT_CHECKPOINTABLE, "never-connected")
    return Step(Action.ASK_POLICY)


def after_verdict(decision: Decision, stalled: int, saved: bool) -> Step:
    """The next step after the policy's decision on a stop; ``stalled``: cycles in a row
    with no new checkpoint, this one included; ``saved``: the stop's checkpoint came."""
    if decision is Decision.RESTART_HERE:
        if stalled >= NO_PROGRESS_CYCLES:
            return _exit(ExitReason.NO_PROGRESS)
        return Step(Action.RESTART, why="stop")
    if decision is Decision.REQUEUED:
        return _exit(ExitReason.REQUEUED)
    if decision is Decision.BUDGET_EXHAUSTED:
        return _exit(ExitReason.BUDGET_EXHAUSTED)
    # The stop's checkpoint never came (a stuck step): no claim that it did.
    return _exit(ExitReason.CHECKPOINTED if saved else ExitReason.UNSAVED_STOP)


def after_node_loss(decision: Decision) -> ExitReason:
    """How the run ends after the policy's decision on lost nodes (the work since the newest
    checkpoint is gone with them, so nothing restarts here)."""
    if decision is Decision.REQUEUED:
        return ExitReason.REQUEUED
    if decision is Decision.BUDGET_EXHAUSTED:
        return ExitReason.BUDGET_EXHAUSTED
    return ExitReason.CHECKPOINTED
