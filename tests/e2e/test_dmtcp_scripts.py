"""The DMTCP engine on scripts shaped like real ones, with real DMTCP: a script that
runs a subprocess now and then, one with DataLoader worker processes, and a stop that arrives
while an interval image is being taken. Each either finishes identical to an uninterrupted run
with every step once (but those of a cycle whose image stalled), or stops within two cycles
with the one-line diagnosis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from procckpt.launcher.engines import choice
from procckpt.launcher.engines.choice import probe_dmtcp
from procckpt.launcher.engines.dmtcp import find_dmtcp

from ..conftest import assert_bit_identical, procckpt_argv, run
from .test_dmtcp import LOOP, TORCH, events, loop_reference, needs_dmtcp, procckpt_run, steps

# auto takes DMTCP for a plain script only where CRIU cannot be used: CRIU is hidden here.
pytestmark = pytest.mark.usefixtures("without_criu")

DIAGNOSIS = "DMTCP could not checkpoint the command"


def torch_reference(workdir: Path, *extra: str) -> Path:
    out = workdir / "reference.pt"
    result = run([*TORCH, "--out", str(out), *extra], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(autouse=True)
def openblas_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy's OpenBLAS follows OMP_NUM_THREADS, which the suite sets to 1 (conftest.py): it
    would have no thread to join before a fork, and these tests could not see the hang that
    procckpt's OPENBLAS_NUM_THREADS=1 prevents. GOTO_NUM_THREADS gives it two again; it
    yields to OPENBLAS_NUM_THREADS, as OMP_NUM_THREADS does."""
    monkeypatch.setenv("GOTO_NUM_THREADS", "2")


@needs_dmtcp
def test_a_script_that_runs_a_subprocess_every_25_steps_finishes_identical(workdir: Path):
    """Under DMTCP 4.2 its first fork used to hang for good (NumPy's OpenBLAS joins its
    threads before a fork); procckpt gives the command OPENBLAS_NUM_THREADS=1."""
    extra = ["--epochs", "24", "--subprocess-every", "25"]  # 384 steps, several cycles
    expected = torch_reference(workdir, *extra)
    ckpt = workdir / "ckpt"
    result = procckpt_run(workdir, ckpt, ["--time-limit", "20s", "--grace", "6s"],
                          [*TORCH, "--step-sleep", "0.05", "--out",
                           str(workdir / "resumed.pt"), *extra], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    # An image asked for while a `subprocess.run` is under way may stall (seen once in a loaded
    # run: nothing written in 15 s); procckpt stops the command and goes on from the last image
    # (StuckImages.stalled), so that cycle's steps run again. Every other step runs once.
    printed = steps(result.stdout)
    stalled = [e for e in events(ckpt) if e["event"] == "image-stuck"]
    again = [i for i in range(1, len(printed)) if printed[i] <= printed[i - 1]]
    assert sorted(set(printed)) == list(range(1, 385)), result.stdout[-2000:]
    assert len(again) <= len(stalled), (again, stalled, result.stdout[-2000:])
    assert [e for e in events(ckpt) if e["event"] == "resume"], "never resumed from an image"
    assert_bit_identical(expected, workdir / "resumed.pt")


@needs_dmtcp
def test_dataloader_workers_finish_identical_or_stop_within_two_cycles_with_the_diagnosis(
        workdir: Path):
    """No image of a script with DataLoader workers is kept: most never complete, one that
    holds a worker restored with garbage batches and one taken between epochs aborted after
    its restore (CI runs). The run stops at its deadline with the one line; finishing
    identical from an image would be right too."""
    extra = ["--epochs", "12", "--workers", "2"]
    ckpt = workdir / "ckpt"
    started = time.monotonic()
    # 192 steps of at least 0.1 s: longer than the 20 s limit on any machine, so the run
    # meets its deadline (with 0.05 s a fast machine finished before it, never resumed)
    result = procckpt_run(workdir, ckpt, ["--time-limit", "20s", "--grace", "6s"],
                          [*TORCH, "--step-sleep", "0.1", "--out", str(workdir / "resumed.pt"),
                           *extra], timeout=900)
    assert [images(ckpt, c) for c in checkpoints(ckpt)] == [1] * len(checkpoints(ckpt)), \
        "an image that holds a worker was kept"  # a CI run restored one: garbage targets
    if result.returncode == 0:
        assert steps(result.stdout) == list(range(1, 193)), result.stdout[-2000:]
        assert [e for e in events(ckpt) if e["event"] == "resume"], "never resumed from an image"
        assert_bit_identical(torch_reference(workdir, *extra), workdir / "resumed.pt")
        return
    assert result.returncode == 124, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if DIAGNOSIS in line]
    assert lines and "--engine hooks" in lines[-1] and "num_workers=0" in lines[-1], \
        result.stderr[-3000:]
    cycles = [e for e in events(ckpt) if e["event"] == "exit"][-1]["cycles"]
    assert cycles <= 2 and time.monotonic() - started < 2 * 20 + 60


