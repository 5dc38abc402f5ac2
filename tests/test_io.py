"""training/save/: the streaming writer, the host arena, background writes, mmap restores."""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from procckpt import Checkpointer
from procckpt.errors import UsageError
from procckpt.store import CheckpointStore
from procckpt.training.save.arena import HostArena, NotSnapshottable
from procckpt.training.save.background import (
    BackgroundSaver,
    BackgroundWriteError,
    WriteResult,
    async_wanted,
)
from procckpt.training.save.direct import ENV_DIRECT
from procckpt.training.save.fence import ENV_OVERLAP, StepFence
from procckpt.training.save.writer import StreamingFileWriter, write_checkpoint
from procckpt.training.state import mapped as io_mapped

from .conftest import mounted_tmpfs


class Pair(NamedTuple):
    first: torch.Tensor
    second: int


def make_payload(namedtuple: bool = False) -> dict[str, Any]:
    torch.manual_seed(3)
    base = torch.randn(6, 5)
    sd = collections.OrderedDict(w=torch.randn(4, 4), b=torch.arange(7, dtype=torch.int64))
    sd._metadata = collections.OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    payload = {
        "model": sd,
        "view": base.t(),  # not contiguous
        "again": sd["w"],  # the same tensor twice
        "half": torch.randn(3, dtype=torch.float16),
        "flag": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "nested": [{"x": torch.full((2,), 7.0)}, (torch.zeros(1), "s")],
        "plain": {"lr": 0.1, "name": "adam", "none": None},
    }
    if namedtuple:  # copied fine, but not loadable with weights_only=True
        payload["pair"] = Pair(torch.ones(2), 5)
    return payload


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def open_store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ck").open()


# -- the writer ------------------------------------------------------------------------------
def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_streaming_writer_writes_every_byte_and_its_crc(tmp_path: Path, direct: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DIRECT, direct)
    # pieces that straddle the direct buffers (1 MiB here), and a length that is no
    # multiple of a disk block: the padding of the last direct write must be cut off
    pieces = [os.urandom(n) for n in (10, 3 << 20, 1, 100_000, 9 << 20, 7)]
    writer = StreamingFileWriter(tmp_path / "f", chunk=1 << 20)
    assert is_direct(writer.fileno()) == (direct == "1")  # ext4 and tmpfs take O_DIRECT
    for piece in pieces:
        assert writer.write(memoryview(piece)) == len(piece)
    assert writer.position == sum(map(len, pieces))
    nbytes, crc = writer.finish()
    content = b"".join(pieces)
    assert (tmp_path / "f").read_bytes() == content
    assert (nbytes, crc) == (len(content), zlib.crc32(content))


def test_a_bad_direct_io_switch_is_a_usage_error_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DIRECT, "maybe")
    with pytest.raises(UsageError, match="PROCCKPT_DIRECT_IO='maybe'"):
        StreamingFileWriter(tmp_path / "f")
    assert not (tmp_path / "f").exists()


def test_direct_writer_turns_plain_midway_and_keeps_every_byte(tmp_path: Path) -> None:
    """What DCP's stream does when asked to seek: the bytes gathered so far are written and
    the same descriptor takes plain (unaligned) writes from there."""
    head, tail = os.urandom((1 << 20) + 123), os.urandom(4567)
    writer = StreamingFileWriter(tmp_path / "f", chunk=1 << 20)
    assert is_direct(writer.fileno())
    writer.write(head)
    writer.write_gathered()
    assert not is_direct(writer.fileno())
    assert os.pwrite(writer.fileno(), tail, len(head)) == len(tail)
    writer.abort()
    assert (tmp_path / "f").read_bytes() == head + tail


