"""A fine-tune of a frozen base (examples/finetune_frozen.py: ~95% of the state's bytes frozen,
low-rank adapters trained with AdamW) under ``procckpt run``, stopped and started again, with
periodic checkpoints: every checkpoint but the first writes less than a tenth of the state,
the first one of each resumed process too (the chunks it would write are in the store
already), the run ends bit-identical to an uninterrupted one, and no chunk is left that no
kept checkpoint lists. The same under torchrun (DDP over 2 gloo ranks), where rank 0 writes
the state, and with the model sharded over the ranks (FSDP2), where the frozen shards are a
DCP set of their own, written once and loaded into another number of ranks too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import cycles_stopped_at, stopped_once
from .test_frameworks import events

SCRIPT = EXAMPLES / "finetune_frozen.py"
#: Three cycles at any speed: each but the last is stopped (SIGUSR1, as Slurm sends before a
#: time limit) once the training reached a step, not at a time limit, which two ranks still
#: importing torch on a loaded machine could miss three cycles in a row ("no progress"). 240
#: steps of 0.12 s alone, 160 a rank of 0.25 s: periodic checkpoints (every 2 s) in each.
RUNS = {"python": (("--epochs", "15"), "0.12", [60, 150]),
        "torchrun": (("--epochs", "10"), "0.25", [40, 100]),
        "fsdp": (("--epochs", "10", "--fsdp"), "0.25", [40, 100])}


TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def kept_manifests(ckpt: Path) -> list[dict]:
    return [json.loads(m.read_text())
            for m in sorted((ckpt / "checkpoints").glob("ckpt-*[0-9]/MANIFEST.json"))]


def stored_chunks(ckpt: Path) -> set[str]:
    return {f"blake3:{f.name}" for f in (ckpt / "chunks" / "blake3").glob("*/*")}


@pytest.mark.parametrize("launch", ["python", "torchrun", "fsdp"])
def test_a_frozen_base_is_written_once_across_cycles_and_resumes_bit_identical(
        workdir: Path, launch: str):
    command = [PYTHON] if launch == "python" else TORCHRUN
    args, sleep, stops = RUNS[launch]
    expected = workdir / "reference.pt"
    ref = run([*command, str(SCRIPT), *args, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--interval", "2s", "--engine",
                       "hooks", "--", *command, str(SCRIPT), *args, "--step-sleep", sleep,
                       "--out", str(out)], workdir, ckpt, stops, timeout=900)
    assert len(events(ckpt, "resume")) == len(stops)
    saved = events(ckpt, "checkpoint")
    first, *later = saved
    assert first["written"] == first["bytes"], first
    assert len(later) >= 4 and all(e["written"] <= 0.1 * e["bytes"] for e in later), later
    # Written small by resumed processes too. (Under load the first process may reach no
    # checkpoint after its first: CI once saw restarts 1-5 only.)
    assert {e["restart"] for e in later} >= {1, 2}, later
    assert_bit_identical(expected, out)

    # Collection: the chunks on disk are exactly those the kept checkpoints list.
    listed, kept = set(), kept_manifests(ckpt)
    for manifest in kept:
        listed |= set(manifest["chunks"])
    assert stored_chunks(ckpt) == listed
    if launch == "fsdp":  # one set, DCP's index and each rank's file, shared by all
        (files,) = {json.dumps(m["frozen_shards"], sort_keys=True) for m in kept}
        assert set(json.loads(files)) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert listed == set(json.loads(files).values())
    else:
        assert len(listed) == 4  # the four frozen layers' weights

    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert status.returncode == 0, status.stderr
    header, *rows = [line.split() for line in status.stdout.splitlines()
                     if line.startswith(("CHECKPOINT", "ckpt-"))]
    assert header[3:5] == ["SIZE", "WRITTEN"], status.stdout
    # SIZE and WRITTEN, two words each: 4.4 MB of state, some hundreds of KB written.
    assert all(r[4] == "MB" and r[6] == "KB" and r[-1] == "yes" for r in rows), status.stdout
    report = run([*procckpt_argv(), "report", str(ckpt)], cwd=workdir)
    assert report.returncode == 0 and (ckpt / "report.html").is_file(), report.stderr


def test_lightning_shares_a_frozen_encoder_across_checkpoints_and_resumes_bit_identical(
        workdir: Path):
    """Lightning loads ``state.pt`` itself (``fit(ckpt_path=cb.resume_from)``): the callback
    gives its strategy a checkpoint I/O that puts the frozen weights back."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install 'procckpt[lightning]')")
    # 80 steps in 4 epochs, stopped (SIGUSR1, then run again) in epochs 0 and 2.
    script = [PYTHON, str(EXAMPLES / "lightning_train.py"), "--frozen-base", "--epochs", "4"]
    expected = workdir / "reference.pt"
    ref = run([*script, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--interval", "2s", "--",
                       *script, "--step-sleep", "0.5", "--out", str(out)], workdir, ckpt,
                      [15, 45])
    assert len(events(ckpt, "resume")) == 2
    frozen = 256 * 256 * 4  # the encoder's second layer (its first is under 64 KiB)
    first, *later = events(ckpt, "checkpoint")
    assert first["written"] == first["bytes"] > frozen
    assert later and all(e["written"] <= e["bytes"] - frozen for e in later), later
    assert_bit_identical(expected, out)


