"""Frameworks whose model and optimizer state is sharded over the ranks (FSDP2), run under
``procckpt run`` on two gloo ranks: each rank writes its own shards through DCP, and the
run, stopped twice (as a time limit stops it) with periodic checkpoints written in the
background in between, ends with the weights of an uninterrupted run, bit for bit.

Same programs and task as test_frameworks.py (examples/lightning_train.py,
examples/accelerate_train.py), with ``--fsdp``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import stopped_once
from .test_frameworks import PROGRAM, events, needs
from .test_torchrun import torchrun


def fsdp_run(workdir: Path, framework: str, *args: str) -> tuple[Path, Path, str]:
    """The uninterrupted run's weights, then the interrupted run's, and its stdout."""
    expected = workdir / "reference.pt"
    ref = run(torchrun(2, PROGRAM[framework], "--fsdp", *args, "--out", str(expected)),
              cwd=workdir, env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    command = ["--dir", str(ckpt), "--interval", "3s", "--",
               *torchrun(2, PROGRAM[framework], "--fsdp", *args, "--step-sleep", "1.5",
                         "--out", str(out))]
    # Two allocations stopped as a time limit stops them (SIGUSR1: checkpoint, then stop), each
    # once it wrote a periodic checkpoint of its own: in CI two ranks of a framework took
    # longer to start beside the rest of the suite than a 30 s --time-limit left them. 30 steps
    # a rank of 1.5 s; the third allocation trains the rest.
    stdout = ""
    for _ in range(2):
        saved = len(events(ckpt, "checkpoint"))
        stopped = stopped_once(
            command, workdir,
            lambda saved=saved: len(events(ckpt, "checkpoint")) > saved)
        assert stopped.returncode == 75, stopped.stderr[-4000:]
        stdout += stopped.stdout
    res = run([*procckpt_argv(), "run", *command], cwd=workdir, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert len(events(ckpt, "resume")) == 2, events(ckpt, "resume")
    assert [e for e in events(ckpt, "resume") if e["batch"] > 0], events(ckpt, "resume")
    periodic = [e for e in events(ckpt, "checkpoint") if e["reason"] == "interval"]
    assert len(periodic) >= 2, periodic
    assert_bit_identical(expected, out)
    return ckpt, out, stdout + res.stdout


def test_lightning_fsdp2_on_two_ranks_resumes_bit_identical_from_its_distributed_checkpoint(
        workdir: Path):
    needs("lightning")
    ckpt, _, stdout = fsdp_run(workdir, "lightning")

    # Each checkpoint is a Lightning distributed checkpoint: both ranks' shards in DCP's
    # format, the rest in meta.pt (the same file as procckpt's state.pt), under one manifest.
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt",
            "state.pt"} <= manifest["files"].keys(), manifest["files"]
    assert (newest / "meta.pt").read_bytes() == (newest / "state.pt").read_bytes()
    said = [line.split()[1] for line in stdout.splitlines() if line.startswith("resume_from ")]
    assert said[0] == "-" and all(Path(s).parent.name == "checkpoints" for s in said[1:]), said
    import torch

    meta = torch.load(newest / "meta.pt", weights_only=True)
    assert {"loops", "lr_schedulers", "pytorch-lightning_version"} <= meta.keys(), meta.keys()
    assert "state_dict" not in meta and "optimizer_states" not in meta, meta.keys()
    # DCP's own reader finds the model's and the optimizer's entries where Lightning loads them.
    read = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
            "keys = FileSystemReader(sys.argv[1]).read_metadata().state_dict_metadata; "
            "print(sorted({k.split('.')[0] for k in keys}))")
    listed = run([PYTHON, "-c", read, str(newest)], cwd=workdir)
    assert "['optimizer_0', 'state_dict']" in listed.stdout, listed.stderr[-2000:]


def test_accelerate_with_fsdp2_on_two_ranks_resumes_bit_identical(workdir: Path):
    """On CPUs the script shards the model with fully_shard and Accelerate prepares the
    optimizer, scheduler and loader (Accelerate turns its FSDP plugin on only for GPUs)."""
    needs("accelerate")
    ckpt, _, _ = fsdp_run(workdir, "accelerate")
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    assert manifest["sharded"] == ["train"], manifest
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= manifest["files"].keys()


@pytest.mark.cuda
def test_accelerates_fsdp_plugin_on_two_gpus_resumes_bit_identical(workdir: Path):
    """Accelerate's own FSDP2 plugin (fsdp_version=2), NCCL, one GPU a rank."""
    needs("accelerate")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices: Accelerate's FSDP plugin shards over a group of "
                    f"GPUs, and this machine has {torch.cuda.device_count()}")
    fsdp_run(workdir, "accelerate", "--cuda")
