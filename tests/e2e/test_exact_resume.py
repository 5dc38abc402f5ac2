"""The foundation: a run interrupted by its time limit at least three times ends
with parameters bit-identical (torch.equal) to an uninterrupted run of the same script."""

from __future__ import annotations

import json
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
    """Stopped (SIGUSR1, as before a Slurm time limit) a few steps into its first epoch, then
    through time-limit cycles to the end: one resume is in the middle of an epoch wherever
    the deadlines fall. (Left to deadlines alone, a machine whose cycles each trained about
    an epoch resumed at epochs' edges only.)"""
    from ..harness.processes import stopped_once

    # 4 epochs x 16 batches with 0.4 s per step: 25.6 s of training; each 12 s cycle trains
    # < 9 s, so the ~58 steps left after the stop need three cycles at any speed.
    args = ["--epochs", "4", "--train-size", "1024", "--workers", str(workers)]
    script = EXAMPLES / "cnn_classifier.py"
    reference = uninterrupted(workdir, script, args)
    ckpt, beat = workdir / "run-ckpt", workdir / "run-ckpt" / "control" / "heartbeat.json"

    def a_few_steps_in() -> bool:
        try:
            return json.loads(beat.read_text())["step"] >= 4
        except (OSError, ValueError, KeyError):
            return False

    first = stopped_once(["--dir", str(ckpt), "--", PYTHON, str(script), *args, "--step-sleep",
                          "0.4", "--out", str(workdir / "resumed.pt")], workdir, a_few_steps_in)
    assert first.returncode == 75, first.stderr[-3000:]
    resumed, events = interrupted(workdir, script, [*args, "--step-sleep", "0.4"],
                                  limit="12s", grace="3s")
    mid_epoch = [e for e in events if e["event"] == "resume" and 0 < e["batch"]]
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


CLOSING = PROGRAMS / "closing_train.py"


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_stop_on_an_epochs_last_batch_is_taken_after_the_epochs_closing_code(
        workdir: Path, workers: str):
    """The stop comes while batch 32 of 32 trains (as a deadline's signal would): its
    checkpoint waits for the epoch's end, so the resumed run starts in the next epoch and the
    closing code saw the last batch's loss (it crashed with NameError when resumed after
    the last batch, inside an empty loop)."""
    from ..harness.processes import stopped_once

    args = ["--workers", workers]
    reference = workdir / "reference.pt"
    done = run([PYTHON, str(CLOSING), *args, "--out", str(reference)], cwd=workdir,
               env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    argv = ["--dir", str(ckpt), "--", PYTHON, str(CLOSING), *args, "--out", str(out)]
    # Step 64 is the last batch of epoch 1 (counting from 0): paused 3 s inside it.
    stopped = stopped_once([*argv, "--pause-at-step", "64"], workdir, lambda: "step 64\n" in (
        workdir / "stopped.out").read_text())
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    (saved,) = [e for e in read_events(ckpt / "events.jsonl") if e["event"] == "checkpoint"]
    assert (saved["step"], saved["epoch"], saved["batch"]) == (64, 2, 0), saved
    res = run([*procckpt_argv(), "run", *argv], cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 65\n" in res.stdout and "step 64\n" not in res.stdout, res.stdout[:300]
    assert_bit_identical(reference, out)  # the weights and `best`


def test_a_stop_on_the_last_step_of_steps_lets_the_code_after_the_loop_run(workdir: Path):
    """``ckpt.steps(40)`` asked to stop at step 40: the end of training takes the checkpoint
    and the final evaluation after the loop runs in the same process; the run has finished."""
    from ..harness.processes import stopped_once

    reference = workdir / "reference.pt"
    done = run([PYTHON, str(CLOSING), "--steps-alone", "40", "--out", str(reference)],
               cwd=workdir, env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    stopped = stopped_once(["--dir", str(ckpt), "--", PYTHON, str(CLOSING), "--steps-alone",
                            "40", "--pause-at-step", "40", "--out", str(out)], workdir,
                           lambda: "step 40\n" in (workdir / "stopped.out").read_text())
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert (ckpt / "COMPLETE").exists()
    assert_bit_identical(reference, out)
