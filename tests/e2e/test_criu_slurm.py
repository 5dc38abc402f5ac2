"""The CRIU engine under a real Slurm cluster with requeue.

A `procckpt sbatch -t 1 --engine criu` job runs a script that knows nothing of procckpt and
reads its data through ``DataLoader(num_workers=2)``. It needs about 100 s of steps, more than
two one-minute cycles hold (Slurm's USR1 comes 15-45 s before the end), so the job is requeued
at least twice. Each time the whole tree, workers included, is restored from its image in
the new job's cycle, the output file handed over; every step is printed once, and the result
is bit-identical to an uninterrupted run. About 4 minutes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ..conftest import PROGRAMS, PYTHON
from .test_criu import _PROBLEM, _TOOLS, assert_same, reference
from .test_slurm import Job, JobWatcher, procckpt_sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_TOOLS is None, reason=f"no usable CRIU here: {_PROBLEM}")]

ARGS = ["--epochs", "8", "--step-sleep", "0.4"]  # 8 x 32 steps x 0.4 s: about 100 s
STEPS = 8 * 32


def test_a_tree_with_workers_is_requeued_and_restored_from_its_image(
        slurm_cluster, tmp_path: Path):
    if shutil.which("procckpt", path=str(Path(PYTHON).parent)) is None:
        pytest.skip(f"no procckpt entry point beside {PYTHON}: pip install -e . first")
    job = Job("criu", tmp_path / "criu")
    job.workdir.mkdir()
    procckpt_sbatch(slurm_cluster, job, ["-t", "1", "--engine", "criu"],
                    [PYTHON, str(PROGRAMS / "worker_loop.py"), *ARGS,
                     "--out", str(job.workdir / "final.pt")])
    watcher = JobWatcher(slurm_cluster).lift_limit(job.job_id, 2).start()
    try:
        expected = reference(["--epochs", "8"])
        record = watcher.wait_done(job.job_id, timeout=900)
    finally:
        slurm_cluster.run(["scancel", str(job.job_id)], check=False)
        watcher.stop()
    log = job.log
    assert record["JobState"] == "COMPLETED", (record, log[-3000:])
    restarts = int(record["Restarts"])
    assert restarts >= 2, f"only {restarts + 1} cycles: the test needs >= 3"
    assert log.count("procckpt: requeued Slurm job") == restarts
    assert [int(m) for m in re.findall(r"^step (\d+)", log, flags=re.M)] == \
        list(range(1, STEPS + 1)), log[-3000:]
    resumes = [e for e in job.events if e["event"] == "resume" and e.get("engine") == "criu"]
    assert len(resumes) == restarts, resumes
    assert "DUE TO TIME LIMIT" not in log
    assert_same(expected, job.workdir / "final.pt")
