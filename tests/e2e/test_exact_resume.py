"""The foundation: a run interrupted by its time limit at least three times ends
with parameters bit-identical (torch.equal) to an uninterrupted run of the same script."""

from __future__ import annotations

from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run


def uninterrupted(workdir: Path, script: Path, args: list[str]) -> Path:
    out = workdir / "reference.pt"
    result = run([PYTHON, str(script), *args, "--ckpt-dir", str(workdir / "ref-ckpt"),
                  "--out", str(out)], cwd=workdir)
    assert result.returncode == 0, result.stderr
    return out


def interrupted(workdir: Path, script: Path, args: list[str], limit: str, grace: str,
                ) -> tuple[Path, list[dict]]:
    out = workdir / "resumed.pt"
    ckpt = workdir / "run-ckpt"
    result = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", limit,
                  "--grace", grace, "--max-restarts", "60", "--",
                  PYTHON, str(script), *args, "--out", str(out)], cwd=workdir, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    events = list(read_events(ckpt / "events.jsonl"))
    restarts = [e for e in events if e["event"] == "restart" and e["cause"] == "deadline"]
    assert len(restarts) >= 2, f"only {len(restarts) + 1} cycles: the test needs >= 3"
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "finished"
    return out, events


def test_polynomial_regression_resumes_bit_identically(workdir: Path):
    # 600 epochs with 30 ms sleep each: >= 18 s of training, and each 10 s cycle trains < 7 s.
    args = ["--epochs", "600", "--sleep", "0.03"]
    script = EXAMPLES / "polynomial_regression.py"
    reference = uninterrupted(workdir, script, args)
    resumed, _ = interrupted(workdir, script, args, limit="10s", grace="3s")
    assert_bit_identical(reference, resumed)


@pytest.mark.parametrize("workers", [0, 2])
def test_cnn_shuffling_loader_with_dropout_resumes_mid_epoch(workdir: Path, workers: int):
    # 3 epochs x 16 batches with 0.4 s per step: 19.2 s of training; each 12 s cycle trains < 9 s.
    args = ["--epochs", "3", "--train-size", "1024", "--workers", str(workers)]
    script = EXAMPLES / "cnn_classifier.py"
    reference = uninterrupted(workdir, script, args)
    resumed, events = interrupted(workdir, script, [*args, "--step-sleep", "0.4"],
                                  limit="12s", grace="3s")
    mid_epoch = [e for e in events if e["event"] == "resume" and e["batch"] > 0]
    assert mid_epoch, "no cycle resumed in the middle of an epoch"
    assert_bit_identical(reference, resumed)


def test_tiny_program_resumes_mid_epoch_with_interval_checkpoints(workdir: Path):
    """Periodic (--interval) checkpoints do not stop the run and do not change the result."""
    args = ["--epochs", "4", "--n", "320"]
    script = PROGRAMS / "tiny_train.py"
    reference = uninterrupted(workdir, script, args)
    out = workdir / "resumed.pt"
    ckpt = workdir / "run-ckpt"
    result = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "12s", "--grace",
                  "3s", "--interval", "2s", "--max-restarts", "60", "--", PYTHON, str(script),
                  *args, "--step-sleep", "0.3", "--out", str(out)], cwd=workdir, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    events = list(read_events(ckpt / "events.jsonl"))
    assert any(e["event"] == "checkpoint" and e["reason"] == "interval" for e in events)
    assert_bit_identical(reference, out)
