"""Talking to Slurm: ``scontrol``/``squeue`` calls with a time bound, and what they print."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from .env import SlurmEnv

__all__ = ["JobRecord", "SlurmJob", "node_address", "parse_scontrol_record", "parse_slurm_time",
           "parse_time_limit", "QUERY_TIMEOUT"]

logger = logging.getLogger(__name__)


#: Every Slurm command gets this long; a slow controller must not stall the supervisor.
QUERY_TIMEOUT = 15.0

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One line of ``scontrol -o show job`` as a dict. Values may hold spaces (``Reason=``,
    ``Command=``), so a field starts only where whitespace is followed by ``Key=``."""
    text = line.strip()
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=", text))
    fields: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        fields[m.group(1)] = text[m.end():end].strip()
    return fields


def parse_slurm_time(text: str) -> float | None:
    """``2026-05-01T12:00:00`` (Slurm prints local time) as seconds since the epoch;
    None for ``Unknown``, ``None``, ``N/A`` and the like."""
    try:
        return datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


_LIMIT_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_limit(text: str, *, bare_minutes: bool = True) -> float | None:
    """A Slurm time limit in seconds; None for ``UNLIMITED``, ``INFINITE`` or unparsable text.

    The forms are sbatch's: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.
    ``scontrol`` prints ``[D-]HH:MM:SS``, which these cover.
    """
    m = _LIMIT_RE.match(text.strip())
    if not m:
        return None
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return float(((int(days) * 24 + h) * 60 + mi) * 60 + s)
    if c is not None:  # H:M:S
        return float((int(a) * 60 + int(b)) * 60 + int(c))
    if b is not None:  # M:S
        return float(int(a) * 60 + int(b))
    return float(int(a) * 60) if bare_minutes else float(int(a))


@dataclass(frozen=True)
class JobRecord:
    """The fields of ``scontrol show job`` that procckpt uses."""

    fields: dict[str, str]

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "").split(" ")[0]

    @property
    def start_time(self) -> float | None:
        return parse_slurm_time(self.fields.get("StartTime", ""))

    @property
    def end_time(self) -> float | None:
        return parse_slurm_time(self.fields.get("EndTime", ""))

    @property
    def time_limit(self) -> float | None:
        return parse_time_limit(self.fields.get("TimeLimit", ""))

    @property
    def requeue_allowed(self) -> bool | None:
        value = self.fields.get("Requeue")
        return None if value is None else value.strip() == "1"

    @property
    def preempted(self) -> bool:
        value = self.fields.get("PreemptTime", "None").strip()
        return value not in ("", "None", "Unknown", "N/A") or self.state == "PREEMPTED"

    @property
    def restarts(self) -> int | None:
        value = self.fields.get("Restarts", "").strip()
        return int(value) if value.isdigit() else None

    @property
    def cancelled(self) -> bool:
        """Someone cancelled the job (scancel) while it still runs. scontrol shows such a job
        as COMPLETING with no reason (a time limit's end says TimeLimit, a lost node NodeDown);
        a preempted job can look the same, so its preemption time rules it out."""
        reason = self.fields.get("Reason", "None").strip()
        ending = self.state == "CANCELLED" or (self.state == "COMPLETING" and reason == "None")
        return ending and not self.preempted


