"""The memory tier's two halves on real files: the training's writer (its cadence, its room
check) and the launcher's copy of the newest complete slot into the store."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch

from procckpt.launcher.tier import LauncherTier, memory_tier
from procckpt.protocol.events import read_events
from procckpt.protocol.leftovers import sweep_dead
from procckpt.store import CheckpointStore
from procckpt.training.save.tier import TierWriter, tier_room
from procckpt.training.save.writer import write_checkpoint

from .conftest import mounted_tmpfs


def _slot(tier: Path, step: int) -> None:
    store = CheckpointStore(tier, keep=2).open()
    write_checkpoint(store, {"step": step, "epoch": 0, "batch": step, "reason": "memory"},
                     {"w": torch.full((1000,), float(step))})


def test_the_newest_complete_slot_is_kept_once_and_only_when_newer(tmp_path: Path):
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    assert tier.keep_newest(store, 1) is None  # nothing written yet
    _slot(tier.path, 5)
    _slot(tier.path, 7)
    # A slot torn by the kill: written, never committed.
    (tier.path / "checkpoints" / ".tmp-ckpt-00000003-1-abc").mkdir()
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 7 and kept.manifest["reason"] == "memory"
    loaded = torch.load(kept.path / "state.pt", weights_only=True)
    assert torch.equal(loaded["w"], torch.full((1000,), 7.0))
    assert store.verify(kept.path) is None
    assert tier.keep_newest(store, 2) is None  # the store holds step 7 already
    (event,) = [e for e in read_events(store.events_path) if e["event"] == "tier-kept"]
    assert event["step"] == 7 and event["cycle"] == 1 and event["saved_at"] > 0


def test_a_damaged_newest_slot_is_passed_over_for_the_one_before(tmp_path: Path):
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    _slot(tier.path, 5)
    _slot(tier.path, 7)
    newest = tier.store.checkpoints()[0]
    with open(newest.path / "state.pt", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 8)
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 5


def test_the_tier_is_said_off_where_it_has_no_room(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "small", "64k") as small:
        (small / "tier").mkdir()
        why = tier_room(small / "tier", 40_000)
    assert why is not None and why.startswith("its 3 slots of 40.0 KB need 120.0 KB in "), why
    assert why.endswith(f"{small}, which has 65.5 KB free"), why
    assert tier_room(tmp_path, 1000) is None  # (this disk has room for 3 kB)


def test_a_slot_is_written_every_k_safe_points_as_its_copy_allows(tmp_path: Path,
                                                                  monkeypatch):
    monkeypatch.setenv("PROCCKPT_MEMORY_TIER_DIR", str(tmp_path / "tier"))
    journal = tmp_path / "events.jsonl"
    writer = TierWriter.from_environment(journal)
    assert writer is not None
    state = {"w": torch.randn(4 << 20)}  # 16 MB: a copy of milliseconds
    step = 0

    def safe_point(now: float) -> None:
        writer.at_safe_point(now, True, lambda: {"step": step, "epoch": 0, "batch": step},
                             lambda: state, lambda: None)

    for step in range(1, 30):
        safe_point(step * 0.01)  # steps of 10 ms: 1 % is 0.1 ms, less than any copy
        writer.close()
    assert writer.every > 1
    planned = [e for e in read_events(journal) if e["event"] == "memory-tier"]
    assert planned and planned[0]["every"] > 1 and planned[0]["bytes"] >= 16 << 20
    slots = writer.store.checkpoints()
    assert 1 <= len(slots) <= 2 and slots[0].step < 30


def test_a_slot_is_written_after_the_step_began_by_a_thread_that_yields_its_core(
        tmp_path: Path, monkeypatch):
    """The compute that follows a safe point keeps the cores: the slot's write waits a third
    of a step (at most 0.1 s) after the copy, and its thread runs under SCHED_IDLE."""
    monkeypatch.setenv("PROCCKPT_MEMORY_TIER_DIR", str(tmp_path / "tier"))
    writer = TierWriter.from_environment(None)
    assert writer is not None
    state = {"w": torch.randn(1 << 16)}
    for step in (1, 2):  # steps of 0.6 s (a slot is due at the second safe point)
        writer.at_safe_point(step * 0.6, True, lambda: {"step": 2, "epoch": 0, "batch": 2},
                             lambda: state, lambda: None)
    copied = time.time()
    thread = writer._thread
    assert thread is not None
    policies = set()
    while thread.is_alive() and os.SCHED_IDLE not in policies:
        with contextlib.suppress(OSError):  # (gone in between)
            policies.add(os.sched_getscheduler(thread.native_id))
    writer.close()
    assert os.SCHED_IDLE in policies
    (slot,) = writer.store.checkpoints()
    assert slot.step == 2 and slot.created - copied >= 0.09, slot.created - copied


def _rank_slot(tier: Path, rank: int, step: int) -> None:
    store = CheckpointStore(tier / f"rank-{rank:05d}", keep=2).open()
    meta = {"step": step, "epoch": 0, "batch": step, "reason": "memory", "world_size": 2,
            "sharded": []}
    if rank == 0:
        write_checkpoint(store, meta, {"w": torch.full((1000,), float(step))})
    else:
        write_checkpoint(store, meta, {"format": 1, "rank": rank, "step": step},
                         name=f"rank-{rank:05d}.pt")


def test_a_group_keeps_the_newest_step_every_rank_holds_intact(tmp_path: Path):
    """Rank 0 wrote step 7, rank 1 was killed in the middle of its slot of step 7: the
    group's checkpoint is step 5, rank 0's state beside rank 1's file."""
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    for step in (3, 5, 7):
        _rank_slot(tier.path, 0, step)
    for step in (3, 5):
        _rank_slot(tier.path, 1, step)
    (tier.path / "rank-00001" / "checkpoints" / ".tmp-ckpt-00000003-1-abc").mkdir()
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 5 and kept.manifest["world_size"] == 2
    assert sorted(kept.manifest["files"]) == ["rank-00001.pt", "state.pt"]
    assert torch.equal(torch.load(kept.path / "state.pt", weights_only=True)["w"],
                       torch.full((1000,), 5.0))
    assert torch.load(kept.path / "rank-00001.pt", weights_only=True)["step"] == 5
    assert store.verify(kept.path) is None
    _rank_slot(tier.path, 1, 7)  # now both hold step 7
    kept = tier.keep_newest(store, 2)
    assert kept is not None and kept.step == 7


