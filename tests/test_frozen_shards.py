"""Frozen sharded parameters written once (training/sharded/frozen.py): the frozen
part of FSDP2 state saved as a DCP set of its own whose files are chunks. What each checkpoint
writes, what it lists and when it must not, loading the set back, collection, damage.

In a process group of one (gloo, in this process): the same code path as every rank of a
larger group; tests/e2e/test_frozen_base.py runs it under torchrun with two and three ranks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from procckpt import Checkpointer, Sharded
from procckpt.errors import CheckpointCorruptError
from procckpt.store import CheckpointStore
from procckpt.training.sharded.frozen import FrozenShards, load_sharded_state

from .test_frozen import manifests

FROZEN_BYTES = 2 * (256 * 256 + 256) * 4  # two frozen Linear(256, 256)


def fine_tune(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two frozen layers and a trained head (AdamW), sharded with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 4))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                    lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 256)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def newest_loaded(root: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's sharded state, loaded into a fresh model of other weights."""
    fresh, fresh_opt = fine_tune(seed=1)
    info = CheckpointStore(root).newest_intact()
    assert info is not None
    load_sharded_state({"train": Sharded(fresh, fresh_opt)}, info, use_group=True)
    return full(fresh)


def test_frozen_shards_are_written_once_and_load_back_whole(group_of_one, tmp_path,
                                                           async_save):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, train=Sharded(model, opt), async_save=async_save, keep=3,
                      save_every=0)
    for _ in range(3):
        train(model, opt)
        ck.save()
    ck.flush()
    first, *later = manifests(tmp_path)
    assert set(first["frozen_shards"]) == {".metadata", "__0_0.distcp"}
    assert first["written"] == first["bytes"] > FROZEN_BYTES
    for m in later:  # the same set listed, none of it written again
        assert m["frozen_shards"] == first["frozen_shards"]
        assert m["written"] < m["bytes"] - FROZEN_BYTES, m
    # The checkpoint's own DCP files hold the trained layer and AdamW's state only.
    own = sum(f["bytes"] for n, f in later[-1]["files"].items() if n.endswith(".distcp"))
    assert own < FROZEN_BYTES / 10
    loaded, now = newest_loaded(tmp_path), full(model)
    assert loaded.keys() == now.keys()
    assert all(torch.equal(loaded[k], now[k]) for k in now)
    ck.close()


def test_a_frozen_shard_changed_in_place_is_never_skipped(group_of_one, tmp_path, async_save):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, train=Sharded(model, opt), async_save=async_save, keep=5,
                      save_every=0)
    weight = model[0].weight
    for i in range(4):
        train(model, opt)
        with torch.no_grad():
            if i == 1:
                weight.add_(1.0)  # in place under no_grad
            if i == 2:
                weight.mul_(torch.full_like(weight, 2.0))  # another in-place op
            if i == 3:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict
                changed = {k: v + 1 if k == "0.weight" else v
                           for k, v in model.state_dict().items()}
                set_model_state_dict(model, changed)
        ck.save()
        ck.flush()
        loaded, now = newest_loaded(tmp_path), full(model)
        assert torch.equal(loaded["0.weight"], now["0.weight"]), \
            f"checkpoint {i} holds a stale frozen weight"
    sets = [m["frozen_shards"]["__0_0.distcp"] for m in manifests(tmp_path)]
    assert len(set(sets)) == 4  # the set was written again after each change
    ck.close()


def test_a_write_the_version_counter_cannot_see_is_caught_by_the_periodic_hash(
        group_of_one, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(FrozenShards, "verify_every", 3)
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, train=Sharded(model, opt), async_save=False, keep=10,
                      save_every=0)
    weight = model[0].weight

    def stored() -> torch.Tensor:
        return newest_loaded(tmp_path)["0.weight"]

    ck.save()  # 1: hashed (first of this process)
    weight.data.add_(1.0)  # .data: the parameter's version counter does not move
    ck.save()  # 2: taken as unchanged (the documented blind spot)
    assert not torch.equal(stored(), full(model)["0.weight"])
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        ck.save()  # 3: the periodic hash finds it
    assert torch.equal(stored(), full(model)["0.weight"])
    assert "changed without its version counter moving" in caplog.text
    weight.data.add_(1.0)
    ck.save()  # 4: from now on hashed every time
    assert torch.equal(stored(), full(model)["0.weight"])
    ck.close()


def test_a_resumed_process_lists_the_set_it_loaded_and_collection_keeps_it(group_of_one,
                                                                          tmp_path):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, train=Sharded(model, opt), async_save=False, keep=2,
                      save_every=0)
    for _ in range(2):
        train(model, opt)
        ck.save()
    ck.close()
    before = full(model)

    again, again_opt = fine_tune(seed=1)  # other weights: the checkpoint's replace them
    resumed = Checkpointer(tmp_path, train=Sharded(again, again_opt), async_save=False,
                           keep=2, save_every=0)
    assert all(torch.equal(before[k], v) for k, v in full(again).items())
    for _ in range(3):
        train(again, again_opt)
        resumed.save()
    resumed.close()
    kept = manifests(tmp_path)
    assert len(kept) == 2
    assert all(m["written"] < m["bytes"] - FROZEN_BYTES for m in kept), kept
    assert kept[0]["frozen_shards"] == kept[1]["frozen_shards"]
    # On disk: exactly the chunks the kept checkpoints list (the set, still).
    listed = set(kept[0]["chunks"]) | set(kept[1]["chunks"])
    stored = {f"blake3:{f.name}" for f in (tmp_path / "chunks" / "blake3").glob("*/*")}
    assert stored == listed == set(kept[0]["frozen_shards"].values())


def test_a_damaged_frozen_chunk_is_found_when_resuming(group_of_one, tmp_path):
    model, opt = fine_tune()
    ck = Checkpointer(tmp_path, train=Sharded(model, opt), async_save=False, save_every=0)
    ck.save()
    ck.close()
    (m,) = manifests(tmp_path)
    chunk = CheckpointStore(tmp_path).chunks.path(m["frozen_shards"]["__0_0.distcp"])
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    again, again_opt = fine_tune(seed=1)
    with pytest.raises(CheckpointCorruptError, match="can be loaded"):
        Checkpointer(tmp_path, train=Sharded(again, again_opt), save_every=0)
    assert list((tmp_path / "checkpoints").glob("ckpt-*.corrupt"))