def test_frozen_shards_written_by_two_ranks_load_into_three(workdir: Path):
    """FSDP2 over 2 ranks, stopped (SIGUSR1, as `procckpt sbatch` has Slurm send) after its
    periodic checkpoints; the next allocation has 3 ranks: DCP reshards the frozen set like
    the rest, the new ranks list it without writing it again, and the frozen weights they
    end with are the base's (what an uninterrupted run ends with: they never train)."""
    args = [str(SCRIPT), "--fsdp", "--epochs", "4"]
    expected = workdir / "reference.pt"
    ref = run([*TORCHRUN, *args, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    first = stopped_once(["--dir", str(ckpt), "--interval", "2s", "--", *TORCHRUN, *args,
                          "--step-sleep", "0.25"], workdir,
                         lambda: len(events(ckpt, "checkpoint")) >= 2)
    assert first.returncode == 75, first.stderr[-3000:]
    (written_by_two,) = {json.dumps(m["frozen_shards"]) for m in kept_manifests(ckpt)}

    three = [*TORCHRUN[:-1], "3"]
    second = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "2s", "--",
                  *three, *args, "--out", str(out)], cwd=workdir, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming epoch" in second.stderr and "with 3 ranks from a checkpoint of 2" in \
        second.stderr, second.stderr[-3000:]
    kept = kept_manifests(ckpt)
    assert kept and all(json.dumps(m["frozen_shards"]) == written_by_two for m in kept)
    # Written by 3 ranks, each only its own files: none of the set's chunks again.
    assert all(m["world_size"] == 3 and m["written"] == sum(
        f["bytes"] for f in m["files"].values()) for m in kept), kept
    import torch

    ended, reference = (torch.load(p, weights_only=True) for p in (out, expected))
    frozen = [k for k in reference if ".base." in k]
    assert len(frozen) == 8 and all(torch.equal(ended[k], reference[k]) for k in frozen)
    trained = [k for k in reference if ".up." in k]
    assert any(not torch.equal(ended[k], torch.zeros_like(ended[k])) for k in trained)


def test_a_frozen_chunk_replaced_by_a_link_to_its_copy_leaves_the_checkpoints_usable(
        workdir: Path):
    """Someone moves the frozen base's chunks elsewhere and links them back (a quota, a
    dedup tool). procckpt reads nothing through a link in its dir, yet the bytes are the
    chunk's: the link is replaced by a copy of them and the run resumes from its newest
    checkpoint, where it set both checkpoints aside and began again."""
    args = [str(SCRIPT), "--epochs", "4"]
    expected = workdir / "reference.pt"
    ref = run([PYTHON, *args, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    first = stopped_once(["--dir", str(ckpt), "--interval", "2s", "--", PYTHON, *args,
                          "--step-sleep", "0.12"], workdir,
                         lambda: len(events(ckpt, "checkpoint")) >= 2)
    assert first.returncode == 75, first.stderr[-3000:]
    kept = kept_manifests(ckpt)
    assert len(kept) == 2
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*[0-9]"))[-1].name
    shared = set(kept[0]["chunks"]) & set(kept[1]["chunks"])
    assert shared
    moved = workdir / "moved"
    moved.mkdir()
    links = {}
    for path in (ckpt / "chunks").glob("*/*/*"):
        if f"{path.parent.parent.name}:{path.name}" in shared:
            copy = moved / path.name
            path.rename(copy)
            path.symlink_to(copy)
            links[path] = copy

    second = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "2s", "--",
                  PYTHON, *args, "--out", str(out)], cwd=workdir, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "was a link to" in second.stderr and "unusable" not in second.stderr, \
        second.stderr[-3000:]
    assert f"resumed from {newest}: " in second.stderr, second.stderr[-3000:]
    assert not list((ckpt / "checkpoints").glob("*.corrupt"))
    assert all(p.is_file() and not p.is_symlink() and p.read_bytes() == c.read_bytes()
               for p, c in links.items())
    assert_bit_identical(expected, out)