def test_a_group_without_a_rank_s_slots_keeps_nothing(tmp_path: Path):
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    _rank_slot(tier.path, 0, 5)
    assert tier.keep_newest(store, 1) is None
    assert store.checkpoints() == []


class _Member:
    """The Checkpointer as the group's tier sees it: its step and its state."""

    step = 4

    def replicated_payload(self, exclude: set[str]) -> dict:
        return {"w": torch.zeros(10)}

    def rank_payload(self) -> dict:
        return {"rng": torch.zeros(2)}


def test_ranks_write_slots_only_where_the_group_agreed(tmp_path: Path, monkeypatch):
    from procckpt.training.group.tier import GroupTier
    from procckpt.training.link.flags import Flags

    monkeypatch.setenv("PROCCKPT_MEMORY_TIER_DIR", str(tmp_path))
    zero = GroupTier.from_environment(None, 0, 2, sharded=False)
    one = GroupTier.from_environment(None, 1, 2, sharded=False)
    assert zero is not None and one is not None
    meta = lambda: {"step": 4, "epoch": 0, "batch": 4}  # noqa: E731
    for tier in (zero, one):
        tier.at_safe_point(0.0, None, True, _Member(), meta, lambda: None)
        tier.at_safe_point(0.1, None, True, _Member(), meta, lambda: None)
    flags = [Flags(), Flags()]
    zero.mark(flags[0])
    one.mark(flags[1])
    assert flags[0].tier_due and not flags[1].tier_due  # rank 0's cadence decides
    # A rank still writing its last slot: nobody writes one.
    busy = Flags(tier_due=True, tier_busy=True)
    for tier in (zero, one):
        tier.at_safe_point(0.2, busy, True, _Member(), meta, lambda: None)
        tier.close()
    assert not any((tmp_path / r).exists() and list((tmp_path / r / "checkpoints").iterdir())
                   for r in ("rank-00000", "rank-00001"))
    for tier in (zero, one):
        tier.at_safe_point(0.3, Flags(tier_due=True), True, _Member(), meta, lambda: None)
        tier.close()
    kept = LauncherTier(tmp_path).keep_newest(CheckpointStore(tmp_path / "ckpt").open(), 1)
    assert kept is not None and kept.step == 4
    assert sorted(kept.manifest["files"]) == ["rank-00001.pt", "state.pt"]
    # A rank whose tier is off turns every rank's off.
    one.writer.turn_off("no room")
    flags = [Flags(), Flags()]
    zero.mark(flags[0])
    one.mark(flags[1])
    assert flags[1].tier_off
    zero.at_safe_point(0.4, Flags(tier_off=True), True, _Member(), meta, lambda: None)
    assert zero.writer.off is not None
    assert GroupTier.from_environment(None, 0, 2, sharded=True) is None


def test_tiers_left_by_dead_launchers_are_swept_and_live_ones_kept(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "shm", "1m") as shm:
        os.environ["PROCCKPT_MEMORY_TIER_ROOT"] = str(shm)
        try:
            with memory_tier(True, "hooks") as tier:
                assert tier is not None and tier.path.parent == shm
                boot = tier.path.name.split("-")[2]
                dead = shm / f"procckpt-tier-{boot}-999999999-deadbeef"
                dead.mkdir()
                assert sweep_dead(shm, "procckpt-tier-") == [dead]
                assert not dead.exists() and tier.path.exists()
            assert not tier.path.exists()
            with memory_tier(True, "dmtcp") as none:
                assert none is None
        finally:
            del os.environ["PROCCKPT_MEMORY_TIER_ROOT"]


def test_a_tier_root_on_a_disk_is_refused(tmp_path: Path, monkeypatch,
                                          caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("PROCCKPT_MEMORY_TIER_ROOT", str(tmp_path))
    with memory_tier(True, "hooks") as tier:
        on_memory = tier is not None
    if on_memory:
        pytest.skip(f"{tmp_path} is on a memory file system here")
    assert "is not a memory file system (tmpfs)" in caplog.text
