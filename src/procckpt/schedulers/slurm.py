"""Slurm: every ``SLURM_*`` read and every ``scontrol``/``squeue`` call procckpt makes.

Inside a Slurm job (``SLURM_JOB_ID`` set), ``procckpt run`` takes its deadline and its restart
policy from here:

- :class:`SlurmDeadline`: the job's end time, from ``$PROCCKPT_SLURM_END_TIME`` /
  ``$SLURM_JOB_END_TIME`` where set, else ``scontrol show job`` (``squeue -o %e`` if that
  fails); re-read every minute, every 10 s near the end, so an extended limit is noticed. The
  checkpoint is asked for at end - grace even when the job script set no ``--signal``.
- :class:`SlurmRequeue`: after a checkpointed stop, works out why the job is stopping and
  requeues it with ``scontrol requeue`` when that is what the user wants.

Why procckpt stopped, how that is told apart, and what follows::

    stop                                     told apart by                       then
    ---------------------------------------  ----------------------------------  ----------
    end - grace reached                      StopCause.DEADLINE                  requeue
    --checkpoint-signal (default USR1, sent  the signal's name                   requeue
      by --signal=B:USR1@T before the limit)
    SIGTERM at the time limit                now >= the job's end time - 10 s    requeue
    SIGTERM on preemption                    PreemptTime set (scontrol)          requeue
    SIGTERM from scancel, or anything else   none of the above                   no requeue
    --time-limit shorter than the job        that limit's end, not the job's     restart here

A requeue counts against ``--max-restarts``, compared with ``SLURM_RESTART_COUNT`` (Slurm
counts time limits and preemptions alike); over budget procckpt stops with a message.

The end time used to tell a time limit from a ``scancel`` is the one read while the job was
RUNNING: ``scancel``, a requeue and the time-limit kill all move Slurm's ``EndTime`` to "now".

Exit codes of ``procckpt run`` in a Slurm job: 0 finished, or requeued (Slurm starts it again);
75 (EX_TEMPFAIL) checkpointed but not requeued: cancelled, ``scontrol`` missing (inside a
container: the job script outside requeues on 75), requeue refused, or the restart budget
exhausted; anything else is the command's own failure.

Chain mode (``procckpt sbatch --chain N``, ``PROCCKPT_SLURM_CHAIN=1``): the job is an array of
N tasks that run one after another; a task never requeues, it stops with exit 0 and the next
task resumes from the checkpoint. The last task stops with 75 if the training is not done.
"""

from __future__ import annotations

import enum
import math
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..launcher.config import RunConfig
from ..durations import format_duration
from ..errors import EX_TEMPFAIL
from ..launcher.restart import Decision, LocalRestart, StopCause, Verdict

__all__ = [
    "SlurmEnv",
    "JobRecord",
    "SlurmJob",
    "SlurmDeadline",
    "SlurmRequeue",
    "StopKind",
    "slurm_env",
    "slurm_deadline_and_policy",
    "startup_warnings",
    "parse_scontrol_record",
    "parse_slurm_time",
    "parse_time_limit",
    "ENV_END_TIME",
    "ENV_CHAIN",
    "ENV_DISABLE",
]

logger = logging.getLogger(__name__)

#: Set to 0/off/false to make ``procckpt run`` ignore that it runs in a Slurm job.
ENV_DISABLE = "PROCCKPT_SLURM"
#: The job's end time in seconds since the epoch; the container job script sets it, because
#: ``scontrol`` and ``squeue`` are missing inside the container.
ENV_END_TIME = "PROCCKPT_SLURM_END_TIME"
#: Set to 1 by chain-mode job scripts: stop without requeueing, the next array task resumes.
ENV_CHAIN = "PROCCKPT_SLURM_CHAIN"

#: How often the end time is re-read, and how often once it is less than 3 minutes away.
REFRESH = 60.0
REFRESH_NEAR = 10.0
#: A SIGTERM this close to the known end time (or later) is the time limit's. Slurm enforces
#: limits on a 30 s cycle, so its SIGTERM comes at or after the end; the slack covers clock
#: differences between the controller and this node.
NEAR_END = 10.0
#: Every Slurm command gets this long; a slow controller must not stall the supervisor.
QUERY_TIMEOUT = 15.0

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