def checkpoints(ckpt: Path) -> list[str]:
    return sorted(p.name for p in (ckpt / "checkpoints").glob("ckpt-*"))


def images(ckpt: Path, checkpoint: str) -> int:
    """How many processes the kept image ``checkpoint`` holds."""
    manifest = json.loads((ckpt / "checkpoints" / checkpoint / "MANIFEST.json").read_text())
    return len(manifest["dmtcp"]["images"])


@needs_dmtcp
def test_a_command_whose_forked_copy_lives_keeps_no_image_and_stops_with_the_diagnosis(
        workdir: Path):
    """A DataLoader worker is a fork of the training process, and DMTCP 4.2 restored such
    programs wrong: garbage batches or a crash (SIGABRT) in CI runs, even from an image taken
    with no worker alive. procckpt keeps no image of a command once a forked copy of it has
    lived a second, and stops it at its deadline with exit 124 and the one line. The copy here
    is a plain fork, whose images complete every time (torch workers' mostly stall)."""
    ckpt = workdir / "ckpt"
    result = procckpt_run(workdir, ckpt, ["--time-limit", "12s", "--grace", "4s"],
                          [*LOOP, "--fork-copy", "--steps", "2000", "--out", "out.txt"],
                          timeout=300)
    assert result.returncode == 124, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if DIAGNOSIS in line]
    assert lines and "forked cop" in lines[-1] and "num_workers=0" in lines[-1], \
        result.stderr[-3000:]
    assert [e for e in events(ckpt) if e["event"] == "forked-copy"], result.stderr[-3000:]
    # seen before the first deadline but on a machine under load, one cycle later at most
    assert [e for e in events(ckpt) if e["event"] == "exit"][-1]["cycles"] <= 2
    assert checkpoints(ckpt) == [], "an image of the command with its copy was kept"


@needs_dmtcp
def test_a_stop_during_an_interval_image_runs_no_step_twice(workdir: Path):
    """SIGUSR2 (an image, keep going) and a SIGTERM right after it: the stop is served by an
    image of its own, taken with the process stopping, so the next run starts right after the
    last step printed."""
    ckpt = workdir / "ckpt"
    command = [*LOOP, "--steps", "200", "--ballast-mb", "300", "--out", "out.txt"]
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *command],
                            cwd=workdir, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    first = []
    for line in proc.stdout:
        if line.startswith("step "):
            first.append(int(line.split()[1]))
            if first[-1] == 60:
                break
    proc.send_signal(signal.SIGUSR2)
    time.sleep(0.3)  # the running image of 300+ MB is being written now
    proc.send_signal(signal.SIGTERM)
    rest, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr[-3000:]
    first += steps(rest)
    taken = [e for e in events(ckpt) if e["event"] == "checkpoint"]
    assert len(taken) == 2, taken  # the running image, then the one to stop at
    result = procckpt_run(workdir, ckpt, [], command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert first + steps(result.stdout) == list(range(1, 201)), (first[-5:], result.stdout[:300])
    assert (workdir / "out.txt").read_text().split()[:2] == loop_reference(workdir, 200)



@needs_dmtcp
def test_auto_tests_dmtcp_with_a_fork_under_threads(monkeypatch: pytest.MonkeyPatch):
    """The probe `--engine auto` runs passes with the environment the engine gives commands,
    and catches the hang without it."""
    tools = find_dmtcp()
    assert probe_dmtcp(tools) is None
    monkeypatch.setattr(choice, "fork_safe_env", lambda environ: {})
    monkeypatch.setattr(choice, "PROBE_TIMEOUT", 8.0)
    problem = probe_dmtcp(tools)
    assert problem is not None and "forks under threads did not finish" in problem
