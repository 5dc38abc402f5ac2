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

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...launcher.config import RunConfig
from .checks import node_local_reason, sbatch_directives, signal_lead, startup_warnings
from .deadline import SlurmDeadline
from .env import ENV_CHAIN, ENV_DISABLE, ENV_END_TIME, SlurmEnv, slurm_env
from .job import JobRecord, SlurmJob, parse_scontrol_record, parse_slurm_time, parse_time_limit
from .requeue import SlurmRequeue, StopKind

__all__ = [
    "SlurmEnv", "JobRecord", "SlurmJob", "SlurmDeadline", "SlurmRequeue", "StopKind", "slurm_env",
    "slurm_deadline_and_policy", "startup_warnings", "node_local_reason", "sbatch_directives",
    "parse_scontrol_record", "parse_slurm_time", "parse_time_limit", "ENV_END_TIME", "ENV_CHAIN",
    "ENV_DISABLE",
]

logger = logging.getLogger(__name__)


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
    script = job.batch_script()
    deadline.signal_lead = signal_lead(script)
    warnings = startup_warnings(job, config, script=script)
    for message in warnings:
        logger.warning("%s", message)
    position = f", chain task {env.chain_position[0]} of {env.chain_position[1]}" \
        if env.chain_position else ""
    logger.info("%s: restart %d%s; checkpoint signal SIG%s", env.label, policy.initial_restarts,
                position, config.checkpoint_signal)
    return SlurmSetup(deadline, policy, warnings)