# -- the environment --------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmEnv:
    """What the job's environment says about it (nothing here asks Slurm)."""

    job_id: str
    array_job_id: str | None = None
    array_task_id: str | None = None
    array_task_min: str | None = None
    array_task_max: str | None = None
    restart_count: int = 0
    end_time: float | None = None  # seconds since the epoch
    chain: bool = False
    tmpdirs: tuple[str, ...] = ()

    @property
    def is_array_task(self) -> bool:
        return bool(self.array_job_id and self.array_task_id)

    @property
    def requeue_target(self) -> str:
        """The id ``scontrol requeue`` needs: ``ARRAYID_TASK`` for array tasks, since
        requeueing the array's id would requeue every task."""
        if self.is_array_task:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def label(self) -> str:
        return f"Slurm job {self.requeue_target}"

    @property
    def chain_position(self) -> tuple[int, int] | None:
        """(this task, last task) of a chain, counted from 1; None outside chain mode."""
        if not (self.chain and self.is_array_task):
            return None
        try:
            first = int(self.array_task_min or 1)
            task = int(self.array_task_id or 0) - first + 1
            last = int(self.array_task_max or 0) - first + 1
        except ValueError:
            return None
        return task, last


def _falsy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("0", "off", "false", "no")


def slurm_env(environ: Mapping[str, str] | None = None) -> SlurmEnv | None:
    """The Slurm job this process runs in, or None (not in a job, or ``PROCCKPT_SLURM=0``)."""
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    if not job_id or _falsy(environ.get(ENV_DISABLE)):
        return None
    end_time = None
    for name in (ENV_END_TIME, "SLURM_JOB_END_TIME"):
        text = environ.get(name, "").strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        # A time in the past (or not a time) would stop the command at once: no job runs
        # past its end, so the value is wrong, and Slurm itself is asked instead.
        if not math.isfinite(value) or value < time.time() - 60 or value > 1e11:
            logger.warning("ignoring %s=%r: not a job end time (seconds since the epoch, in "
                           "the future); asking Slurm for the end time instead", name, text)
            continue
        end_time = value
        break
    try:
        restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restarts = 0
    tmpdirs = tuple(environ[name] for name in ("SLURM_TMPDIR", "TMPDIR", "SLURM_JOB_TMPFS")
                    if environ.get(name, "").strip() not in ("", "/"))
    return SlurmEnv(
        job_id=job_id,
        array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
        array_task_id=environ.get("SLURM_ARRAY_TASK_ID") or None,
        array_task_min=environ.get("SLURM_ARRAY_TASK_MIN") or None,
        array_task_max=environ.get("SLURM_ARRAY_TASK_MAX") or None,
        restart_count=max(0, restarts),
        end_time=end_time,
        chain=not _falsy(environ.get(ENV_CHAIN, "0")),
        tmpdirs=tmpdirs,
    )


# -- parsing what Slurm prints ----------------------------------------------------------------
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


# -- talking to Slurm -------------------------------------------------------------------------
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
        if res is None:
            return False, "scontrol could not be run"
        message = (res.stderr or res.stdout).strip().splitlines()
        return res.returncode == 0, message[-1] if message else f"exit code {res.returncode}"

    def batch_script(self) -> str | None:
        """The job script Slurm runs (``scontrol write batch_script``), if it can be read."""
        res = self._call(["scontrol", "write", "batch_script", self.env.job_id, "-"])
        return res.stdout if res is not None and res.returncode == 0 else None

    def config_value(self, key: str) -> str | None:
        res = self._call(["scontrol", "show", "config"])
        if res is None or res.returncode != 0:
            return None
        for line in res.stdout.splitlines():
            name, _, value = line.partition("=")
            if name.strip() == key:
                return value.strip()
        return None


