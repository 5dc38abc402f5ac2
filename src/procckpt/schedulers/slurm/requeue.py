"""After a checkpointed stop (or a lost node) in a Slurm job: why the job is stopping, and whether
to requeue it."""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

from ...errors import EX_TEMPFAIL
from ...launcher.config import RunConfig
from ...launcher.restart import Decision, LocalRestart, StopCause, Verdict
from .deadline import NEAR_END, SlurmDeadline
from .job import SlurmJob
from .nodes import LostNode, lost_nodes

__all__ = ["StopKind", "SlurmRequeue"]

logger = logging.getLogger(__name__)


class StopKind(enum.Enum):
    TIME_LIMIT = "time limit"
    PREEMPTION = "preemption"
    CANCEL = "cancel"
    #: A SIGTERM with no time limit near, and Slurm did not say in time whether it preempts.
    UNANSWERED = "unanswered"
    LOCAL_LIMIT = "local time limit"


class SlurmRequeue:
    """Decides, after a checkpointed stop, whether to requeue the job, and does it."""

    def __init__(self, job: SlurmJob, deadline: SlurmDeadline, config: RunConfig) -> None:
        self.job = job
        self.deadline = deadline
        self.config = config
        self.checkpoint_signal = "SIG" + config.checkpoint_signal
        self.chain = job.env.chain_position
        # In a chain each task is the next cycle of the same training.
        self.initial_restarts = (job.env.restart_count if self.chain is None
                                 else job.env.restart_count + self.chain[0] - 1)
        self._local = LocalRestart(config.max_restarts)

    def classify(self, cause: StopCause, signal_name: str | None) -> StopKind:
        if cause is StopCause.DEADLINE:
            # Whichever end the stop was asked for: its lead (the measured write and the
            # longest gap between safe points) may be far longer than the grace, so the time
            # left after the checkpoint does not tell the two apart.
            return StopKind.LOCAL_LIMIT if self.deadline.local_first else StopKind.TIME_LIMIT
        if signal_name == self.checkpoint_signal and signal_name != "SIGTERM":
            return StopKind.TIME_LIMIT  # Slurm's --signal=B:SIG@T warning
        left = self.deadline.seconds_left()
        if left is not None and left <= NEAR_END:
            return StopKind.TIME_LIMIT
        record, answered = self.deadline.record_at_stop()
        if record is not None and record.preempted:
            return StopKind.PREEMPTION
        return StopKind.CANCEL if answered else StopKind.UNANSWERED

    def after_stop(self, cause: StopCause, signal_name: str | None, restarts: int) -> Verdict:
        kind = self.classify(cause, signal_name)
        label = self.job.env.label
        if kind is StopKind.LOCAL_LIMIT:
            return self._local.after_stop(cause, signal_name, restarts)
        if kind is StopKind.CANCEL:
            return Verdict(Decision.EXIT_RETRY,
                           f"{label} was stopped by {signal_name or 'a signal to the command'} "
                           "with no time limit near and no preemption (scancel?): not "
                           "requeued. The checkpoint is kept: submit the job again to resume")
        if kind is StopKind.UNANSWERED:
            return Verdict(Decision.EXIT_RETRY,
                           f"{label} was stopped by {signal_name or 'a signal to the command'} "
                           "with no time limit near, and Slurm did not say within its KillWait "
                           "whether the job is preempted: not requeued. The checkpoint is kept: "
                           "if Slurm does not requeue the job itself, submit it again to resume")
        why = "its time limit is near" if kind is StopKind.TIME_LIMIT else "it is preempted"
        return self._requeue(why, restarts)

    def lost_nodes(self) -> list[LostNode]:
        return lost_nodes(self.job)

    def after_node_loss(self, lost: Sequence[object], restarts: int) -> Verdict:
        nodes = ", ".join(str(node) for node in lost)
        return self._requeue(f"it lost node{'s' if len(lost) > 1 else ''} {nodes}", restarts)

    def _requeue(self, why: str, restarts: int) -> Verdict:
        """Requeue the job (or leave it to the chain's next task), within the budget."""
        label = self.job.env.label
        if self.chain is not None:
            task, last = self.chain
            if task < last:
                return Verdict(Decision.REQUEUED,
                               f"{label} stopped ({why}), chain task {task} of {last}; the "
                               "next task resumes from the checkpoint")
            return Verdict(Decision.BUDGET_EXHAUSTED,
                           f"{label} stopped ({why}) and was the last of {last} chain tasks, "
                           "but the training has not finished; the checkpoint is kept: submit "
                           "again (with a longer --chain) to continue")
        if restarts >= self.config.max_restarts:
            return Verdict(Decision.BUDGET_EXHAUSTED,
                           f"restart budget exhausted: {label} has used {restarts} of "
                           f"--max-restarts {self.config.max_restarts} (SLURM_RESTART_COUNT), "
                           f"so it is not requeued again ({why}). The checkpoint is kept: "
                           "submit again, or raise --max-restarts, to continue")
        if not self.job.has("scontrol"):
            return Verdict(Decision.EXIT_RETRY,
                           f"{label} stopped ({why}) but scontrol is not available here "
                           f"(inside a container?), so procckpt cannot requeue it; exiting with "
                           f"{EX_TEMPFAIL} so that the job script outside can requeue")
        record = self.job.record()
        if record is not None and record.cancelled:
            # An scancel that came while procckpt checkpointed: a requeue would undo it.
            return Verdict(Decision.EXIT_RETRY,
                           f"{label} stopped ({why}) and was cancelled meanwhile (scancel?): "
                           "not requeued. The checkpoint is kept: submit the job again to "
                           "resume")
        if record is not None and (record.restarts or 0) > self.job.env.restart_count:
            return Verdict(Decision.REQUEUED,
                           f"{label} stopped ({why}) and Slurm has requeued it already; "
                           f"restart {restarts + 1} of {self.config.max_restarts} resumes from "
                           "the checkpoint")
        logger.info("%s: %s; requeueing it (restart %d of %d)", label, why, restarts + 1,
                    self.config.max_restarts)
        done, message = self.job.requeue()
        if not done:
            return Verdict(Decision.EXIT_RETRY,
                           f"scontrol requeue {self.job.env.requeue_target} failed: {message}. "
                           "The checkpoint is kept: submit the job again to resume (if the "
                           "site forbids requeue, use procckpt sbatch --chain N)")
        return Verdict(Decision.REQUEUED,
                       f"requeued {label} ({why}); restart {restarts + 1} of "
                       f"{self.config.max_restarts} resumes from the checkpoint")
