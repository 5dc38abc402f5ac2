"""The job's deadline: its end time from the environment or ``scontrol``, re-read so an extension is seen."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...durations import format_duration
from ...launcher.deadline import Deadline
from .env import ENV_END_TIME
from .job import SlurmJob

__all__ = ["SlurmDeadline", "NEAR_END", "REFRESH", "REFRESH_NEAR"]

logger = logging.getLogger(__name__)


#: How often the end time is re-read, and how often once it is less than 3 minutes away.
REFRESH = 60.0
REFRESH_NEAR = 10.0
#: A SIGTERM this close to the known end time (or later) is the time limit's. Slurm enforces
#: limits on a 30 s cycle, so its SIGTERM comes at or after the end; the slack covers clock
#: differences between the controller and this node.
NEAR_END = 10.0


class SlurmDeadline(Deadline):
    """The job's end time from Slurm, re-read now and then; and ``--time-limit`` if shorter.

    ``wall`` is a seam for unit tests.
    """

    def __init__(self, job: SlurmJob, local_limit: float | None = None, *,
                 wall: Callable[[], float] = time.time) -> None:
        self.job = job
        self.local_limit = local_limit
        self._wall = wall
        #: The end time (epoch seconds) last read while the job was running.
        self.end_wall: float | None = job.env.end_time
        self.slurm_limit: float | None = None
        self._next_read = float("-inf")
        #: Seconds before the end at which the job script's ``--signal`` fires, if it has one.
        self.signal_lead: float | None = None
        self._warned = False
        #: When Slurm started this run of the job (its StartTime: a requeued job's last start),
        #: for the goodput's queue time.
        self.job_started: float | None = None
        self.source = job.env.label + (f" and --time-limit {local_limit:g}s"
                                       if local_limit is not None else "")
        #: Whether --time-limit ends this cycle before the job's end does (by more than
        #: NEAR_END), as last worked out: a stop for the deadline is then the local one's.
        self.local_first = False

    @property
    def kill_wait(self) -> float | None:
        """Seconds between Slurm's SIGTERM and its SIGKILL (``KillWait``), read once."""
        if not hasattr(self, "_kill_wait"):
            text = self.job.config_value("KillWait") if self.job.has("scontrol") else None
            number = (text or "").split()[0] if text else ""
            self._kill_wait = float(number) if number.isdigit() else None
        return self._kill_wait

    @property
    def limit(self) -> float | None:
        """The length of a cycle, which the default grace is a quarter of (at most 60 s)."""
        limits = [x for x in (self.slurm_limit, self.local_limit) if x is not None]
        return min(limits) if limits else None

    def end(self, cycle_started: float, now: float) -> float | None:
        if now >= self._next_read:
            self._read(now)
        job_end = None if self.end_wall is None else now + (self.end_wall - self._wall())
        local_end = None if self.local_limit is None else cycle_started + self.local_limit
        self.local_first = local_end is not None and (job_end is None
                                                      or local_end < job_end - NEAR_END)
        ends = [end for end in (job_end, local_end) if end is not None]
        return min(ends) if ends else None

    def seconds_left(self) -> float | None:
        """Seconds until the job's end as last read while it ran; None if unknown."""
        return None if self.end_wall is None else self.end_wall - self._wall()

    def _read(self, now: float) -> None:
        record = self.job.record()
        # A job that is ending (scancel, requeue, time limit) shows EndTime = now; keep the
        # end time read while it ran, which is what tells a scancel from a time limit.
        if record is not None and record.state in ("RUNNING", "") and record.end_time:
            if self.end_wall is not None and abs(record.end_time - self.end_wall) >= 1:
                logger.info("%s: the end time moved by %s (now %s)", self.job.env.label,
                            format_duration(abs(record.end_time - self.end_wall)),
                            time.strftime("%H:%M:%S", time.localtime(record.end_time)))
            self.end_wall = record.end_time
            self.job_started = record.start_time or self.job_started
            self.slurm_limit = record.time_limit or self.slurm_limit
        if self.slurm_limit is None and self.end_wall is not None:
            # No TimeLimit to size the default grace by (inside a container only the end
            # time is known): the time left at the first read stands in for it.
            self.slurm_limit = max(1.0, self.end_wall - self._wall())
        elif self.end_wall is None and not self._warned:
            self._warned = True
            logger.warning("%s: cannot learn the job's end time (no scontrol or squeue answer, "
                           "no %s): procckpt checkpoints only when a signal asks for it; "
                           "submit with --signal=B:USR1@60", self.job.env.label, ENV_END_TIME)
        left = self.seconds_left()
        near = left is not None and left < 3 * REFRESH
        self._next_read = now + (REFRESH_NEAR if near else REFRESH)
