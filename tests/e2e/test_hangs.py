"""Hangs: a step that never ends, a stuck rank of a torchrun group and a stuck DataLoader worker
are caught, their stacks logged, and the run resumes to the same result; long data preparation
and validation are no hang. Real launcher, real training processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import TINY, events, reference


@pytest.mark.parametrize("how,where", [("sleep", "stuck_waiting_for_data"),
                                       ("lock", "stuck_on_a_lock")])
def test_a_hung_script_is_caught_its_stacks_logged_and_it_resumes_to_the_same_result(
        workdir: Path, how: str, where: str):
    args = ["--epochs", "10", "--step-sleep", "0.05"]
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    started = time.monotonic()
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "1s",
               "--hang-timeout", "20s", "--term-timeout", "2s", "--", *TINY, *args,
               "--hang-at-step", "50", "--hang-how", how, "--out", str(out)], cwd=workdir)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr[-3000:]
    (hang,) = events(ckpt, "hang")
    # The body of the 50th batch never returned to the loop: 49 steps completed, and the
    # launcher heard of them up to a second (its heartbeat's pace) before the hang.
    assert 30 <= hang["step"] <= 49 and 20 <= hang["seconds"] <= 23, hang
    assert "no step completed for" in res.stderr and f"last step {hang['step']})" in res.stderr
    # faulthandler's dump of the stuck process names the function it is stuck in.
    assert where in res.stderr, res.stderr[-3000:]
    assert [e["cause"] for e in events(ckpt, "restart")] == ["hang"]
    resumed = [e for e in events(ckpt, "resume")]
    # From the newest state before the hang: the periodic checkpoints (one every second: ~20
    # steps apart), and the memory tier's slot that the launcher kept after the hang's kill.
    (restart,) = events(ckpt, "restart")
    before = [e["step"] for e in events(ckpt, "checkpoint") if e["time"] <= restart["time"]]
    kept = [e["step"] for e in events(ckpt, "tier-kept")]
    assert resumed and resumed[0]["step"] == max(before + kept), (resumed, before, kept)
    assert all(step <= 49 for step in kept), kept
    # Periodic checkpoints went on until the hang (how many steps apart depends on the load).
    assert len(before) >= 2 and resumed[0]["step"] > 0, (resumed, before)
    assert took < 90
    assert_bit_identical(expected, out)
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert "hangs: 1" in status.stdout, status.stdout


def test_a_stuck_rank_of_a_torchrun_group_is_caught_and_the_group_resumes_exactly(
        workdir: Path):
    from .test_torchrun import DDP, assert_same_run, torchrun, uninterrupted

    args = ["--epochs", "2", "--train-size", "512", "--sleep", "0.1"]  # 2 x 16 steps
    expected = uninterrupted(workdir, DDP, args, "plain")
    ckpt, out = workdir / "ckpt", workdir / "hung"
    # --engine hooks: the wrapper loads the example by path, which auto cannot see.
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--engine", "hooks", "--interval",
               "2s", "--hang-timeout", "20s", "--term-timeout", "3s", "--",
               *torchrun(2, PROGRAMS / "ddp_hang.py", *args, "--out", str(out))],
              cwd=workdir, timeout=600, env={"HANG_RANK": "1", "HANG_AT_STEP": "20"})
    assert res.returncode == 0, res.stderr[-4000:]
    # Rank 1 sticks after its 20th step's all-reduce; rank 0 finishes step 20 and then waits
    # in the next one's.
    (hang,) = events(ckpt, "hang")
    assert hang["step"] is not None and hang["step"] <= 20, hang
    assert "stuck_forever" in res.stderr, res.stderr[-4000:]
    assert [e["cause"] for e in events(ckpt, "restart")] == ["hang"]
    assert_same_run(expected, out)


@contextlib.contextmanager
def both_cores_busy() -> Iterator[None]:
    """A load the test makes itself: a spinning process per core, as on a shared node."""
    spinners = [subprocess.Popen([PYTHON, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.parametrize("load", ["quiet", "loaded"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_stuck_dataloader_worker_is_a_hang_caught_with_every_stack_and_resumed_exactly(
        workdir: Path, workers: str, load: str):
    args = ["--epochs", "2", "--n", "256", "--batch-size", "8", "--workers", workers,
            "--step-sleep", "0.05"]
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # The worker that loads sample 100 blocks for ever; the main process waits for its batch
    # in the DataLoader's queue.get(timeout=5), waking every 5 s to look at its workers (each
    # wake-up took more than the old 0.5-ms threshold on a loaded machine: a move, so the
    # hang was never caught). Periodic checkpoints are asked for all along: one is
    # outstanding when the training stops.
    with both_cores_busy() if load == "loaded" else contextlib.nullcontext():
        res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "1s",
                   "--hang-timeout", "10s", "--term-timeout", "2s", "--", *TINY, *args,
                   "--stuck-worker-after", "100", "--out", str(out)], cwd=workdir,
                  timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    (hang,) = events(ckpt, "hang")
    assert 10 <= hang["seconds"] <= 20, hang  # within twice the hang timeout
    assert "no step completed for" in res.stderr
    # The stacks: the main thread waiting in the DataLoader, and the worker where it is stuck.
    assert "_try_get_data" in res.stderr and "stuck_in_a_worker" in res.stderr, \
        res.stderr[-3000:]
    assert [e["cause"] for e in events(ckpt, "restart")] == ["hang"]
    assert_bit_identical(expected, out)


def test_long_data_preparation_and_validation_are_no_hang(workdir: Path):
    args = ["--epochs", "2", "--n", "128"]
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # 30 s of Python work after Checkpointer() before the first step, and a 30 s validation
    # pass at the end of the first epoch: each longer than the 20 s hang timeout.
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--hang-timeout", "20s",
               "--interval", "5s", "--", *TINY, *args, "--prepare-seconds", "30",
               "--validate-seconds", "30", "--out", str(out)], cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not events(ckpt, "hang") and not events(ckpt, "restart"), res.stderr[-3000:]
    assert "looks stuck" not in res.stderr
    assert res.stdout.count("validating") == 2
    assert_bit_identical(expected, out)
