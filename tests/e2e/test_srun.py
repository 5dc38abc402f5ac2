"""``procckpt run -- srun`` with 2 tasks in a job on the real (test)
Slurm cluster, stopped by its one-minute time limit and requeued until it finishes, ends
bit-identical to an uninterrupted 2-rank run.

Only rank 1 reads the launcher's requests (``PROCCKPT_POLL_RANKS=1``); the job is requeued
once per cycle, by the launcher in the batch step, never by the ranks. About 3 minutes (cycles
of ~30 s: Slurm sends ``--signal=B:USR1@15`` 15-45 s into a one-minute job).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PYTHON, assert_bit_identical
from ..harness.slurm_cluster import SlurmCluster
from .test_frameworks import needs, reference
from .test_slurm import Job, JobWatcher, procckpt_sbatch
from .test_torchrun import SHAPE, assert_same_run, ddp_shape_reference

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

DDP = EXAMPLES / "ddp_train.py"
# About 2 s a step: ~96 s of training, so a 1-minute job needs >= 3 cycles however fast
# the machine (each cycle trains ~40 s before Slurm's signal).
ARGS = [*SHAPE, "--sleep", "2.0"]


def run_ddp_job(cluster: SlurmCluster, tmp_path: Path, name: str, sbatch_args: list[str],
                args: list[str], env: dict[str, str] | None = None,
                ) -> tuple[Job, dict[str, str], Path, Path]:
    """Submit ``procckpt sbatch ... -- srun python ddp_train.py``, make the uninterrupted
    2-rank reference while it runs, and wait for its end: (job, its last record, the
    reference's output prefix, the job's). Requeued twice, the job gets a longer limit
    (JobWatcher.lift_limit)."""
    job = Job(name, tmp_path / "job")
    job.workdir.mkdir()
    out = job.workdir / "out"
    procckpt_sbatch(cluster, job, sbatch_args, ["srun", PYTHON, str(DDP), *args, "--out",
                                                str(out)], env=env)
    watcher = JobWatcher(cluster).lift_limit(job.job_id, 2).start()
    try:
        reference = ddp_shape_reference()  # while the job runs (or made by another test)
        record = watcher.wait_done(job.job_id, timeout=900)
    finally:
        watcher.stop()
        cluster.run(["scancel", str(job.job_id)], check=False)
    return job, record, reference, out


def test_srun_two_tasks_requeued_resume_bit_identically(slurm_cluster: SlurmCluster,
                                                        tmp_path: Path):
    job, record, reference, out = run_ddp_job(slurm_cluster, tmp_path, "srun",
                                              ["-t", "1", "--ntasks", "2"], ARGS,
                                              env={"PROCCKPT_POLL_RANKS": "1"})
    assert record["JobState"] == "COMPLETED", (record, job.log[-4000:])
    restarts = int(record["Restarts"])
    assert restarts >= 2, f"only {restarts + 1} cycles: the test needs >= 3"
    log = job.log
    # Once per cycle, by the launcher: not once per rank.
    assert log.count("procckpt: requeued Slurm job") == restarts, log[-4000:]
    events = job.events
    assert [e["reason"] for e in events if e["event"] == "exit"] == \
        ["requeued"] * restarts + ["finished"]
    # Both ranks stopped at the same step each time; rank 0 only through the agreement. (A
    # periodic checkpoint, which a slow first cycle may take before its stop, is no stop.)
    periodic = {"interval", "checkpoint requested on another rank"}
    stops = [e for e in events if e["event"] == "checkpoint"
             and e["reason"] != "end" and e["reason"] not in periodic]
    # Slurm's USR1 may come before the ranks could connect (under load): the launcher waits
    # for them, but a cycle whose ranks never connected before its end saves nothing, and
    # only such a cycle may end without a stop.
    unconfirmed = [e for e in events if e["event"] == "unconfirmed"]
    assert not [e for e in unconfirmed if e["connected"]], unconfirmed
    assert len(stops) + len(unconfirmed) >= restarts, (stops, unconfirmed)
    assert all(e["reason"] == "stop requested on another rank" for e in stops), stops
    assert any(e["event"] == "resume" and e["batch"] > 0 for e in events)
    assert_same_run(reference, out)


def test_lightning_on_slurm_as_docs_slurm_md_says_is_requeued_and_resumes_bit_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path):
    """docs/slurm.md's recipe for N GPUs, on 2 CPU tasks: `--ntasks-per-node` matching the
    Trainer's devices, `srun`, no --signal of the user's own, the Trainer's defaults for
    Slurm (auto_requeue on: the callback turns it off)."""
    needs("lightning")
    # 208 samples: 13 steps a rank an epoch, 39 in all; at 2.5 s a step, ~100 s of training,
    # more than a two-minute job's first cycle holds once two Lightning ranks have started.
    args = ["--ddp", "--samples", "208"]
    job = Job("lightning", tmp_path / "job")
    job.workdir.mkdir()
    out = job.workdir / "out.pt"
    procckpt_sbatch(slurm_cluster, job, ["-t", "2", "--nodes", "1", "--ntasks-per-node", "2"],
                    ["srun", PYTHON, str(EXAMPLES / "lightning_train.py"), *args,
                     "--step-sleep", "2.5", "--out", str(out)])
    watcher = JobWatcher(slurm_cluster).lift_limit(job.job_id, 1).start()
    try:
        expected = reference("lightning", *args[1:], ranks=2)  # while the job runs
        record = watcher.wait_done(job.job_id, timeout=900)
    finally:
        watcher.stop()
        slurm_cluster.run(["scancel", str(job.job_id)], check=False)
    log = job.log
    assert record["JobState"] == "COMPLETED", (record, log[-4000:])
    restarts = int(record["Restarts"])
    assert restarts >= 1 and log.count("procckpt: requeued Slurm job") == restarts, log[-4000:]
    assert "Lightning's auto_requeue is off" in log, log[-4000:]
    # Lightning requeued nothing itself, nor did a stop wait for SIGKILL.
    assert "Handling auto-requeue signal" not in log, log[-4000:]
    assert "did not exit" not in log, log[-4000:]
    assert any(e["event"] == "resume" for e in job.events)
    assert_bit_identical(expected, out)