# -- the deadline -----------------------------------------------------------------------------
class SlurmDeadline:
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
        self._warned = False
        self.source = job.env.label + (f" and --time-limit {local_limit:g}s"
                                       if local_limit is not None else "")

    @property
    def limit(self) -> float | None:
        """The length of a cycle, which the default grace is a quarter of (at most 60 s)."""
        limits = [x for x in (self.slurm_limit, self.local_limit) if x is not None]
        return min(limits) if limits else None

    def end(self, cycle_started: float, now: float) -> float | None:
        if now >= self._next_read:
            self._read(now)
        ends = []
        if self.end_wall is not None:
            ends.append(now + (self.end_wall - self._wall()))
        if self.local_limit is not None:
            ends.append(cycle_started + self.local_limit)
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


# -- the restart policy -----------------------------------------------------------------------
class StopKind(enum.Enum):
    TIME_LIMIT = "time limit"
    PREEMPTION = "preemption"
    CANCEL = "cancel"
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
            left = self.deadline.seconds_left()
            slurm_near = left is not None and left <= self.config.grace_for(
                self.deadline.limit) + NEAR_END
            if self.deadline.local_limit is not None and not slurm_near:
                return StopKind.LOCAL_LIMIT
            return StopKind.TIME_LIMIT
        if signal_name == self.checkpoint_signal and signal_name != "SIGTERM":
            return StopKind.TIME_LIMIT  # Slurm's --signal=B:SIG@T warning
        left = self.deadline.seconds_left()
        if left is not None and left <= NEAR_END:
            return StopKind.TIME_LIMIT
        record = self.job.record()
        if record is not None and record.preempted:
            return StopKind.PREEMPTION
        return StopKind.CANCEL

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
        why = "its time limit is near" if kind is StopKind.TIME_LIMIT else "it is preempted"
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
                           "so it is not requeued again. The checkpoint is kept: submit again, "
                           "or raise --max-restarts, to continue")
        if not self.job.has("scontrol"):
            return Verdict(Decision.EXIT_RETRY,
                           f"{label} stopped ({why}) but scontrol is not available here "
                           f"(inside a container?), so procckpt cannot requeue it; exiting with "
                           f"{EX_TEMPFAIL} so that the job script outside can requeue")
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


# -- start-up checks --------------------------------------------------------------------------
_NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")
_LOCAL_FS_TYPES = ("tmpfs", "ramfs")


def _within(path: Path, root: str) -> bool:
    try:
        path.relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False


def _fs_type(path: Path, mounts_text: str) -> str | None:
    best, fstype = "", None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if _within(path, mount) and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return fstype


def node_local_reason(directory: Path, env: SlurmEnv, mounts_text: str | None = None,
                      ) -> str | None:
    """Why ``directory`` is likely on node-local storage that a requeue loses, or None."""
    path = directory.resolve()
    for prefix in _NODE_LOCAL_PREFIXES:
        if _within(path, prefix):
            return f"it is under {prefix}"
    for tmp in env.tmpdirs:
        if _within(path, tmp):
            return f"it is under the job's temporary dir {tmp}"
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return None
    fstype = _fs_type(path, mounts_text)
    if fstype in _LOCAL_FS_TYPES:
        return f"it is on a {fstype} (memory) filesystem"
    return None


def sbatch_directives(script: str) -> list[list[str]]:
    """The ``#SBATCH`` options of a job script, split into words; like sbatch, stop at the
    first line that is neither blank nor a comment."""
    found = []
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            try:
                found.append(shlex.split(stripped[len("#SBATCH"):], comments=True))
            except ValueError:
                found.append(stripped[len("#SBATCH"):].split())
        elif stripped and not stripped.startswith("#"):
            break
    return found


def _directive_value(directives: list[list[str]], *names: str) -> str | None:
    """The value of the last directive called one of ``names`` (``--x=v``, ``--x v``,
    ``-xv``, ``-x v``)."""
    value = None
    for words in directives:
        for i, word in enumerate(words):
            for name in names:
                if word == name and i + 1 < len(words):
                    value = words[i + 1]
                elif name.startswith("--") and word.startswith(name + "="):
                    value = word[len(name) + 1:]
                elif len(name) == 2 and word.startswith(name) and len(word) > 2 \
                        and not word.startswith("--"):
                    value = word[2:]
    return value


