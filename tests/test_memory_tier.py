"""The memory tier's two halves on real files: the training's writer (its slots, its cadence,
its room check) and the launcher's checkpoint of the newest complete slot."""

from __future__ import annotations

import math
import os
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch

from procckpt.launcher.tier import LauncherTier, memory_tier
from procckpt.protocol.events import read_events
from procckpt.protocol.leftovers import sweep_dead
from procckpt.protocol.slots import slots_newest_first
from procckpt.store import CheckpointStore
from procckpt.training.save.tier import COPY_BUDGET, TierWriter, tier_room

from .conftest import mounted_tmpfs


def _writer(tier: Path, name: str = "state.pt") -> TierWriter:
    writer = TierWriter.opened(tier, None, name)
    assert writer.off is None, writer.off
    return writer


def _slot(writer: TierWriter, step: int, payload: dict | None = None, **meta: object) -> None:
    writer.write_slot(lambda: {"step": step, "epoch": 0, "batch": step, "reason": "memory",
                               **meta},
                      lambda: payload or {"w": torch.full((1000,), float(step)),
                                          "n": {"step": step, "name": "x" * step}},
                      lambda _: None)
    writer.close()
    assert writer.off is None, writer.off


def test_the_newest_complete_slot_is_kept_once_and_only_when_newer(tmp_path: Path):
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    assert tier.keep_newest(store, 1) is None  # nothing written yet
    writer = _writer(tier.path)
    for step in (5, 7, 9):
        _slot(writer, step)
    (tier.path / "slot-0.json").unlink()  # step 9's: as a kill in the middle of its copy
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 7 and kept.manifest["reason"] == "memory"
    for mmap in (False, True):
        loaded = torch.load(kept.path / "state.pt", weights_only=True, mmap=mmap)
        assert torch.equal(loaded["w"], torch.full((1000,), 7.0))
        assert loaded["n"] == {"step": 7, "name": "x" * 7}
    assert store.verify(kept.path) is None
    with zipfile.ZipFile(kept.path / "state.pt") as kept_zip, \
            open(kept.path / "state.pt", "rb") as raw:
        for info in kept_zip.infolist():  # every record where torch's own files have it
            raw.seek(info.header_offset + 26)
            name, extra = struct.unpack("<HH", raw.read(4))
            assert (info.header_offset + 30 + name + extra) % 64 == 0, info
    assert tier.keep_newest(store, 2) is None  # the store holds step 7 already
    (event,) = [e for e in read_events(store.events_path) if e["event"] == "tier-kept"]
    assert event["step"] == 7 and event["cycle"] == 1 and event["saved_at"] > 0


def test_a_slot_whose_data_is_short_of_its_records_is_passed_over(tmp_path: Path):
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    writer = _writer(tier.path)
    _slot(writer, 5)
    _slot(writer, 7)
    os.truncate(tier.path / "slot-1.data", 100)
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 5


