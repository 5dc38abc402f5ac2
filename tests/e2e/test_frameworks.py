"""Frameworks: Lightning, Hugging Face Trainer and Accelerate scripts with procckpt's
three lines, run under ``procckpt run`` with the hooks engine, resume exactly as a hand-written
loop does.

Each program trains a small classifier on a shuffling loader with a random transform in
``__getitem__``, dropout and a step-wise LR schedule: 160 samples in batches of 8, 20 steps an
epoch (10 a rank under torchrun), 3 epochs. The tests compare the final weights with those of
an uninterrupted run of the same program, bit for bit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import EXAMPLES, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness import shared
from ..harness.processes import cycles_stopped_at, joined, stopped_once
from .test_torchrun import torchrun

PROGRAM = {"lightning": EXAMPLES / "lightning_train.py",
           "transformers": EXAMPLES / "transformers_train.py",
           "accelerate": EXAMPLES / "accelerate_train.py"}
FRAMEWORKS = list(PROGRAM)


def needs(framework: str) -> None:
    module = framework
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'procckpt[{framework}]')")


def command(framework: str, *args: str, ranks: int = 1) -> list[str]:
    if ranks > 1:
        return torchrun(ranks, PROGRAM[framework], "--ddp", *args)
    return [PYTHON, str(PROGRAM[framework]), *args]


def reference(framework: str, *args: str, ranks: int = 1) -> Path:
    """The framework script's uninterrupted result, made once a session (harness/shared.py)."""
    def make(where: Path) -> Path:
        out = where / "reference.pt"
        res = run(command(framework, *args, "--out", str(out), ranks=ranks), cwd=where,
                  env={"PROCCKPT_DIR": str(where / "ref-ckpt")}, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return out

    return shared.once([framework, f"ranks={ranks}", *args], make)


def events(ckpt: Path, kind: str) -> list[dict]:
    return [e for e in read_events(ckpt / "events.jsonl") if e["event"] == kind]


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "torchrun-2-ranks"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_cycles_stopped_mid_epoch_resume_bit_identical(workdir: Path, framework: str,
                                                       ranks: int):
    needs(framework)
    # Stops asked (SIGUSR1: checkpoint, then stop, as Slurm sends before a time limit) once
    # the training reached a step 4 batches into an epoch of 13 (a rank's); it stops at the
    # next safe point, a step or two later on a loaded machine. One process: 104 samples, 5
    # epochs, 65 steps of 0.5 s; torchrun: 208 samples, 4 epochs, 52 steps of 1 s a rank; two
    # stops each, the second in a resumed cycle (a cycle costs a framework's import, 7-35
    # processor seconds: a third stop showed nothing the second does not). Stops driven by the
    # step, not by a time limit, so that two ranks importing a framework for 20 s or more on a
    # loaded machine only make a cycle longer (with 20-30 s limits, three cycles in a row that
    # never reached a step ended such runs: "no progress").
    shape = ("--samples", "208", "--epochs", "4") if ranks > 1 else \
        ("--samples", "104", "--epochs", "5")
    expected = reference(framework, *shape, ranks=ranks)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    sleep, stops = ("1.0" if ranks > 1 else "0.5"), [4, 30]
    res = joined(cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--",
                                    *command(framework, *shape, "--step-sleep", sleep,
                                             "--out", str(out), ranks=ranks)],
                                   workdir, ckpt, stops))
    assert "engine: hooks" in res.stderr, res.stderr[:2000]
    resumes = events(ckpt, "resume")
    assert len(resumes) == len(stops), resumes
    # A stop may still fall on an epoch's last batch (a slow step), and resumes at batch 0:
    # that is right, so one resume mid-epoch is what the test asks for.
    mid_epoch = [e for e in resumes if e["batch"] > 0]
    assert mid_epoch, resumes
    assert_bit_identical(expected, out)
    # Every resume's first batch was audited (each rank's); none was flagged. (A stop at an
    # epoch's end records nothing to compare.)
    assert "resume audit:" not in res.stderr, res.stderr[-3000:]
    verdicts = [e["verdict"] for e in events(ckpt, "audit")]
    assert len(verdicts) <= len(resumes), verdicts
    assert "same" in verdicts and set(verdicts) <= {"same", "unrecorded"}, verdicts

    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert status.returncode == 0, status.stderr
    for name in sorted(p.name for p in (ckpt / "checkpoints").glob("ckpt-*")):
        assert name in status.stdout, status.stdout
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    said = [line.split()[1] for line in res.stdout.splitlines()
            if line.startswith("resume_from ")]
    if framework == "lightning":
        # What the callback hands to trainer.fit(ckpt_path=...) is a Lightning checkpoint.
        assert said[0] == "-" and all(s.endswith("/state.pt") for s in said[1:]), said
        import torch

        saved = torch.load(newest / "state.pt", weights_only=True)
        assert {"state_dict", "optimizer_states", "lr_schedulers", "loops",
                "pytorch-lightning_version"} <= saved.keys()
        # Lightning's own tools read it.
        load = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[2]); "
                "from lightning_train import Classifier; m = Classifier.load_from_checkpoint("
                "sys.argv[1], step_sleep=0.0, hang_at_step=None, marker=Path('x')); "
                "print('loaded', sum(p.numel() for p in m.parameters()))")
        loaded = run([PYTHON, "-c", load, str(newest / "state.pt"), str(EXAMPLES)], cwd=workdir)
        assert "loaded 354" in loaded.stdout, loaded.stderr[-2000:]
    if framework == "transformers":
        # ...and to trainer.train(resume_from_checkpoint=...) a Trainer checkpoint, its
        # files under procckpt's manifest.
        assert said[0] == "-" and all(Path(s).parent.name == "checkpoints"
                                      for s in said[1:]), said
        files = json.loads((newest / "MANIFEST.json").read_text())["files"]
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                "state.pt"} <= files.keys(), files
        assert not list((workdir / "hf-output").glob("checkpoint-*"))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(workdir: Path,
                                                                     framework: str):
    needs(framework)
    workers = ("--workers", "2")  # DataLoader worker processes, here
    expected = reference(framework, *workers)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # A first run with periodic checkpoints, stopped (SIGUSR1) after two of them.
    first = stopped_once(["--dir", str(ckpt), "--interval", "1s", "--",
                          *command(framework, *workers, "--step-sleep", "0.35", "--out",
                                   str(out))], workdir,
                         lambda: len(events(ckpt, "checkpoint")) >= 2, timeout=300)
    assert first.returncode == 75 and not out.exists(), first.stderr[-3000:]
    saved = sorted((ckpt / "checkpoints").glob("ckpt-*"))
    assert len(saved) >= 2, first.stderr[-3000:]
    newest, previous = saved[-1], saved[-2]
    with open(newest / "state.pt", "r+b") as f:  # one flipped byte in the middle
        f.seek(f.seek(0, 2) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))

    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--",
               *command(framework, *workers, "--out", str(out))], cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    (resumed,) = events(ckpt, "resume")[-1:]
    assert resumed["checkpoint"] == previous.name, resumed
    assert [e["checkpoint"] for e in events(ckpt, "corrupt")] == [newest.name]
    if framework == "lightning":
        assert f"resume_from {previous / 'state.pt'}" in res.stdout, res.stdout[:500]
    if framework == "transformers":
        assert f"resume_from {previous}\n" in res.stdout, res.stdout[:500]
    assert_bit_identical(expected, out)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_stuck_step_is_caught_as_a_hang_and_the_run_resumes_exactly(workdir: Path,
                                                                       framework: str):
    needs(framework)
    expected = reference(framework)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "1s",
               "--hang-timeout", "8s", "--term-timeout", "2s", "--",
               *command(framework, "--step-sleep", "0.05", "--hang-at-step", "30",
                        "--out", str(out))], cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    (hang,) = events(ckpt, "hang")
    assert 20 <= hang["step"] <= 30, hang  # the 30th step hangs before or after its end
    assert [e["cause"] for e in events(ckpt, "restart")] == ["hang"]
    (resumed,) = events(ckpt, "resume")
    assert 0 < resumed["step"] <= hang["step"], (resumed, hang)
    assert_bit_identical(expected, out)


