"""The DMTCP engine under a real Slurm cluster with requeue.

Two `procckpt sbatch -t 1` jobs run side by side: the plain Python loop (engine chosen by
``auto``) and the plain PyTorch script (``--engine dmtcp``). Neither imports procckpt. Each needs
about 100 s of work, more than two one-minute cycles hold (Slurm's USR1 comes 15-45 s before the
end), so each is requeued at least twice and continues from its process image every time. About
4 minutes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, NO_CRIU_ENV, PROGRAMS, PYTHON, assert_bit_identical, run
from .test_slurm import Job, JobWatcher, procckpt_sbatch, said

# One worker runs the module: its fixture submits both jobs together.
pytestmark = [pytest.mark.slurm, pytest.mark.dmtcp, pytest.mark.slow,
              pytest.mark.xdist_group("dmtcp-slurm"),
              pytest.mark.skipif(shutil.which("dmtcp_launch") is None,
                                 reason="DMTCP is not installed (no dmtcp_launch on PATH); "
                                        "`module load dmtcp` or build it from "
                                        "https://github.com/dmtcp/dmtcp")]

LOOP_STEPS = 2000  # x 50 ms
TORCH_ARGS = ["--epochs", "25", "--step-sleep", "0.25"]  # 25 x 16 steps x 250 ms
TORCH_STEPS = 25 * 16


def steps(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+)", log, flags=re.M)]


@pytest.fixture(scope="module")
def dmtcp_jobs(slurm_cluster, tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("procckpt", path=str(Path(PYTHON).parent)) is None:
        pytest.skip(f"no procckpt entry point beside {PYTHON}: pip install -e . first")
    root = tmp_path_factory.mktemp("dmtcp-slurm")
    loop, torch_job = Job("loop", root / "loop"), Job("torch", root / "torch")
    for job in (loop, torch_job):
        job.workdir.mkdir()
    procckpt_sbatch(slurm_cluster, loop, ["-t", "1"],
                    [PYTHON, str(PROGRAMS / "plain_loop.py"), "--steps", str(LOOP_STEPS),
                     "--ballast-mb", "8", "--out", str(loop.workdir / "out.txt")],
                    env=NO_CRIU_ENV)  # auto takes DMTCP where CRIU cannot be used
    # Its image is ~650 MB: a first one (nothing measured yet) may take 15 s on a loaded
    # machine, the default grace; --grace moves Slurm's USR1 and the launcher's stop earlier.
    procckpt_sbatch(slurm_cluster, torch_job, ["-t", "1", "--engine", "dmtcp", "--grace", "25s"],
                    [PYTHON, str(EXAMPLES / "plain_torch_train.py"), *TORCH_ARGS,
                     "--out", str(torch_job.workdir / "final.pt")])
    watcher = JobWatcher(slurm_cluster)
    watcher.lift_limit(loop.job_id, 2).lift_limit(torch_job.job_id, 2).start()
    references = root / "reference"
    references.mkdir()
    for argv in ([PROGRAMS / "plain_loop.py", "--steps", str(LOOP_STEPS), "--step-sleep", "0",
                  "--out", references / "loop.txt"],
                 [EXAMPLES / "plain_torch_train.py", *TORCH_ARGS[:2],
                  "--out", references / "torch.pt"]):
        done = run([PYTHON, *map(str, argv)], cwd=references)
        assert done.returncode == 0, done.stderr
    try:
        yield watcher, loop, torch_job, references
    finally:
        slurm_cluster.run(["scancel", str(loop.job_id), str(torch_job.job_id)], check=False)
        watcher.stop()


def assert_requeued_and_resumed_from_images(watcher: JobWatcher, job: Job, total: int) -> None:
    record = watcher.wait_done(job.job_id, timeout=900)
    log = job.log
    assert record["JobState"] == "COMPLETED", (record, log[-3000:])
    restarts = int(record["Restarts"])
    assert restarts >= 2, f"only {restarts + 1} cycles: the test needs >= 3"
    shown = said(log)
    # Each requeue said once: by procckpt's own requeue, or seen as Slurm's (a requeue whose
    # scontrol did not answer in time on a loaded runner, but which Slurm carried out).
    requeues = re.findall(r"^procckpt: .*(?:requeued Slurm job|Slurm job \d+ stopped .* Slurm "
                          r"has requeued it already)", log, flags=re.M)
    assert len(requeues) == restarts, shown
    # Every stop left an image to continue from.
    assert not [e for e in job.events if e["event"] == "unconfirmed"], shown
    # One log for all cycles: every step printed exactly once, in order, so no cycle went
    # back (a stop's image is taken with --kcheckpoint: nothing runs past it).
    assert steps(log) == list(range(1, total + 1)), shown
    # One restart a cycle, and one more for each image that failed to restore (the engine
    # fell back to the one before it within the cycle; none on a quiet machine).
    resumes = [e for e in job.events if e["event"] == "resume" and e.get("engine") == "dmtcp"]
    failed = [e for e in job.events if e["event"] == "restore-failed"]
    assert len(resumes) == restarts + len(failed), (resumes, shown)
    assert len(failed) <= 1, shown
    assert "DUE TO TIME LIMIT" not in log, shown


def test_plain_loop_is_requeued_and_continues_from_its_image(dmtcp_jobs):
    watcher, loop, _, references = dmtcp_jobs
    assert_requeued_and_resumed_from_images(watcher, loop, LOOP_STEPS)
    assert "engine: dmtcp (the command does not import procckpt and DMTCP is installed (not " \
           "CRIU: /nonexistent/criu is not an executable))" in loop.log
    assert "engine: dmtcp (the checkpoint dir holds DMTCP images)" in loop.log  # requeued runs
    final = (loop.workdir / "out.txt").read_text().split()
    assert final[:2] == (references / "loop.txt").read_text().split()[:2]
    assert re.findall(r"^ballast (\w+)$", loop.log, flags=re.M) == [final[2]]


def test_pytorch_script_is_requeued_and_ends_with_the_same_parameters(dmtcp_jobs):
    watcher, _, torch_job, references = dmtcp_jobs
    assert_requeued_and_resumed_from_images(watcher, torch_job, TORCH_STEPS)
    assert_bit_identical(references / "torch.pt", torch_job.workdir / "final.pt")
