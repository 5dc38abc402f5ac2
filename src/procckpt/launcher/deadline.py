"""Where a cycle's deadline comes from: ``--time-limit`` here; the scheduler elsewhere."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Deadline", "NoDeadline", "LocalDeadline"]


class Deadline(Protocol):
    #: Where the end time comes from, for messages ("--time-limit 90s", "Slurm job 42").
    source: str

    def end(self, cycle_started: float, now: float) -> float | None:
        """The cycle's end as a ``time.monotonic()`` value, or None for no end.

        Called on every turn of the supervisor's loop; implementations that ask an outside
        party (a scheduler) cache the answer and re-ask only now and then.
        """


class NoDeadline:
    source = "no time limit"

    def end(self, cycle_started: float, now: float) -> float | None:
        return None


class LocalDeadline:
    """Each cycle may run ``limit`` seconds, as a scheduler's time limit would allow."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.source = f"--time-limit {limit:g}s"

    def end(self, cycle_started: float, now: float) -> float | None:
        return cycle_started + self.limit
