"""The Slurm job this process runs in, as its ``SLURM_*`` variables describe it."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SlurmEnv", "slurm_env", "ENV_DISABLE", "ENV_END_TIME", "ENV_CHAIN"]

logger = logging.getLogger(__name__)


#: Set to 0/off/false to make ``procckpt run`` ignore that it runs in a Slurm job.
ENV_DISABLE = "PROCCKPT_SLURM"
#: The job's end time in seconds since the epoch; the container job script sets it, because
#: ``scontrol`` and ``squeue`` are missing inside the container.
ENV_END_TIME = "PROCCKPT_SLURM_END_TIME"
#: Set to 1 by chain-mode job scripts: stop without requeueing, the next array task resumes.
ENV_CHAIN = "PROCCKPT_SLURM_CHAIN"


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
    node_list: str | None = None  # the job's nodes, as Slurm writes them (n[1-2])
    node_name: str | None = None  # the node this process runs on, by Slurm's name

    @property
    def is_array_task(self) -> bool:
        return bool(self.array_job_id and self.array_task_id)

    @property
    def requeue_target(self) -> str:
        """The id ``scontrol requeue`` needs: for an array task its own,
        ``<array job id>_<task id>``, since the array's id would requeue every task."""
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
        node_list=(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
                   or None),
        node_name=environ.get("SLURMD_NODENAME") or None,
    )