def test_lightning_resume_from_is_none_on_a_fresh_start_and_the_finished_run_trains_no_more(
        workdir: Path):
    needs("lightning")
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--",
            *command("lightning", "--epochs", "1", "--out", str(out))]
    first = run(argv, cwd=workdir, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resume_from -" in first.stdout
    complete = json.loads((ckpt / "COMPLETE").read_text())
    assert complete["step"] == 20, complete
    again = run(argv, cwd=workdir, timeout=300)
    assert again.returncode != 0 or "step 1\n" not in again.stdout, again.stdout[-2000:]


DEVICE_PATHS = [pytest.param("twin", id="cpu-twin"),
                pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]


@pytest.mark.parametrize("path", DEVICE_PATHS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_device_path_checkpoints_stops_and_resumes_bit_identical(workdir: Path,
                                                                      framework: str, path: str):
    """The GPU path: state on the device (``--cuda``; CUDA random streams, dropout), its
    background checkpoints through the page-locked arena and the step fence, a stop's
    checkpoint, the resume. On ``cpu-twin`` the same path with CPU state
    (PROCCKPT_DEVICE_TWIN=1, tests/README.md): where the Accelerate run met the fence's crash
    on a GPU, this fails on a CPU too."""
    needs(framework)
    if path == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device; there is none")
        args, env = ["--cuda"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS
    else:
        args, env = [], {"PROCCKPT_DEVICE_TWIN": "1"}
    if path == "cuda":
        out_ref = workdir / "reference.pt"
        ref = run(command(framework, *args, "--out", str(out_ref)), cwd=workdir,
                  env={**env, "PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
        assert ref.returncode == 0, ref.stderr[-3000:]
    else:  # the twin changes how state is saved, never what trains: the plain run's result
        out_ref = reference(framework)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    argv = ["--dir", str(ckpt), "--interval", "1s", "--",
            *command(framework, *args, "--step-sleep", "0.1", "--out", str(out))]
    # Stopped (SIGUSR1: checkpoint, then stop) once a periodic checkpoint was written in the
    # background; the next run resumes from the stop's checkpoint and finishes.
    stopped = stopped_once(argv, workdir, lambda: any(
        e["reason"] == "interval" for e in events(ckpt, "checkpoint")), env=env, timeout=300)
    assert stopped.returncode == 75, stopped.stderr[-4000:]
    assert not out.exists(), stopped.stderr[-3000:]
    res = run([*procckpt_argv(), "run", *argv], cwd=workdir, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    (resumed,) = events(ckpt, "resume")
    assert resumed["step"] > 0, resumed
    assert_bit_identical(out_ref, out)


def test_accelerate_with_gradient_accumulation_checks_exact_and_resumes_bit_identical(
        workdir: Path):
    needs("accelerate")
    script = command("accelerate", "--accumulate", "2", "--epochs", "1")
    # A stop asked for after the first micro-batch of a window waits for its end; one at the
    # end of a window is taken there. Both resumes are exact.
    for at, stopped in ((3, 4), (4, 4)):
        done = run([*procckpt_argv(), "check", "--steps", "12", "--at", str(at), "--",
                    *script], cwd=workdir, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        assert done.stdout.startswith(f"exact: stopped in the middle of an epoch at step "
                                      f"{stopped}, "), done.stdout
        assert (f"asked to stop at step {at}, the run could take its checkpoint only at step "
                f"{stopped}" in done.stdout) == (at != stopped), done.stdout
    # 80 micro-batches in 4 epochs, stopped (SIGUSR1, then run again) twice, each asked for
    # inside a window: it waits for the window's end.
    expected = reference("accelerate", "--accumulate", "2", "--epochs", "4")
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--",
                       *command("accelerate", "--accumulate", "2", "--epochs", "4",
                                "--step-sleep", "0.5", "--out", str(out))],
                      workdir, ckpt, [9, 51])
    assert len(events(ckpt, "resume")) == 2
    saved = [e["step"] for e in events(ckpt, "checkpoint")]
    assert saved and all(step % 2 == 0 for step in saved), saved  # never inside a window
    assert [e for e in events(ckpt, "resume") if e["batch"] > 0], events(ckpt, "resume")
    assert_bit_identical(expected, out)


def test_the_trainers_own_checkpoints_are_kept_as_its_save_total_limit_says(workdir: Path):
    """save_steps=10, save_total_limit=2 beside procckpt's periodic checkpoints and a stop:
    the Trainer keeps its two newest (the last one its final save), as without procckpt;
    procckpt's checkpoints never counted against the limit nor took the user's folders."""
    needs("transformers")
    own = ("--save-steps", "10", "--save-total-limit", "2")
    expected = reference("transformers", *own)  # run in a folder of its own
    kept = sorted(p.name for p in (expected.parent / "hf-output").glob("checkpoint-*"))
    assert kept == ["checkpoint-50", "checkpoint-60"], kept
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    argv = ["--dir", str(ckpt), "--interval", "1s", "--",
            *command("transformers", *own, "--step-sleep", "0.1", "--out", str(out))]
    stopped = stopped_once(argv, workdir, lambda: len(events(ckpt, "checkpoint")) >= 2)
    assert stopped.returncode == 75, stopped.stderr[-4000:]
    res = run([*procckpt_argv(), "run", *argv], cwd=workdir, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert sorted(p.name for p in (workdir / "hf-output").glob("checkpoint-*")) == kept
    assert len(events(ckpt, "checkpoint")) >= 3
    assert not list((ckpt / "checkpoints").glob(".tmp-*"))  # the staging folder is gone
    assert_bit_identical(expected, out)
