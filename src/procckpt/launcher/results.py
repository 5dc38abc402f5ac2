"""What a run and each of its cycles came to: the values the run loop decides on and returns."""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from .engines import Confirmation
from .restart import StopCause

__all__ = ["ExitReason", "RunResult", "CycleOutcome", "exit_words"]


class ExitReason(enum.Enum):
    """How a run ends; its exit code is in decide.py's EXIT_CODES, the one table."""

    FINISHED = "finished"
    ALREADY_COMPLETE = "already-complete"
    CHECKPOINTED = "checkpointed"  # stopped with a checkpoint, resume later
    REQUEUED = "requeued"  # the scheduler will start it again
    BUDGET_EXHAUSTED = "budget-exhausted"
    NO_PROGRESS = "no-progress"
    UNSAVED_STOP = "unsaved-stop"  # stopped, but the stop's checkpoint never came
    NOT_CHECKPOINTABLE = "not-checkpointable"  # stopped, nothing could be saved
    STORAGE_FAILED = "storage-failed"  # no space, no permission, a read error
    CHECKPOINTS_UNUSABLE = "checkpoints-unusable"  # every checkpoint fails its checks
    FAILED = "failed"  # the command's own exit code
    #: The command exited 0 before the end of its training loop (a break): not finished.
    ENDED_EARLY = "ended-early"
    INTERRUPTED = "interrupted"  # the command ended after a signal passed on to it
    HUNG = "hung"  # stuck again and again, past the restart budget
    AUDIT_REFUSED = "audit-refused"  # --audit strict: a resume's first batch was not the one


@dataclass
class RunResult:
    """How ``procckpt run`` ends: its exit code, why, after how many cycles, in words."""

    exit_code: int
    reason: ExitReason
    cycles: int
    message: str = ""


@dataclass
class CycleOutcome:
    """How one cycle (one start of the command) ended."""

    exit_code: int
    stop_cause: StopCause | None = None  # why we stopped it (None: it exited on its own)
    stop_signal: str | None = None
    confirmed: Confirmation | None = None  # the stop's checkpoint, if one was confirmed
    finished: bool = False
    connected: bool = False
    forwarded: list[str] = field(default_factory=list)
    retry: str | None = None  # the engine runs the next cycle differently (why), see after_exit
    stop_started: float | None = None  # when the stop's checkpoint was asked for
    hung: bool = False  # no step completed for the hang timeout: we stopped it
    #: Nodes of the job found lost (a scheduler's LostNode), which ended the cycle.
    lost_nodes: list[object] = field(default_factory=list)
    #: A rank stopped because its first batch after a resume differed (--audit strict).
    audit_refused: bool = False
    #: The exit code procckpt itself ended the command (a rank of it) with: 65, 66, 74 (or
    #: None: the command's code is its own). Under torchrun a rank's code comes through here.
    procckpt_code: int | None = None
    #: procckpt ended a rank with a usage error (exit 2: the script uses it wrongly, say a
    #: second pass of batches() in an epoch), which every restart would meet again.
    usage_error: bool = False

    @property
    def stop_text(self) -> str:
        """Why we stopped the command, in words: 'its time limit was near', 'SIGTERM'."""
        if self.stop_cause is StopCause.DEADLINE:
            return "its time limit was near"
        return self.stop_signal or "stop request"

    @property
    def ending(self) -> str:
        """How the cycle ended, for the journal: finished, stopped (its checkpoint kept),
        exited (0, by itself), node-lost, hung, unconfirmed (a stop whose checkpoint never
        came) or failed. The work up to the end is kept in the first three cases."""
        if self.finished:
            return "finished"
        if self.confirmed is not None and self.confirmed.checkpoint is not None:
            return "stopped"
        if self.lost_nodes:
            return "node-lost"
        if self.hung:
            return "hung"
        if self.stop_cause is not None:
            return "unconfirmed"
        return "exited" if self.exit_code == 0 else "failed"


def exit_words(code: int) -> str:
    """How the command ended, in words: 'was killed by signal 9 (SIGKILL)' or 'failed with
    exit code 3'."""
    if code > 128:
        try:
            return f"was killed by signal {code - 128} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"failed with exit code {code}"
