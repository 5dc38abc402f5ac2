"""A resume's cost and the loop shapes it depends on: a mid-epoch resume passes over the batches
already trained on without reading them again (map-style loader, no workers; stateful loaders),
says what it did and what it cost; ``ckpt.steps()`` loops resume exactly when what one step
carries to the next is in ``ckpt.extras``, and a naive adaptation is warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import PROGRAMS, PYTHON, assert_bit_identical, load_params, procckpt_argv, run
from .test_loader_exactness import train  # the loader script alone, its dir and marker by name

PREFETCH = PROGRAMS / "prefetch_train.py"


def events(directory: Path, kind: str) -> list[dict]:
    return [e for e in read_events(directory / "events.jsonl") if e.get("event") == kind]


@pytest.mark.parametrize("loader, workers, extra, how", [
    ("torch", 0, [], "skipped the sampler's indices"),
    ("torch", 2, [], "skipped the sampler's indices"),
    # Samples drawn from a generator the data set owns are not a function of their index: the
    # worker processes get it afresh each epoch, so producing the batches again is exact.
    ("torch", 2, ["--own-rng"], "replayed the 200 batches trained before the restart (sample 0"),
    ("own", 0, [], "restored the loader's own state"),
    ("torchdata", 0, [], "restored the loader's own state"),
])
def test_a_mid_epoch_resume_says_how_it_passed_over_the_trained_batches(
        workdir: Path, loader: str, workers: int, extra: list[str], how: str):
    if loader == "torchdata":
        pytest.importorskip("torchdata.stateful_dataloader",
                            reason="torchdata (the optional extra) is not installed")
    # 2 ms of work per sample: replaying 200 batches of 8 costs at least 3.2 s.
    args = ["--loader", loader, "--workers", str(workers), "--n", "2000", "--epochs", "1",
            "--sample-cost", "0.002", *extra]
    expected, ref = train(workdir, "ref", *args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, killed = train(workdir, "run", *args, "--checkpoint-at-step", "200",
                        "--kill-at-step", "202")
    assert killed.returncode == -9, killed.stderr[-3000:]
    _, again = train(workdir, "run", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    (skip,) = events(workdir / "run", "resume-skip")
    assert skip["batches"] == 200 and how in skip["how"], skip
    assert how in again.stderr
    if "replayed" not in how:  # not read again: no cost that grows with the position
        assert skip["seconds"] < 1.0, skip
    else:
        assert skip["seconds"] >= 200 * 8 * 0.002 / workers, skip
    assert_bit_identical(expected, out)


def test_own_stateful_loader_resumes_at_an_epoch_boundary_in_its_own_epoch(workdir: Path):
    args = ["--loader", "own", "--epochs", "3"]
    expected, ref = train(workdir, "ref", *args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, killed = train(workdir, "run", *args, "--kill-at-step", "18")  # epoch 1 of 3
    assert killed.returncode == -9
    _, again = train(workdir, "run", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_bit_identical(expected, out)


def prefetch(workdir: Path, name: str, adapt: str, launched: bool) -> tuple[Path, object]:
    out = workdir / f"{name}.pt"
    script = [PYTHON, str(PREFETCH), "--adapt", adapt, "--max-iters", "600", "--out", str(out)]
    if not launched:
        return out, run(script, cwd=workdir, env={"PROCCKPT_DIR": str(workdir / name)})
    # 600 steps of 30 ms (18 s) take two or more cycles of 20 s, each of which trains for
    # several seconds even where starting Python and torch takes 10 s (a loaded machine: with
    # 6 s cycles the start-up left ~12 steps per cycle and the restart budget ran out; a CI
    # run under three suites once took over 8 s to start, three times in a row, in 10 s ones).
    return out, run([*procckpt_argv(), "run", "--dir", str(workdir / name), "--time-limit",
                     "20s", "--grace", "2s", "--", *script, "--step-sleep", "0.03"],
                    cwd=workdir, timeout=600)


def test_a_steps_loop_that_keeps_its_carried_batch_in_extras_resumes_bit_identically(
        workdir: Path):
    expected, ref = prefetch(workdir, "ref", "extras", launched=False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, result = prefetch(workdir, "run", "extras", launched=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(events(workdir / "run", "restart")) >= 1, "never interrupted: the test needs one"
    assert "drew random numbers" not in result.stderr
    steps = [int(line.split()[1]) for line in result.stdout.splitlines()
             if line.startswith("step ")]
    assert sorted(set(steps)) == list(range(600))  # every step, from the saved one on
    assert_bit_identical(expected, out)


def test_a_naive_adaptation_of_a_prefetching_loop_is_warned_about(workdir: Path):
    expected, ref = prefetch(workdir, "ref", "naive", launched=False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, result = prefetch(workdir, "run", "naive", launched=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(events(workdir / "run", "restart")) >= 1, "never interrupted: the test needs one"
    assert "drew random numbers after procckpt.Checkpointer() resumed" in result.stderr
    assert "ckpt.extras" in result.stderr
    assert events(workdir / "run", "warning")
    # And it was right to: the run differs from the uninterrupted one.
    a, b = load_params(expected), load_params(out)
    assert any(not (a[k] == b[k]).all() for k in a)
