"""What happens after a checkpointed stop: restart here, requeue with the scheduler, or exit."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Decision", "Verdict", "RestartPolicy", "LocalRestart", "StopCause"]


class StopCause(enum.Enum):
    DEADLINE = "deadline"  # the time limit (ours or the scheduler's) was near
    SIGNAL = "signal"  # a checkpoint-and-stop signal reached the launcher
    CHILD = "child"  # the command stopped itself after a checkpoint (it got SIGTERM directly)


class Decision(enum.Enum):
    RESTART_HERE = "restart-here"
    REQUEUED = "requeued"
    EXIT_RETRY = "exit-retry"
    BUDGET_EXHAUSTED = "budget-exhausted"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    message: str


class RestartPolicy(Protocol):
    #: Restarts that already happened before this launcher started (Slurm counts requeues).
    initial_restarts: int

    def after_stop(self, cause: StopCause, signal_name: str | None, restarts: int) -> Verdict:
        """Decide what follows a stop that left a checkpoint; ``restarts`` so far."""

    def lost_nodes(self) -> Sequence[object]:
        """The nodes of the job that are gone, as the scheduler (and a knock) tells; asked
        after a command failed or hung. Empty where that cannot be known."""

    def after_node_loss(self, lost: Sequence[object], restarts: int) -> Verdict:
        """Decide what follows a cycle that ended because ``lost`` nodes are gone."""


class LocalRestart:
    """No scheduler: a deadline stop restarts the command here, a signal stop exits."""

    initial_restarts = 0

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts

    def after_stop(self, cause: StopCause, signal_name: str | None, restarts: int) -> Verdict:
        if cause is not StopCause.DEADLINE:
            return Verdict(Decision.EXIT_RETRY,
                           f"checkpointed after {signal_name or 'a stop request'}; run the same "
                           "command again to resume")
        if restarts >= self.max_restarts:
            return Verdict(Decision.BUDGET_EXHAUSTED,
                           f"restart budget exhausted ({restarts} of --max-restarts "
                           f"{self.max_restarts}); the last checkpoint is kept: run again, or "
                           "raise --max-restarts, to continue")
        return Verdict(Decision.RESTART_HERE, f"restart {restarts + 1} of {self.max_restarts}")

    def lost_nodes(self) -> Sequence[object]:
        return []  # one machine: the launcher's own, alive

    def after_node_loss(self, lost: Sequence[object], restarts: int) -> Verdict:
        return Verdict(Decision.EXIT_RETRY, f"lost {', '.join(map(str, lost))}; run the same "
                       "command again to resume")