def test_direct_writer_reports_a_full_disk_and_leaves_nothing_running(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", "4m") as mount:
        writer = StreamingFileWriter(mount / "f", chunk=1 << 20)
        assert is_direct(writer.fileno())
        with pytest.raises(OSError) as raised:
            for _ in range(8):  # 8 MiB into 4
                writer.write(os.urandom(1 << 20))
            writer.finish()
        assert raised.value.errno == errno.ENOSPC
        assert writer.error is raised.value  # what save_payload raises instead of torch's text
        writer.abort()
    assert not [t for t in threading.enumerate() if t.name == "procckpt-direct"]


def test_checkpoint_loads_with_plain_torch_load_and_verifies(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    payload = make_payload()
    info = write_checkpoint(store, {"step": 1}, payload)
    assert store.verify(info.path) is None
    loaded = torch.load(info.file("state.pt"), weights_only=True)
    assert_same(payload, loaded)
    assert loaded["model"]._metadata == {"": {"version": 2}}
    assert loaded["again"].data_ptr() == loaded["model"]["w"].data_ptr()  # sharing kept


def test_torch_zip_crc_option_is_left_as_it_was(tmp_path: Path) -> None:
    before = torch.serialization.get_crc32_options()
    write_checkpoint(open_store(tmp_path), {}, {"t": torch.ones(3)})
    assert torch.serialization.get_crc32_options() == before


def test_torch_zip_crc_stays_off_while_any_writer_needs_it_then_comes_back() -> None:
    from procckpt.training.save.writer import torch_zip_crc_off

    before = torch.serialization.get_crc32_options()
    with torch_zip_crc_off():
        with torch_zip_crc_off():  # a second writer: another thread's dcp.save, say
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is False  # the first one still writes
    assert torch.serialization.get_crc32_options() == before


# -- the arena -------------------------------------------------------------------------------
def test_capture_is_a_copy_that_training_cannot_change() -> None:
    payload = make_payload(namedtuple=True)
    expected = torch.load(_roundtrip(payload), weights_only=False)
    snap = HostArena().capture(payload)
    payload["model"]["w"].add_(1)
    payload["view"].mul_(0)
    payload["nested"][0]["x"].fill_(-1)
    payload["plain"]["lr"] = 99.0
    payload["nested"].append("new")
    assert_same(expected, snap.payload)
    assert snap.payload["model"]._metadata == {"": {"version": 2}}
    assert isinstance(snap.payload["pair"], Pair)


def test_a_copy_shared_between_threads_lands_every_byte_once() -> None:
    # Over _PARALLEL_COPY_MIN, in pieces the threads take in turn: sizes that are no multiple
    # of a piece, an empty tensor and a one-byte one among them.
    state = {"big": torch.randint(0, 255, (9_000_001,), dtype=torch.uint8),
             "odd": torch.randn(777_777), "empty": torch.empty(0), "one": torch.ones(1,
             dtype=torch.uint8), "half": torch.randn(300_001, dtype=torch.float16)}
    arena = HostArena()
    for _ in range(2):
        snap = arena.capture(state)
        for name, tensor in state.items():
            assert torch.equal(snap.payload[name], tensor), name
        for tensor in state.values():
            tensor.add_(1)


def test_the_arena_is_allocated_once_and_reused() -> None:
    arena = HostArena()
    weights = {"a": torch.randn(1000, 300), "b": torch.randn(50)}
    first = arena.capture(weights)
    ptr = first.payload["a"].data_ptr()
    weights["a"].add_(1)
    second = arena.capture(weights)
    assert arena.allocations == 1
    assert second.payload["a"].data_ptr() == ptr
    assert torch.equal(second.payload["a"], weights["a"])
    state_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert arena.capacity <= state_bytes + 64 * len(weights) + 4096  # <= 1x the state
    weights["c"] = torch.randn(2000, 300)  # the state grew: one more allocation
    third = arena.capture(weights)
    assert arena.allocations == 2 and torch.equal(third.payload["c"], weights["c"])


def test_a_script_that_ends_while_the_arena_is_being_reserved_keeps_its_exit_code(
        tmp_path: Path) -> None:
    """A script that fails a step after the reserve began exits with its own code, not with
    SIGABRT: a daemon thread still inside torch at interpreter shutdown aborted the process
    ("terminate called without an active exception"; 4 of 20 runs of tests/harness/programs/
    tiny_train.py --fail-at-step 4). The reserve is made slow here so that it is certainly
    still inside torch when the script ends: several large torch ops, then the real one."""
    program = """
import sys, torch
from procckpt.store import CheckpointStore
from procckpt.training.save.background import BackgroundSaver
saver = BackgroundSaver(CheckpointStore(sys.argv[1]).open())
real = saver.arena.reserve
def slow_reserve(payload):
    block = torch.ones(1 << 24)
    for _ in range(40):  # about a second inside torch, the GIL released
        block.mul_(1.0001).add_(1e-6)
    real(payload)
saver.arena.reserve = slow_reserve
saver.reserve({"w": torch.randn(1000, 100)})
raise SystemExit(3)
"""
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path / "ck")], text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_an_arena_reserved_ahead_is_the_one_the_first_checkpoint_copies_into(
        tmp_path: Path) -> None:
    """The first checkpoint stalls like the others: its memory was made after the
    first step, in the background, while training went on."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    optimizer = torch.optim.Adam(model.parameters())  # its state appears at the first step
    ckpt = Checkpointer(tmp_path / "ck", model=model, optimizer=optimizer, save_every=None,
                        async_save=True)
    saver = ckpt._background
    assert saver is not None
    batches = ckpt.batches(iter(lambda: torch.randn(8, 256), None))
    for step, x in enumerate(batches):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            break
    deadline = time.monotonic() + 30  # made on its own thread while training goes on
    while not saver.reserved and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.reserved and saver.arena.allocations == 1  # before any checkpoint
    reserved = saver.arena.capacity
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert reserved >= 3 * weights  # the parameters and Adam's two moments
    ckpt.request_checkpoint()
    next(batches)  # the safe point after this step takes it
    ckpt.flush()
    assert ckpt.last_checkpoint is not None
    assert saver.arena.allocations == 1 and saver.arena.capacity == reserved
    ckpt.close()


def test_the_same_tensor_is_copied_once() -> None:
    t = torch.randn(1000)
    snap = HostArena().capture({"x": t, "y": t, "z": [t]})
    assert snap.tensors == 1
    assert snap.payload["x"].data_ptr() == snap.payload["z"][0].data_ptr()


def test_forked_children_do_not_inherit_the_arena() -> None:
    # DataLoader workers fork at every epoch: had they the arena, the next capture would copy
    # every page it writes while they live (and page-locked pages at the fork).
    arena = HostArena()
    arena.capture({"w": torch.randn(1 << 20)})
    start = arena._flat.data_ptr()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait until the parent has read our maps
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        ranges = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps]
        assert not [r for r in ranges if r[0] <= start < r[1]]
        own = Path("/proc/self/maps").read_text().splitlines()
        assert any(int(line.split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16)
                   for line in own)  # the check itself can see a mapping
    finally:
        os.close(write)
        os.waitpid(pid, 0)


def test_a_sparse_tensor_is_not_snapshottable() -> None:
    with pytest.raises(NotSnapshottable):
        HostArena().capture({"s": torch.eye(3).to_sparse()})


def test_a_waited_checkpoint_of_host_state_is_written_from_the_tensors_themselves(
        tmp_path: Path) -> None:
    # A stop's checkpoint: the caller waits anyway, so copying host state first only costs.
    saver = BackgroundSaver(open_store(tmp_path))
    state = {"w": torch.randn(1000), "n": 3}
    with saver.staged(state) as staged:
        assert staged["w"].data_ptr() == state["w"].data_ptr()
    assert saver.arena.allocations == 0


def test_the_step_fence_covers_the_given_optimizers_unless_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.delenv(ENV_OVERLAP, raising=False)
    assert StepFence.for_statefuls({"model": model}) is None
    fence = StepFence.for_statefuls({"model": model, "optimizer": optimizer})
    assert fence is not None and fence.optimizers == [optimizer]
    assert fence.late_storages() == set()  # host tensors: nothing is copied late
    monkeypatch.setenv(ENV_OVERLAP, "0")
    assert StepFence.for_statefuls({"model": model, "optimizer": optimizer}) is None
    monkeypatch.setenv(ENV_OVERLAP, "sometimes")
    with pytest.raises(UsageError, match="PROCCKPT_OVERLAP"):
        StepFence.for_statefuls({"optimizer": optimizer})


# -- background writes -----------------------------------------------------------------------
def test_a_failed_background_write_is_reported_and_leaves_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    good = write_checkpoint(store, {"step": 1}, {"t": torch.ones(2)})

    class Unpicklable:  # deep-copies fine, but pickle cannot find a local class
        pass

    saver = BackgroundSaver(store)
    failed: list[BaseException] = []
    snap = saver.capture({"t": torch.ones(2), "bad": Unpicklable()})
    saver.start(snap, {"step": 2}, lambda r: None, failed.append)
    with pytest.raises(BackgroundWriteError, match="previous checkpoint"):
        saver.wait()
    assert len(failed) == 1
    assert [i.name for i in store.checkpoints()] == [good.name]
    assert not [p for p in store.ckpt_root.iterdir() if p.name.startswith(".tmp-")]


def test_a_second_capture_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    saver = BackgroundSaver(store)
    gate = threading.Event()
    order: list[str] = []

    def durable(result: WriteResult) -> None:
        gate.wait(10)
        order.append(f"durable {result.info.name}")

    state = {"t": torch.zeros(1000)}
    saver.start(saver.capture(state), {"step": 1}, durable, lambda e: None)
    threading.Timer(0.3, gate.set).start()
    state["t"].fill_(1)
    snap2 = saver.capture(state)  # must not overwrite the arena before write 1 is done
    order.append("captured 2")
    assert order == ["durable ckpt-00000001", "captured 2"]
    saver.start(snap2, {"step": 2}, lambda r: None, lambda e: None)
    saver.close()
    first, second = (torch.load(i.file("state.pt"), weights_only=True)
                     for i in reversed(store.checkpoints()))
    assert first["t"].sum() == 0 and second["t"].sum() == 1000


def test_async_switch_from_argument_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROCCKPT_ASYNC", raising=False)
    assert async_wanted(None) is True
    monkeypatch.setenv("PROCCKPT_ASYNC", "0")
    assert async_wanted(None) is False
    assert async_wanted(True) is True
    monkeypatch.setenv("PROCCKPT_ASYNC", "off")
    assert async_wanted(None) is False


# -- the Checkpointer with both ----------------------------------------------------------------
def train(ckpt: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer,
          steps: int) -> None:
    x = torch.randn(32, 8)
    for _ in zip(range(steps), ckpt.batches(iter(lambda: 0, 1))):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def make_training() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def test_resume_from_an_async_checkpoint_holds_no_file_mapping(tmp_path: Path) -> None:
    model, opt = make_training()
    ckpt = Checkpointer(tmp_path / "ck", model=model, optimizer=opt, interval=1e-9,
                        save_every=None, async_save=True)
    train(ckpt, model, opt, 5)
    ckpt.flush()
    saved = ckpt.last_checkpoint
    assert saved is not None and saved.step == 4  # the safe point after step 5 did not run
    expected = torch.load(saved.file("state.pt"), weights_only=True)["statefuls"]
    ckpt.close()

    model2, opt2 = make_training()
    resumed = Checkpointer(tmp_path / "ck", model=model2, optimizer=opt2, save_every=None)
    assert resumed.step == 4 and resumed.restore_seconds is not None
    assert_same(expected["model"], model2.state_dict())
    assert_same(expected["optimizer"]["state"], opt2.state_dict()["state"])
    # The optimizer's tensors are its own memory, not views of the (mapped) checkpoint file.
    with open(f"/proc/{os.getpid()}/maps") as f:
        mapped = [line for line in f if "state.pt" in line]
    assert mapped == []
    resumed.close()


def test_a_state_that_cannot_be_copied_is_saved_synchronously(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ck", interval=1e-9, save_every=None, async_save=True)
    ckpt.extras["sparse"] = torch.eye(4).to_sparse()
    for _ in zip(range(2), ckpt.batches(iter(lambda: 0, 1))):
        pass
    assert ckpt._background is not None and not ckpt._background.in_flight
    assert ckpt.last_checkpoint is not None and ckpt.last_checkpoint.step == 1
    ckpt.close()


def _roundtrip(payload: Any) -> Any:
    import io

    buf = io.BytesIO()
    torch.save(payload, buf)
    buf.seek(0)
    return buf


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    model, opt = make_training()
    ckpt = Checkpointer(tmp_path / "ck", model=model, optimizer=opt, interval=1e-9, keep=3,
                        save_every=None)
    train(ckpt, model, opt, 4)
    ckpt.close()
    newest, previous = ckpt.store.checkpoints()[:2]
    payload = newest.file("state.pt")
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: only the checksum can tell
    payload.write_bytes(bytes(data))

    model2, opt2 = make_training()
    resumed = Checkpointer(tmp_path / "ck", model=model2, optimizer=opt2, save_every=None)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == previous.name
    assert newest.path.with_name(newest.name + ".corrupt").is_dir()
    resumed.close()


def test_verify_mapped_checks_a_mapping_and_falls_back_to_reading(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    info = write_checkpoint(store, {}, {"t": torch.randn(100_000), "u": torch.ones(5)})
    expect = info.manifest["files"]["state.pt"]
    path = info.file("state.pt")
    mapped = torch.load(path, weights_only=True, mmap=True)
    assert io_mapped._file_mapping(path, mapped["t"].data_ptr(), expect["bytes"]) is not None
    assert io_mapped.verify_mapped(mapped, path, expect["bytes"], expect["crc32"]) is None
    assert "fails its checksum" in str(
        io_mapped.verify_mapped(mapped, path, expect["bytes"], expect["crc32"] ^ 1))
    read = torch.load(path, weights_only=True)  # not mapped: the file is read instead
    assert io_mapped._file_mapping(path, read["t"].data_ptr(), expect["bytes"]) is None
    assert io_mapped.verify_mapped(read, path, expect["bytes"], expect["crc32"]) is None


def test_isal_and_zlib_checksums_agree() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib",
                                    reason="the optional isal package (procckpt[fast]) is absent")
    data = os.urandom(3 << 20)
    assert isal_zlib.crc32(data) == zlib.crc32(data)
    assert isal_zlib.crc32(data[1000:], zlib.crc32(data[:1000])) == zlib.crc32(data)


def test_a_checkpoint_written_with_one_crc_implementation_verifies_with_the_other(
        tmp_path: Path) -> None:
    pytest.importorskip("isal.isal_zlib",
                        reason="the optional isal package (procckpt[fast]) is absent")
    # The implementation is chosen at import, so each side runs in its own interpreter.
    program = """
import sys, torch
from procckpt.store.checksum import IMPLEMENTATION
from procckpt.training.save.writer import write_checkpoint
from procckpt.store import CheckpointStore
store = CheckpointStore(sys.argv[2]).open()
if sys.argv[1] == "write":
    write_checkpoint(store, {}, {"t": torch.randn(300_000)})
    print(IMPLEMENTATION, "wrote")
else:
    print(IMPLEMENTATION, store.verify(store.checkpoints()[0].path) or "intact")
"""
    for writer, checker in (("isal", "zlib"), ("zlib", "isal")):
        d = str(tmp_path / writer)
        for action, crc, expect in (("write", writer, "wrote"), ("verify", checker, "intact")):
            done = subprocess.run([sys.executable, "-c", program, action, d], text=True,
                                  env={**os.environ, "PROCCKPT_CRC": crc},
                                  capture_output=True, timeout=120)
            assert done.stdout.split() == [crc, expect], done.stderr[-2000:]
