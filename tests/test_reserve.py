"""training/state/reserve.py: a spare's memory touched in advance, and a restore that copies
the optimizer's state into it (issue 55)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from procckpt.store import CheckpointStore
from procckpt.training.save.tier import TierWriter
from procckpt.training.save.writer import write_checkpoint
from procckpt.training.state import reserve
from procckpt.training.state.mapped import detach_from_file

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_region_left() -> Iterator[None]:
    yield
    reserve.release()


def _resident(start: int, end: int) -> int:
    """Resident bytes of this process's memory in [start, end), page-aligned (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (end - start) // 4096
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * 4096


def _stepped_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_a_restore_copies_the_optimizer_state_into_the_touched_region(tmp_path: Path):
    model, opt = _stepped_adam()
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "state.pt")
    moments = sum(t.numel() * t.element_size() for s in opt.state.values()
                  for t in s.values() if t.dim())
    assert reserve.prepare(1 << 20)
    start = _region_address()
    end = start + reserve.held()
    assert _resident(start, end) == end - start  # touched: every page is there already

    _, restored = _stepped_adam()
    payload = torch.load(tmp_path / "state.pt", mmap=True, weights_only=True)
    restored.load_state_dict(payload["optimizer"])
    assert detach_from_file(payload, [restored]).nbytes >= moments
    del payload
    os.unlink(tmp_path / "state.pt")

    for state, expected in zip(restored.state.values(), opt.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], expected[key])
            assert start <= state[key].data_ptr() < end, key
            assert state[key].data_ptr() % 64 == 0
    assert reserve.carved() >= moments and reserve.held() == 0
    # What the restore did not take goes back to the kernel (on a thread of its own); what
    # it took stays resident.
    taken = -(-moments * 2 // 4096) * 4096
    deadline = time.monotonic() + 10
    while _resident(start, end) > taken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident(start, end) <= taken
    restored.step()  # the moments train in place
    assert all(start <= s["exp_avg"].data_ptr() < end for s in restored.state.values())


def _region_address() -> int:
    view = reserve._view  # (the region's start, as only the module holds it)
    assert view is not None
    return torch.frombuffer(view[:8], dtype=torch.uint8).data_ptr()


def test_without_a_region_or_for_a_tensor_it_cannot_hold_the_restore_copies_as_before():
    assert reserve.take(torch.zeros(4)) is None  # no region
    assert reserve.prepare(8192)
    assert reserve.take(torch.zeros(4, 4).t()) is None  # not contiguous
    assert reserve.take(torch.zeros(4096)) is None  # 16 KiB: no room
    small = reserve.take(torch.zeros(3, dtype=torch.bfloat16))
    assert small is not None and small.shape == (3,) and small.dtype == torch.bfloat16
    assert reserve.held() == 8192 - 6


def test_a_spare_touches_its_region_once_the_tier_holds_a_slot(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(reserve, "LOOK_EVERY", 0.05)
    tier = tmp_path / "tier"
    read_end, write_end = os.pipe()
    waiter = threading.Thread(target=reserve.wait_readable, args=(read_end, str(tier)))
    try:
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and reserve.held() == 0  # no slot yet: nothing touched
        writer = TierWriter.opened(tier, None)
        writer.write_slot(lambda: {"step": 3, "epoch": 0, "batch": 3, "reason": "memory"},
                          lambda: {"w": torch.zeros(50_000)}, lambda _: None)
        writer.close()
        assert writer.slots == 1, writer.off
        waiter.join(2.0)
        assert waiter.is_alive()  # it waits for the restart still
        assert reserve.held() >= 200_000
        os.write(write_end, b"go")
        waiter.join(5.0)
        assert not waiter.is_alive()
    finally:
        os.close(write_end)
        waiter.join(5.0)
        os.close(read_end)


def test_no_region_where_the_cgroup_has_no_room_for_it(monkeypatch):
    monkeypatch.setattr(reserve, "memory_short",
                        lambda need: f"the cgroup has less than {need} bytes free")
    assert not reserve.prepare(1 << 20)
    assert reserve.held() == 0 and reserve.take(torch.zeros(4)) is None


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s[key] for s in opt.state.values() for key in ("exp_avg", "exp_avg_sq")]


def _saved_then_stepped_again(
        folder: Path) -> tuple[list[torch.Tensor], torch.nn.Module, torch.optim.Optimizer]:
    """A checkpoint of a stepped Adam in ``folder`` (its moments, as saved), and the same
    model and optimizer made anew and stepped twice: moments other than the saved ones, in
    memory of their own."""
    from procckpt import Checkpointer

    model, opt = _stepped_adam()
    ckpt = Checkpointer(folder, model=model, optimizer=opt, save_every=None)
    ckpt.save()
    ckpt.close()
    model2, opt2 = _stepped_adam()
    model2(torch.randn(4, 64)).sum().backward()
    opt2.step()
    return [t.clone() for t in _moments(opt)], model2, opt2


def test_a_restore_writes_over_the_moments_the_optimizer_had_before(tmp_path: Path):
    """An optimizer that stepped before its Checkpointer was made: the restore copies into
    the memory of the moments it replaces (touched already), not into the spare's region or
    new memory, and frees nothing."""
    from procckpt import Checkpointer

    saved, model2, opt2 = _saved_then_stepped_again(tmp_path / "ck")
    before = [t.data_ptr() for t in _moments(opt2)]
    carved = reserve.carved()
    assert reserve.prepare(1 << 20)
    resumed = Checkpointer(tmp_path / "ck", model=model2, optimizer=opt2, save_every=None)
    assert resumed.resumed_from is not None
    assert all(torch.equal(a, b) for a, b in zip(_moments(opt2), saved))
    assert [t.data_ptr() for t in _moments(opt2)] == before
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    assert resumed._restored()[2] >= nbytes and reserve.carved() == carved
    with open("/proc/self/maps") as f:
        assert not [line for line in f if "state.pt" in line]  # nothing left mapped
    resumed.close()


def test_a_moment_something_else_still_refers_to_is_left_as_it_was(tmp_path: Path):
    from procckpt import Checkpointer

    saved, model2, opt2 = _saved_then_stepped_again(tmp_path / "ck")
    named = _moments(opt2)[0]  # the script keeps a name for one...
    row = _moments(opt2)[3][0]  # ...and a view of another
    named_was, row_was = named.clone(), row.clone()
    Checkpointer(tmp_path / "ck", model=model2, optimizer=opt2, save_every=None).close()
    assert torch.equal(named, named_was) and torch.equal(row, row_was)
    assert all(torch.equal(a, b) for a, b in zip(_moments(opt2), saved))
    assert _moments(opt2)[0].data_ptr() != named.data_ptr()


def test_the_fingerprints_taken_as_the_restore_copies_are_those_of_the_restored_state(
        tmp_path: Path, monkeypatch):
    from procckpt.training.state import first_step
    from procckpt.training.state.first_step import restored_state
    from procckpt.training.state.payload import load_statefuls

    model, opt = _stepped_adam()
    store = CheckpointStore(tmp_path / "ck", keep=1).open()
    info = write_checkpoint(store, {"step": 1}, {"format": 1, "statefuls": {
        "model": model.state_dict(), "optimizer": opt.state_dict()}})
    payload = torch.load(info.file("state.pt"), mmap=True, weights_only=True)
    model2, opt2 = _stepped_adam()
    statefuls = {"model": model2, "optimizer": opt2}
    prints: dict[int, tuple[int, int]] = {}
    load_statefuls(info, payload, statefuls, prints)
    assert len(prints) == 3 * len(opt2.state)  # each parameter's two moments and step
    read: list[torch.Tensor] = []
    real = first_step.fingerprint

    def counted(t: torch.Tensor) -> Any:
        read.append(t)
        return real(t)

    monkeypatch.setattr(first_step, "fingerprint", counted)
    taken = restored_state(statefuls, payload, prints)
    assert len(read) == len(model2.state_dict())  # the optimizer's were taken already
    assert taken == restored_state(statefuls, payload)  # each fingerprint read back anew


def test_the_copies_leave_a_core_to_the_checksum_while_it_runs(monkeypatch):
    from procckpt.training.state.resume import _a_core_left_for

    class Check:
        def __init__(self, running: bool) -> None:
            self._running = running

        def running(self) -> bool:
            return self._running

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with _a_core_left_for(Check(True)):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), _a_core_left_for(Check(True)):
            raise ValueError("a load that failed")
        assert torch.get_num_threads() == 2
        with _a_core_left_for(Check(False)):
            assert torch.get_num_threads() == 2  # done already: every core copies
    finally:
        torch.set_num_threads(threads)
