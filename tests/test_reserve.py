"""training/state/reserve.py: a spare's memory touched in advance, and a restore that copies
the optimizer's state into it (issue 55)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from procckpt.store import CheckpointStore
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
    assert detach_from_file(payload, [restored]) >= moments
    del payload
    os.unlink(tmp_path / "state.pt")

    for state, expected in zip(restored.state.values(), opt.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], expected[key])
            assert start <= state[key].data_ptr() < end, key
            assert state[key].data_ptr() % 64 == 0
    assert reserve.carved() >= moments and reserve.held() == 0
    # What the restore did not take went back to the kernel; what it took stays resident.
    assert _resident(start, end) <= -(-moments * 2 // 4096) * 4096
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
        store = CheckpointStore(tier, keep=2).open()
        info = write_checkpoint(store, {"step": 3, "epoch": 0, "batch": 3, "reason": "memory"},
                                {"w": torch.zeros(50_000)})
        waiter.join(2.0)
        assert waiter.is_alive()  # it waits for the restart still
        assert reserve.held() >= info.nbytes
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
