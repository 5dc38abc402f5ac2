"""A resume is bit-identical whatever the DataLoader draws its order and its workers' seeds from:
its own generator or torch's global one, in the main process or in workers, resumed at an epoch
boundary, mid-epoch, or after falling back from a damaged newest checkpoint to an epoch-end one.

The script runs on its own (a checkpoint at every epoch end), is SIGKILLed inside its second
epoch on its first start, and is run again; its final weights must equal those of a run that
was never interrupted. 96 samples in batches of 8: epochs end at steps 12, 24 and 36."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness import shared

SCRIPT = PROGRAMS / "loader_train.py"


def train(workdir: Path, name: str, *args: str) -> tuple[Path, str]:
    """Run the script with checkpoint dir ``name``; return its weights file and stderr."""
    out = workdir / f"{name}.pt"
    result = run([PYTHON, str(SCRIPT), *args, "--out", str(out),
                  "--first-start-marker", str(workdir / f"{name}.started")], cwd=workdir,
                 env={"PROCCKPT_DIR": str(workdir / name)})
    return out, result


def reference(generator: bool, workers: int) -> Path:
    """The uninterrupted run, made once a session (harness/shared.py)."""
    def make(where: Path) -> Path:
        out, result = train(where, "ref", *loader_args(generator, workers))
        assert result.returncode == 0, result.stderr[-3000:]
        return out

    return shared.once(["loader_train", *loader_args(generator, workers)], make)


def loader_args(generator: bool, workers: int) -> list[str]:
    return [*(["--generator"] if generator else []), "--workers", str(workers)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "own-generator"])
@pytest.mark.parametrize("where", ["epoch-boundary", "mid-epoch", "fallback-to-epoch-end"])
def test_resume_is_bit_identical(workdir: Path, generator: bool, workers: int, where: str):
    args = loader_args(generator, workers)
    expected = reference(generator, workers)
    crash = ["--kill-at-step", "18"]
    if where != "epoch-boundary":
        crash += ["--checkpoint-at-step", "16"]  # a mid-epoch checkpoint: epoch 1, batch 4
    _, killed = train(workdir, "run", *args, *crash)
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = sorted((workdir / "run" / "checkpoints").glob("ckpt-*"))
    if where == "fallback-to-epoch-end":
        newest = checkpoints[-1]
        assert json.loads((newest / "MANIFEST.json").read_text())["batch"] == 4
        with open(newest / "state.pt", "r+b") as f:  # one flipped byte in the middle
            f.seek(f.seek(0, 2) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))

    resumed, result = train(workdir, "run", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    at = {"epoch-boundary": "1 0 12", "mid-epoch": "1 4 16", "fallback-to-epoch-end": "1 0 12"}
    assert f"resumed {at[where]}" in result.stdout, result.stdout[:300]
    if where == "fallback-to-epoch-end":
        assert "checkpoint ckpt-00000002 is unusable" in result.stderr
    assert_bit_identical(expected, resumed)


def test_persistent_workers_are_refused_with_the_fix(workdir: Path):
    """Persistent workers keep their random state from one epoch to the next, where no
    checkpoint can reach it: a resumed run would silently differ, so procckpt refuses."""
    _, result = train(workdir, "run", "--workers", "1", "--persistent-workers")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert "persistent_workers=True" in lines[0] and "persistent_workers=False" in lines[0]
    assert "step 1" not in result.stdout


@pytest.mark.parametrize("made", ["by-the-data-set", "in-worker-init-fn"])
def test_a_coin_flip_from_the_data_sets_own_generator_is_replayed_and_exact(workdir: Path,
                                                                            made: str):
    """A sign flip from a NumPy generator the data set holds: made in its __init__ (two loads
    of sample 0 agree by chance here; the probe must not be fooled), or made by the loader's
    worker_init_fn on each worker's data set, where the main process never has it (the probe
    then runs as worker 0, worker_init_fn first). Either way the resume replays: exact."""
    args = ["--workers", "2",
            "--coin-flip" if made == "by-the-data-set" else "--coin-in-worker-init"]
    ref, done = train(workdir, "ref", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    _, killed = train(workdir, "run", *args, "--checkpoint-at-step", "16", "--kill-at-step", "18")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed, result = train(workdir, "run", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed 1 4 16" in result.stdout, result.stdout[:300]
    assert "replayed the 4 batches" in result.stderr, result.stderr[-3000:]
    if made == "by-the-data-set":
        assert "(self.coin)" in result.stderr, result.stderr[-3000:]
    assert_bit_identical(ref, resumed)


def test_a_worker_init_fn_that_configures_its_worker_s_data_set_reaches_it(workdir: Path):
    """torch's documented way to set a worker up: ``get_worker_info().dataset``, an attribute
    set there in ``worker_init_fn`` (here a scale, standing for a shard's range or a file).
    Under ckpt.batches() that object is procckpt's wrapper; the attribute must reach the data
    set the loader reads, as it does without procckpt."""
    script = workdir / "configured.py"
    script.write_text(
        "import torch, procckpt\n"
        "from torch.utils.data import DataLoader, Dataset, get_worker_info\n\n"
        "class Scaled(Dataset):\n"
        "    scale = 1\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n        return i * self.scale\n\n"
        "def configure(worker_id):\n    get_worker_info().dataset.scale = 100\n\n"
        "loader = DataLoader(Scaled(), batch_size=1, num_workers=2, worker_init_fn=configure)\n"
        "ckpt = procckpt.Checkpointer(model=torch.nn.Linear(1, 1))\n"
        "for epoch in ckpt.epochs(1):\n"
        "    print('read', [int(b) for b in ckpt.batches(loader)], flush=True)\n")
    alone = run([PYTHON, str(script)], cwd=workdir, env={"PROCCKPT_DIR": str(workdir / "a")})
    assert alone.returncode == 0 and "read [0, 100, 200, 300]" in alone.stdout, alone.stderr
    launched = run([*procckpt_argv(), "run", "--dir", str(workdir / "b"), "--", PYTHON,
                    str(script)], cwd=workdir)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "read [0, 100, 200, 300]" in launched.stdout, launched.stdout
