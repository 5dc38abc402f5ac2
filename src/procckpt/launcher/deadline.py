"""Where a cycle's deadline comes from: ``--time-limit`` here; the scheduler elsewhere."""

from __future__ import annotations

__all__ = ["Deadline", "NoDeadline", "LocalDeadline"]


class Deadline:
    """When a cycle must end, and what is known of the limit behind it. Every property the
    launcher reads is declared here; a source that does not know one leaves it None."""

    #: Where the end time comes from, for messages ("--time-limit 90s", "Slurm job 42").
    source: str = "no time limit"
    @property
    def limit(self) -> float | None:
        """The length of a cycle (the default grace is a quarter of it, at most 60 s)."""
        return None

    @property
    def kill_wait(self) -> float | None:
        """Seconds between the scheduler's SIGTERM and its SIGKILL, where it says."""
        return None

    #: Seconds before the end at which the job script's own signal comes, where it has one.
    signal_lead: float | None = None
    #: When the scheduler started this run of the job (epoch seconds), for the goodput.
    job_started: float | None = None

    def end(self, cycle_started: float, now: float) -> float | None:
        """The cycle's end as a ``time.monotonic()`` value, or None for no end.

        Called on every turn of the supervisor's loop; implementations that ask an outside
        party (a scheduler) cache the answer and re-ask only now and then.
        """
        return None

    def stop_asked(self, reason: str) -> None:
        """A signal asked for a checkpoint and a stop (``reason``: its name). A source that
        must ask the scheduler why the job is stopping may start asking now, while the
        checkpoint is written, rather than after it with the kill close behind."""


class NoDeadline(Deadline):
    source = "no time limit"


class LocalDeadline(Deadline):
    """Each cycle may run ``limit`` seconds, as a scheduler's time limit would allow."""

    def __init__(self, limit: float) -> None:
        self._limit = limit
        self.source = f"--time-limit {limit:g}s"

    @property
    def limit(self) -> float:
        return self._limit

    def end(self, cycle_started: float, now: float) -> float | None:
        return cycle_started + self._limit