def _parent_cmdline(pid: int | None = None) -> list[str]:
    try:
        ppid = os.getppid() if pid is None else pid
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def startup_warnings(job: SlurmJob, config: RunConfig, *, parent_cmdline: list[str] | None = None,
                     mounts_text: str | None = None) -> list[str]:
    """Misconfigurations that would lose work, found at start, as one message each."""
    env = job.env
    warnings = []
    parent = _parent_cmdline() if parent_cmdline is None else parent_cmdline
    script = job.batch_script()
    directives = sbatch_directives(script) if script else []
    signal_spec = _directive_value(directives, "--signal") or ""
    under_batch_shell = (len(parent) >= 2 and os.path.basename(parent[0]) in ("bash", "sh", "zsh",
                         "dash", "ksh") and any(p.endswith("slurm_script") for p in parent[1:]))
    if under_batch_shell and signal_spec.upper().startswith(("B:", "RB:", "BR:")):
        warnings.append(
            f"procckpt runs under the job's batch shell, which gets the --signal={signal_spec} "
            "signal instead of procckpt: the shell dies of it (ending the job) or, with a "
            "trap, acts only after procckpt exits. Start procckpt with `exec procckpt run ...` "
            "in the job script")
    if script is not None and env.chain_position is None:
        open_mode = (_directive_value(directives, "--open-mode") or "").lower()
        if open_mode != "append" and (job.config_value("JobFileAppend") or "0") != "1":
            warnings.append(
                "the job script has no '#SBATCH --open-mode=append': unless it was given to "
                "sbatch on the command line, Slurm truncates the job's output file when it "
                "requeues the job, and the log of earlier cycles is lost")
    reason = node_local_reason(config.dir, env, mounts_text)
    if reason is not None:
        warnings.append(
            f"the checkpoint dir {config.dir.absolute()} looks node-local ({reason}): a "
            "requeued job may start on another node, or find it wiped; put --dir on a shared "
            "filesystem")
    if not job.has("scontrol"):
        warnings.append(
            f"scontrol not found (inside a container?): procckpt cannot requeue {env.label}; "
            f"after a checkpoint it exits with {EX_TEMPFAIL} for the job script outside to act on")
    elif env.chain_position is None:
        record = job.record()
        if record is not None and record.requeue_allowed is False:
            warnings.append(
                f"{env.label} cannot be requeued (Requeue=0: submitted with --no-requeue, or the "
                "site's JobRequeue=0 and no --requeue): submit with --requeue, or use procckpt "
                f"sbatch --chain N; until then a checkpointed stop exits with {EX_TEMPFAIL}")
    return warnings


# -- entry point for the cli ------------------------------------------------------------------
@dataclass
class SlurmSetup:
    deadline: SlurmDeadline
    policy: SlurmRequeue
    warnings: list[str] = field(default_factory=list)


def slurm_deadline_and_policy(config: RunConfig, *, environ: Mapping[str, str] | None = None,
                              **job_seams: Any) -> SlurmSetup | None:
    """The Slurm deadline and requeue policy when this process runs in a Slurm job, with the
    start-up warnings already logged; None outside Slurm."""
    env = slurm_env(environ)
    if env is None:
        return None
    job = SlurmJob(env, **job_seams)
    deadline = SlurmDeadline(job, config.time_limit)
    policy = SlurmRequeue(job, deadline, config)
    warnings = startup_warnings(job, config)
    for message in warnings:
        logger.warning("%s", message)
    position = f", chain task {env.chain_position[0]} of {env.chain_position[1]}" \
        if env.chain_position else ""
    logger.info("%s: restart %d%s; checkpoint signal SIG%s", env.label, policy.initial_restarts,
                position, config.checkpoint_signal)
    return SlurmSetup(deadline, policy, warnings)
