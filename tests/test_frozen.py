"""Frozen weights written once (training/save/frozen.py) into the chunk store (store/chunks.py):
what each checkpoint writes, what it skips and when it must not, collection, damage, old dirs."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from procckpt import Checkpointer
from procckpt.errors import CheckpointCorruptError
from procckpt.store import CheckpointStore
from procckpt.store.chunks import ChunkDamaged, ChunkStore, digest_of
from procckpt.store.manifest import manifest_problem
from procckpt.training.save.frozen import PLACEHOLDER, FrozenChunks
from procckpt.training.state.payload import read_payload


def fine_tune() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two frozen 256 KiB layers and a small trained head (AdamW)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    base.requires_grad_(False)
    model = nn.Sequential(base, nn.Linear(256, 4))
    return model, torch.optim.AdamW(model[1].parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 256)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def manifests(root: Path) -> list[dict]:
    return [json.loads((p / "MANIFEST.json").read_text())
            for p in sorted((root / "checkpoints").glob("ckpt-*[0-9]"))]


def chunk_files(root: Path) -> set[str]:
    return {f"{algo.name}:{f.name}" for algo in (root / "chunks").iterdir() if algo.is_dir()
            for fan in algo.iterdir() for f in fan.iterdir()}


def test_frozen_weights_are_written_once_and_the_state_loads_back_whole(tmp_path, async_save):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=async_save, keep=3)
    for _ in range(3):
        train(model, opt)
        ck.save()
    ck.flush()
    ck.close()
    first, *later = manifests(tmp_path)
    frozen = 2 * 256 * 256 * 4
    assert first["written"] == first["bytes"] > frozen and first["format"] == 2
    for m in later:
        assert m["bytes"] == first["bytes"] and m["written"] == m["bytes"] - frozen
        assert m["chunks"] == first["chunks"] and len(m["chunks"]) == 2
    raw = torch.load(tmp_path / "checkpoints" / "ckpt-00000003" / "state.pt", weights_only=True)
    assert raw["statefuls"]["model"]["0.0.weight"][PLACEHOLDER] in first["chunks"]

    fresh, fresh_opt = fine_tune()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    again = Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt)
    assert again.step == ck.step
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    again.close()


def test_a_frozen_tensor_changed_in_place_is_never_skipped(tmp_path, async_save):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=async_save, keep=5)
    weight = model[0][0].weight
    for i in range(4):
        train(model, opt)
        with torch.no_grad():
            if i == 1:
                weight.add_(1.0)  # in place under no_grad
            if i == 2:
                weight[3].mul_(2.0)  # through a view
            if i == 3:
                model[0][0].load_state_dict({"weight": weight + 1, "bias": model[0][0].bias})
        ck.save()
        ck.flush()
        newest = CheckpointStore(tmp_path).newest_intact()
        stored = read_payload(newest)["statefuls"]["model"]["0.0.weight"]
        assert torch.equal(stored, weight), f"checkpoint {i} holds a stale frozen weight"
    ck.close()


def test_a_write_the_version_counter_cannot_see_is_caught_by_the_periodic_hash(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(FrozenChunks, "verify_every", 3)
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=False, keep=10)
    weight = model[0][0].weight

    def stored() -> torch.Tensor:
        newest = CheckpointStore(tmp_path).newest_intact()
        return read_payload(newest)["statefuls"]["model"]["0.0.weight"]

    ck.save()  # 1: hashed (first of this process)
    weight.data.add_(1.0)  # .data: a new version counter, the parameter's does not move
    ck.save()  # 2: taken as unchanged (the documented blind spot)
    assert not torch.equal(stored(), weight)
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        ck.save()  # 3: the periodic hash finds it
    assert torch.equal(stored(), weight)
    assert "changed without its version counter moving" in caplog.text
    weight.data.add_(1.0)
    ck.save()  # 4: from now on this weight is hashed every time
    assert torch.equal(stored(), weight)
    ck.close()


def test_collection_removes_chunks_no_kept_checkpoint_lists(tmp_path, async_save):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=async_save, keep=2)
    ck.save()
    ck.flush()
    before = chunk_files(tmp_path)
    with torch.no_grad():
        model[0][0].weight.add_(1.0)
    for _ in range(3):
        ck.save()
    ck.flush()
    ck.close()
    kept = set().union(*(m["chunks"] for m in manifests(tmp_path)))
    assert len(manifests(tmp_path)) == 2
    assert chunk_files(tmp_path) == kept and len(kept) == 2
    assert len(before - kept) == 1  # the weight as it was before the change: gone


def test_a_damaged_chunk_falls_back_and_is_never_shared_again(tmp_path):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=False, keep=3)
    ck.save()
    with torch.no_grad():
        model[0][0].weight.add_(1.0)
    ck.save()
    ck.close()
    older, newer = manifests(tmp_path)
    (only_newer,) = set(newer["chunks"]) - set(older["chunks"])
    path = ChunkStore(tmp_path / "chunks").path(only_newer)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))

    fresh, fresh_opt = fine_tune()
    again = Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt, async_save=False)
    assert again.resumed_from is not None and again.resumed_from.name == "ckpt-00000001"
    assert (tmp_path / "checkpoints" / "ckpt-00000002.corrupt").is_dir()
    assert not path.exists()  # aside: a later checkpoint rewrites it instead of listing it
    with torch.no_grad():
        fresh[0][0].weight.add_(1.0)
    again.save()
    again.close()
    assert CheckpointStore(tmp_path).verify(tmp_path / "checkpoints" / "ckpt-00000003") is None


def test_when_every_checkpoint_shares_a_damaged_chunk_the_run_stops(tmp_path):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=False)
    ck.save()
    ck.save()
    ck.close()
    store = ChunkStore(tmp_path / "chunks")
    chunk_id = next(iter(manifests(tmp_path)[0]["chunks"]))
    store.path(chunk_id).write_bytes(b"\0" * store.path(chunk_id).stat().st_size)
    with pytest.raises(CheckpointCorruptError, match="refusing to start from scratch"):
        Checkpointer(tmp_path, model=fine_tune()[0], async_save=False)


def test_switched_off_every_checkpoint_holds_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("PROCCKPT_FROZEN_ONCE", "0")
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=False)
    ck.save()
    ck.save()
    ck.close()
    assert all(m["format"] == 1 and "chunks" not in m for m in manifests(tmp_path))
    assert not (tmp_path / "chunks").exists()


def test_a_dir_of_checkpoints_without_chunks_resumes_and_goes_on_with_them(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("PROCCKPT_FROZEN_ONCE", "0")
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, model=model, optimizer=opt, async_save=False, keep=5)
    train(model, opt)
    ck.save()
    ck.close()
    monkeypatch.delenv("PROCCKPT_FROZEN_ONCE")
    fresh, fresh_opt = fine_tune()
    again = Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt, async_save=False, keep=5)
    assert again.resumed_from is not None
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    again.save()
    again.close()
    assert [m["format"] for m in manifests(tmp_path)] == [1, 2]


# -- the chunk store itself ------------------------------------------------------------------
def test_a_chunk_is_written_once_and_checked_when_read(tmp_path):
    store = ChunkStore(tmp_path / "chunks")
    data = memoryview(os.urandom(1 << 20))
    chunk_id, written = store.put(data)
    assert written and chunk_id == digest_of(data)
    assert store.put(data) == (chunk_id, False)
    out = bytearray(len(data))
    store.read_into(chunk_id, memoryview(out))
    assert bytes(out) == bytes(data)
    with pytest.raises(ChunkDamaged, match="wrong size|has 1048576 bytes"):
        store.read_into(chunk_id, memoryview(bytearray(len(data) - 1)))
    (tmp_path / "chunks" / ".tmp-left-by-a-crash").write_bytes(b"x")
    assert store.collect(set()) == (1, len(data))
    assert not list((tmp_path / "chunks").glob(".tmp-*"))
    with pytest.raises(ChunkDamaged, match="missing"):
        store.read_into(chunk_id, memoryview(out))


@pytest.mark.parametrize("chunks, problem", [
    ({"md5:abc": 3}, "not named"),
    ({"blake3:" + "0" * 63: 3}, "not named"),
    ({"blake3:" + "0" * 64: -1}, "whole-number size"),
    ([], "not an object"),
])
def test_a_manifest_with_bad_chunks_is_refused(chunks, problem):
    manifest = {"files": {"state.pt": {"bytes": 1, "crc32": 1}}, "chunks": chunks}
    assert problem in (manifest_problem(manifest) or "")


def test_a_chunk_that_is_not_there_as_itself_says_what_it_is_instead(tmp_path):
    """A chunk replaced by a link: nothing is read through it; a link to the chunk's own
    bytes is replaced by a copy of them (its checkpoints stay usable), one to other bytes or
    to a pipe is named as a link (it read 'missing or has the wrong size')."""
    store = ChunkStore(tmp_path / "chunks")
    data = memoryview(os.urandom(1 << 16))
    chunk_id, _ = store.put(data)
    path = store.path(chunk_id)
    copy, other, pipe = tmp_path / "copy", tmp_path / "other", tmp_path / "pipe"
    copy.write_bytes(bytes(data))
    other.write_bytes(os.urandom(len(data)))
    os.mkfifo(pipe)
    assert store.problem({chunk_id: len(data)}, hash_them=False) is None
    assert store.problem({chunk_id: len(data) + 1}, hash_them=False) == \
        f"chunk {chunk_id} has {len(data)} bytes, the manifest says {len(data) + 1}"
    for target in (other, pipe):
        path.unlink()
        path.symlink_to(target)
        problem = store.problem({chunk_id: len(data)}, hash_them=False) or ""
        assert problem.startswith(f"chunk {chunk_id} is a link ({path} -> {target}) to "
                                  "other bytes than the chunk's"), problem
        assert path.is_symlink() and not list(store.root.glob(".tmp-*"))
    path.unlink()
    path.symlink_to(copy)
    assert store.problem({chunk_id: len(data)}, hash_them=True) is None
    assert not path.is_symlink() and path.read_bytes() == bytes(data) and copy.exists()
    path.unlink()
    assert store.problem({chunk_id: len(data)}, hash_them=False) == f"chunk {chunk_id} is missing"
