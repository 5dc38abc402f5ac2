"""The job's deadline: its end time from the environment or ``scontrol``, re-read now and then."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ...durations import format_duration
from ...launcher.deadline import Deadline
from .env import ENV_END_TIME
from .job import JobRecord, SlurmJob

__all__ = ["SlurmDeadline", "NEAR_END", "REFRESH", "REFRESH_NEAR", "LAST_WORDS"]

logger = logging.getLogger(__name__)


#: How often the end time is re-read, and how often once it is less than 3 minutes away.
REFRESH = 60.0
REFRESH_NEAR = 10.0
#: A SIGTERM this close to the known end time (or later) is the time limit's. Slurm enforces
#: limits on a 30 s cycle, so its SIGTERM comes at or after the end; the slack covers clock
#: differences between the controller and this node.
NEAR_END = 10.0
#: What the launcher has left to do once it knows why the job stops (say so, journal it,
#: exit): the wait for Slurm's answer ends this long before Slurm's SIGKILL is due.
LAST_WORDS = 3.0


class _Read:
    """The job's record, read in a thread: Slurm's controller can take seconds to answer
    (up to the query timeout, twice), and the launcher must not stop listening meanwhile."""

    def __init__(self, job: SlurmJob, started: float) -> None:
        self.started = started
        self.record: JobRecord | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, args=(job,), name="procckpt-slurm-read",
                         daemon=True).start()

    def _read(self, job: SlurmJob) -> None:
        try:
            self.record = job.record()
        finally:
            self.done.set()


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
        #: The periodic read of the end time under way, and the one asked at a stop.
        self._refresh: _Read | None = None
        self._stop_read: _Read | None = None

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
        """The end as of the last answer; the first read is waited for, later ones are not
        (they run in a thread, their answer is taken at the first call after it came)."""
        if self._refresh is not None and self._refresh.done.is_set():
            self._learn(self._refresh.record, now)
            self._refresh = None
        elif self._refresh is None and now >= self._next_read:
            if self._next_read == float("-inf"):
                self._learn(self.job.record(), now)
            else:
                self._refresh = _Read(self.job, now)
        job_end = None if self.end_wall is None else now + (self.end_wall - self._wall())
        local_end = None if self.local_limit is None else cycle_started + self.local_limit
        self.local_first = local_end is not None and (job_end is None
                                                      or local_end < job_end - NEAR_END)
        ends = [end for end in (job_end, local_end) if end is not None]
        return min(ends) if ends else None

    def seconds_left(self) -> float | None:
        """Seconds until the job's end as last read while it ran; None if unknown."""
        return None if self.end_wall is None else self.end_wall - self._wall()

    @property
    def refreshing(self) -> bool:
        """Whether a read of the end time is under way."""
        return self._refresh is not None and not self._refresh.done.is_set()

    def _learn(self, record: JobRecord | None, now: float) -> None:
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

    def stop_asked(self, reason: str) -> None:
        if self._stop_read is None:
            self._stop_read = _Read(self.job, self._wall())

    def record_at_stop(self) -> tuple[JobRecord | None, bool]:
        """The job's record, to tell why it stops, and whether Slurm gave it in time.

        Read since the stop was asked (:meth:`stop_asked`), so the answer comes while the
        checkpoint is written; waited for only until ``LAST_WORDS`` before Slurm's SIGKILL
        (``KillWait`` after its SIGTERM) is due. With no stop asked (the command stopped
        by itself), read now.
        """
        read, self._stop_read = self._stop_read, None
        if read is None:
            return self.job.record(), True
        kill_wait = self.kill_wait
        wait = (None if kill_wait is None else
                max(0.0, read.started + kill_wait - LAST_WORDS - self._wall()))
        answered = read.done.wait(wait)
        return read.record, answered
