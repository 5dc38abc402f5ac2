"""The foundation: a run stopped three times (each stop's checkpoint taken, the run started
again from it) ends with parameters bit-identical (torch.equal) to an uninterrupted run of the
same script. Stops at the time limit itself are tested where the deadline is the subject
(test_periodic_checkpoints.py, test_goodput.py, the engines' tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import cycles_stopped_at


def uninterrupted(workdir: Path, script: Path, args: list[str]) -> Path:
    out = workdir / "reference.pt"
    result = run([PYTHON, str(script), *args, "--ckpt-dir", str(workdir / "ref-ckpt"),
                  "--out", str(out)], cwd=workdir)
    assert result.returncode == 0, result.stderr
    return out


def interrupted(workdir: Path, script: Path, args: list[str], stops: list[int],
                ) -> tuple[Path, list[dict]]:
    """Run ``script`` under ``procckpt run``, stopped at each of ``stops`` (SIGUSR1 once the
    training reached the step, as Slurm signals before a time limit) and run again, as a
    requeued job is, then to its end."""
    out = workdir / "resumed.pt"
    ckpt = workdir / "run-ckpt"
    cycles_stopped_at(["--dir", str(ckpt), "--", PYTHON, str(script), *args, "--out", str(out)],
                      workdir, ckpt, stops, timeout=900)
    events = list(read_events(ckpt / "events.jsonl"))
    assert len([e for e in events if e["event"] == "resume"]) == len(stops), events
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "finished"
    return out, events


def test_polynomial_regression_resumes_bit_identically(workdir: Path):
    # 600 epochs (a step each) of 30 ms, stopped three times.
    args = ["--epochs", "600", "--sleep", "0.03"]
    script = EXAMPLES / "polynomial_regression.py"
    reference = uninterrupted(workdir, script, args)
    resumed, _ = interrupted(workdir, script, args, [100, 300, 500])
    assert_bit_identical(reference, resumed)


@pytest.mark.parametrize("workers", [0, 2])
def test_cnn_shuffling_loader_with_dropout_resumes_mid_epoch(workdir: Path, workers: int):
    """Stopped (SIGUSR1, as before a Slurm time limit) in the middle of three epochs, each
    time run again: every resume is inside an epoch, its shuffled order, dropout masks and
    loader workers' streams where the stopped run left them."""
    # 4 epochs x 16 batches of 0.4 s; a stop lands a step or two after the one it is asked at.
    args = ["--epochs", "4", "--train-size", "1024", "--workers", str(workers)]
    script = EXAMPLES / "cnn_classifier.py"
    reference = uninterrupted(workdir, script, args)
    resumed, events = interrupted(workdir, script, [*args, "--step-sleep", "0.4"], [4, 24, 42])
    resumes = [e for e in events if e["event"] == "resume"]
    assert all(e["batch"] > 0 for e in resumes), resumes
    assert_bit_identical(reference, resumed)


def test_tiny_program_resumes_mid_epoch_with_interval_checkpoints(workdir: Path):
    """Periodic (--interval) checkpoints do not stop the run and do not change the result."""
    args = ["--epochs", "4", "--n", "320"]
    script = PROGRAMS / "tiny_train.py"
    reference = uninterrupted(workdir, script, args)
    out = workdir / "resumed.pt"
    ckpt = workdir / "run-ckpt"
    # 4 epochs x 10 steps of 0.3 s, stopped once in epoch 1 and run again.
    cycles_stopped_at(["--dir", str(ckpt), "--interval", "2s", "--", PYTHON, str(script),
                       *args, "--step-sleep", "0.3", "--out", str(out)], workdir, ckpt, [15])
    events = list(read_events(ckpt / "events.jsonl"))
    periodic = [e for e in events if e["event"] == "checkpoint" and e["reason"] == "interval"]
    assert periodic, events
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