def test_a_kept_slot_is_the_file_torch_save_writes(tmp_path: Path):
    """The checkpoint the launcher makes of a slot holds the records ``torch.save`` writes of
    the state, byte for byte: views, a tensor held twice, an empty one, other dtypes."""
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    writer = _writer(tier.path)
    torch.manual_seed(0)
    state = {"model": {"a": torch.randn(300, 7), "b": torch.randn(3).double()},
             "optimizer": {"state": {0: {"step": torch.tensor(4.0),
                                         "m": torch.randn(300, 7)[:, :3]}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "tied": None, "empty": torch.zeros(0), "rng": torch.get_rng_state()}
    state["tied"] = state["model"]["a"]  # one tensor twice: one record
    _slot(writer, 4, state)
    assert (tier.path / "slot-0.json").is_file()
    kept = tier.keep_newest(store, 1)
    assert kept is not None
    loaded = torch.load(kept.path / "state.pt", weights_only=True)
    expected = tmp_path / "expected.pt"
    m = state["optimizer"]["state"][0]["m"]
    state["optimizer"]["state"][0]["m"] = m.contiguous()  # (as a checkpoint saves a view)
    torch.save(state, expected)
    with zipfile.ZipFile(expected) as a, zipfile.ZipFile(kept.path / "state.pt") as b:
        names = lambda z: [i.filename.split("/", 1)[1] for i in z.infolist()]  # noqa: E731
        assert names(a) == names(b)
        for record in names(a):
            if record != ".data/serialization_id":
                assert a.read(f"expected/{record}") == b.read(f"archive/{record}"), record
    assert loaded["tied"] is loaded["model"]["a"] or \
        loaded["tied"].data_ptr() == loaded["model"]["a"].data_ptr()


def test_a_slot_is_completed_after_the_step_began_and_torn_until_then(tmp_path: Path):
    """The copy is the safe point's pause; the slot's pickle and manifest follow on a thread a
    third of a step later (at most 0.1 s), once the compute after the safe point had the GIL.
    Until then the slot has no manifest: a kill there finds the slot before it."""
    writer = _writer(tmp_path / "tier")
    state = {"w": torch.randn(1 << 16)}
    for step in (1, 2):  # steps of 0.6 s (a slot is due at the second safe point)
        writer.at_safe_point(step * 0.6, True, lambda: {"step": 2, "epoch": 0, "batch": 2},
                             lambda: state, lambda _: None)
    copied = time.monotonic()
    assert writer.busy() and slots_newest_first(tmp_path / "tier") == []
    writer.close()
    assert time.monotonic() - copied >= 0.09
    ((_, slot),) = slots_newest_first(tmp_path / "tier")
    assert slot["step"] == 2 and slot["name"] == "state.pt" and slot["bytes"] == 1 << 18


def test_a_slot_of_empty_tensors_only_is_kept(tmp_path: Path):
    """No tensor bytes, so no data file: the slot is complete and kept all the same."""
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    _slot(_writer(tier.path), 3, {"empty": torch.zeros(0), "n": 3})
    assert not (tier.path / "slot-0.data").exists()
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 3
    loaded = torch.load(kept.path / "state.pt", weights_only=True)
    assert loaded["n"] == 3 and loaded["empty"].shape == (0,)


def test_the_tier_is_said_off_where_it_has_no_room(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "small", "64k") as small:
        (small / "tier").mkdir()
        why = tier_room(small / "tier", 40_000)
    assert why is not None and why.startswith("its 2 slots of 40.0 KB need 80.0 KB in "), why
    assert why.endswith(f"{small}, which has 65.5 KB free"), why
    assert tier_room(tmp_path, 1000) is None  # (this disk has room for 2 kB)


def test_a_memory_file_system_filled_after_the_check_turns_the_tier_off(tmp_path: Path):
    """The room was there at the check; something else took it before the second slot's
    file was made: the tier goes off in a line, the training goes on (no SIGBUS)."""
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        writer = _writer(small / "tier")
        state = {"w": torch.zeros(60_000)}  # 240 kB a slot
        writer.write_slot(lambda: {"step": 1}, lambda: state, lambda _: None)
        writer.close()
        assert writer.off is None and writer.slots == 1
        (small / "filler").write_bytes(bytes(700_000))
        writer.write_slot(lambda: {"step": 2}, lambda: state, lambda _: None)
        writer.close()
        assert writer.off is not None and "is the memory file system full?" in writer.off
        assert not list((small / "tier").iterdir())  # its slots given back


def test_a_slot_is_written_every_k_safe_points_as_its_copy_allows(tmp_path: Path,
                                                                  monkeypatch):
    monkeypatch.setenv("PROCCKPT_MEMORY_TIER_DIR", str(tmp_path / "tier"))
    (tmp_path / "tier").mkdir()
    journal = tmp_path / "events.jsonl"
    writer = TierWriter.from_environment(journal)
    assert writer is not None
    state = {"w": torch.randn(4 << 20)}  # 16 MB: a copy of milliseconds
    step = 0

    def safe_point(now: float) -> None:
        writer.at_safe_point(now, True, lambda: {"step": step, "epoch": 0, "batch": step},
                             lambda: state, lambda _: None)

    for step in range(1, 30):
        safe_point(step * 0.01)  # steps of 10 ms: 1 % is 0.1 ms, less than any copy
        writer.close()
    assert writer.every > 1
    planned = [e for e in read_events(journal) if e["event"] == "memory-tier"]
    assert planned and planned[0]["every"] > 1 and planned[0]["bytes"] >= 16 << 20
    slots = slots_newest_first(tmp_path / "tier")
    assert 1 <= len(slots) <= 2 and slots[0][1]["step"] < 30


def _rank_slot(writer: TierWriter, rank: int, step: int) -> None:
    _slot(writer, step, None if rank == 0 else {"format": 1, "rank": rank, "step": step},
          world_size=2, sharded=[])


def test_a_group_keeps_the_newest_step_every_rank_holds_intact(tmp_path: Path):
    """Rank 0 wrote step 7, rank 1 was killed in the middle of its slot of step 7: the
    group's checkpoint is step 5, rank 0's state beside rank 1's file."""
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    tier.path.mkdir()
    zero = _writer(tier.path / "rank-00000")
    one = _writer(tier.path / "rank-00001", "rank-00001.pt")
    for step in (5, 7):
        _rank_slot(zero, 0, step)
    for step in (3, 5, 7):
        _rank_slot(one, 1, step)
    (tier.path / "rank-00001" / "slot-0.json").unlink()  # step 7's, torn
    kept = tier.keep_newest(store, 1)
    assert kept is not None and kept.step == 5 and kept.manifest["world_size"] == 2
    assert sorted(kept.manifest["files"]) == ["rank-00001.pt", "state.pt"]
    assert torch.equal(torch.load(kept.path / "state.pt", weights_only=True)["w"],
                       torch.full((1000,), 5.0))
    assert torch.load(kept.path / "rank-00001.pt", weights_only=True)["step"] == 5
    assert store.verify(kept.path) is None
    _rank_slot(one, 1, 7)  # now both hold step 7
    kept = tier.keep_newest(store, 2)
    assert kept is not None and kept.step == 7


def test_a_group_without_a_rank_s_slots_keeps_nothing(tmp_path: Path):
    tier, store = LauncherTier(tmp_path / "tier"), CheckpointStore(tmp_path / "ckpt").open()
    tier.path.mkdir()
    _rank_slot(_writer(tier.path / "rank-00000"), 0, 5)
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
        tier.at_safe_point(0.0, None, True, _Member(), meta, lambda _: None)
        tier.at_safe_point(0.1, None, True, _Member(), meta, lambda _: None)
    flags = [Flags(), Flags()]
    zero.mark(flags[0])
    one.mark(flags[1])
    assert flags[0].tier_due and not flags[1].tier_due  # rank 0's cadence decides
    # A rank still writing its last slot: nobody writes one.
    busy = Flags(tier_due=True, tier_busy=True)
    for tier in (zero, one):
        tier.at_safe_point(0.2, busy, True, _Member(), meta, lambda _: None)
        tier.close()
    assert not any(slots_newest_first(tmp_path / r) for r in ("rank-00000", "rank-00001"))
    for tier in (zero, one):
        tier.at_safe_point(0.3, Flags(tier_due=True), True, _Member(), meta, lambda _: None)
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
    zero.at_safe_point(0.4, Flags(tier_off=True), True, _Member(), meta, lambda _: None)
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


def test_copies_slowed_with_the_steps_do_not_space_the_slots_after(tmp_path: Path):
    """A spare importing torch beside the training slows its steps (100 ms) more than the
    copies (14 ms); once the steps are quick again (25 ms, copies of 7.5 ms), the slots come
    as often as those quick copies allow, not spaced by the slow copies still remembered."""
    writer = _writer(tmp_path / "tier")
    clock = [0.0]
    writer._clock = lambda: clock[0]  # a slot's pause: what the copy adds to it (below)
    now, written = 0.0, []
    for step, (gap, copy) in enumerate([(0.1, 0.014)] * 200 + [(0.025, 0.0075)] * 60):
        now += gap
        before = writer.slots
        writer.at_safe_point(now, True, lambda: {"step": step, "epoch": 0, "batch": step},
                             lambda: {"w": torch.zeros(1000)},
                             lambda _: clock.__setitem__(0, clock[0] + copy))  # noqa: B023
        writer.close()
        if writer.slots > before and gap < 0.1:
            written.append(step)
    quick = math.ceil(0.0075 / 0.025 / COPY_BUDGET)  # what the quick copies allow: 38
    assert writer.every <= quick
    # Two slots of the quick steps suffice (planned on pauses and steps apart: the median
    # pause was a slow copy's for three slots, every 63 steps).
    assert len(written) >= 2 and written[1] - written[0] <= quick, written