def node_address(name: str, *, run: Runner = subprocess.run) -> str | None:
    """Node ``name``'s address as Slurm knows it (``NodeAddr`` of ``scontrol show node``), or
    None if scontrol cannot say."""
    if shutil.which("scontrol") is None and run is subprocess.run:
        return None
    try:
        res = run(["scontrol", "-o", "show", "node", name], capture_output=True, text=True,
                  timeout=QUERY_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("scontrol show node %s failed: %s", name, e)
        return None
    if res.returncode != 0:
        return None
    for line in res.stdout.splitlines():
        fields = parse_scontrol_record(line)
        if fields.get("NodeName") == name and fields.get("NodeAddr"):
            return fields["NodeAddr"]
    return None


class SlurmJob:
    """The running job, as Slurm's commands see it.

    ``run`` and ``which`` are seams for unit tests (canned ``scontrol`` output); the
    end-to-end tests use a real cluster.
    """

    def __init__(self, env: SlurmEnv, *, run: Runner = subprocess.run,
                 which: Callable[[str], str | None] = shutil.which) -> None:
        self.env = env
        self._run = run
        self._which = which

    def has(self, tool: str) -> bool:
        return self._which(tool) is not None

    def _call(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
        if not self.has(argv[0]):
            return None
        try:
            return self._run(list(argv), capture_output=True, text=True, timeout=QUERY_TIMEOUT,
                             stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            logger.debug("%s failed: %s", " ".join(argv), e)
            return None

    def record(self) -> JobRecord | None:
        """The job's record from ``scontrol show job``, or the end time and limit from
        ``squeue`` if scontrol cannot answer; None if neither can."""
        res = self._call(["scontrol", "-o", "show", "job", self.env.job_id])
        if res is not None and res.returncode == 0:
            for line in res.stdout.splitlines():
                fields = parse_scontrol_record(line)
                if fields.get("JobId") == self.env.job_id:
                    return JobRecord(fields)
        res = self._call(["squeue", "-h", "-j", self.env.job_id, "-o", "%e|%l|%T"])
        if res is not None and res.returncode == 0 and res.stdout.strip():
            end, limit, state = (res.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
            return JobRecord({"EndTime": end, "TimeLimit": limit, "JobState": state})
        return None

    def requeue(self) -> tuple[bool, str]:
        """``scontrol requeue`` this job (this task of an array); (done, Slurm's message)."""
        res = self._call(["scontrol", "requeue", self.env.requeue_target])
        if res is not None and res.returncode == 0:
            return True, "requeued"
        if (res is None or res.returncode < 0) and self.requeued():
            # Slurm signals every process of a job it requeues, scontrol too if it has not
            # exited yet; and a loaded controller may answer after scontrol's time-out. Killed
            # or timed out, it may still have done its work: the job's Restarts tells.
            return True, "requeued"
        if res is None:
            return False, "scontrol could not be run, or did not answer in time"
        message = (res.stderr or res.stdout).strip().splitlines()
        return False, message[-1] if message else f"exit code {res.returncode}"

    def requeued(self) -> bool:
        """Whether Slurm has requeued this job since it started (its Restarts went up)."""
        record = self.record()
        restarts = record.restarts if record is not None else None
        return restarts is not None and restarts > self.env.restart_count

    def batch_script(self) -> str | None:
        """The job script Slurm runs (``scontrol write batch_script``), if it can be read."""
        res = self._call(["scontrol", "write", "batch_script", self.env.job_id, "-"])
        return res.stdout if res is not None and res.returncode == 0 else None

    def node_names(self) -> list[str]:
        """The job's nodes, one name each (``scontrol show hostnames`` of its node list)."""
        if not self.env.node_list:
            return []
        if not any(c in self.env.node_list for c in ",["):
            return [self.env.node_list]  # one node: nothing to expand
        res = self._call(["scontrol", "show", "hostnames", self.env.node_list])
        if res is None or res.returncode != 0:
            return []
        return res.stdout.split()

    def node_records(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """``scontrol show node`` of ``names``, by name ({} if it cannot answer)."""
        res = self._call(["scontrol", "-o", "show", "node", ",".join(names)])
        if res is None or res.returncode != 0:
            return {}
        records = (parse_scontrol_record(line) for line in res.stdout.splitlines())
        return {r["NodeName"]: r for r in records if r.get("NodeName")}

    def config_value(self, key: str) -> str | None:
        res = self._call(["scontrol", "show", "config"])
        if res is None or res.returncode != 0:
            return None
        for line in res.stdout.splitlines():
            name, _, value = line.partition("=")
            if name.strip() == key:
                return value.strip()
        return None
