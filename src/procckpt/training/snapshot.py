"""Writing a training state to disk at the disk's speed, and mostly off the training thread.

A checkpoint of the hooks engine is one ``torch.save`` file, ``state.pt``, loadable by plain
``torch.load(weights_only=True)``. This module writes it in two ways:

Synchronously (:func:`write_checkpoint`): ``torch.save`` streams straight from the tensors
into :class:`StreamingFileWriter`, which checksums and writes in large pieces and starts the
disk's writeback while it goes, so the file is durable soon after its last byte is handed over.

In the background (:class:`BackgroundSaver`): at a safe point :class:`HostArena` copies every
tensor of the state into host memory that is allocated once and reused at every checkpoint
(page-locked when the state lives on a GPU, so that the copy is an asynchronous DMA). The
training goes on as soon as the copy is made; a writer thread then writes the copy as above,
and the checkpoint counts (is acknowledged to the launcher, listed, pruned against) only once
it was fsynced and renamed into place. One write is in flight at a time: a second request
waits for the first, so the extra host memory is one copy of the state, never two.

Why a thread and not a helper process: the thread spends its time in ``os.write``, CRC-32 and
``fsync``, which all release the GIL; ``python benchmarks/bench.py`` measures it holding the GIL
for about a millisecond in all while it writes 1 GiB, and a Python-heavy training loop runs
as fast beside the writer thread as beside a helper process doing the same write (the "GIL"
table of BENCHMARKS.md). A helper process would buy nothing measurable and cost the host copy
in shared memory, a second interpreter, and care that it never outlives (or renames a
checkpoint after) its parent.

Exit paths never lose a write in flight: the writer thread is not a daemon, so the interpreter
waits for it at exit (also after an exception in the training script); a stop request and the
end of training wait for it explicitly. A SIGKILL during a write leaves only a ``.tmp-ckpt-*``
directory, which is never loaded and is removed at the next start (see store.py).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from ..store.checksum import crc32
from ..errors import ProcckptError, UsageError
from ..store.store import CheckpointInfo, CheckpointStore, PendingCheckpoint, lasting_write_error

__all__ = [
    "StreamingFileWriter",
    "HostArena",
    "Snapshot",
    "NotSnapshottable",
    "BackgroundSaver",
    "BackgroundWriteError",
    "write_checkpoint",
    "async_wanted",
    "detach_from_file",
    "private_copy",
    "verify_mapped",
    "MappedVerification",
    "ENV_ASYNC",
]

logger = logging.getLogger(__name__)

#: Environment switch for background checkpoint writes: "0"/"false"/"off" turns them off.
ENV_ASYNC = "PROCCKPT_ASYNC"
#: Tensor data is checksummed and written in pieces of this size: large enough that the
#: per-piece cost (a GIL hand-over, three system calls) vanishes, small enough that the
#: disk starts writing the first piece while the next one is checksummed.
CHUNK = 32 << 20
#: Writes smaller than this (zip headers, small tensors) are gathered before writing; the
#: gathering buffer is the only memory the writer adds to the host copy.
_SMALL = 64 << 10
#: Storages are placed at multiples of this in the host arena (torch.save's own alignment).
_ALIGN = 64
#: Copies below this size are not worth starting threads for.
_PARALLEL_COPY_MIN = 8 << 20
#: Memory bandwidth is saturated by a few copying threads; more only take cores.
_MAX_COPY_THREADS = 4


def async_wanted(explicit: bool | None) -> bool:
    """Whether checkpoints should be written in the background: the Checkpointer argument
    wins, then ``$PROCCKPT_ASYNC``; on by default."""
    if explicit is not None:
        return bool(explicit)
    value = os.environ.get(ENV_ASYNC, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"bad {ENV_ASYNC}={value!r}: expected 1 (write checkpoints in the "
                     "background) or 0 (write them synchronously)")


# -- writing a file --------------------------------------------------------------------------
class StreamingFileWriter:
    """A write-only file for ``torch.save`` that writes at the disk's speed.

    Tensor data passes from the caller's memory straight to ``os.write`` in :data:`CHUNK`
    pieces (no copy); each piece is checksummed just before it is written, and the kernel is
    told to start writing it back right after (``POSIX_FADV_DONTNEED`` starts writeback of
    dirty pages without waiting), so the disk works while the next piece is checksummed and
    the final fsync has little left to do. Once durable, the file's pages are dropped from the
    page cache: a checkpoint does not push the training's data set out of memory.

    ``pause_per_chunk`` is a test seam: it slows every piece down so that tests can act
    while a write is in flight.
    """

    pause_per_chunk: float = 0.0

    def __init__(self, path: Path, *, chunk: int | None = None) -> None:
        self.path = path
        self.chunk = chunk or CHUNK
        self.crc = 0
        self.nbytes = 0
        #: Seconds spent in calls that release the GIL (write, CRC, fsync): the rest of the
        #: writer's wall time is the most it can have held the GIL.
        self.io_seconds = 0.0
        self._small = bytearray()
        self._writeback_from = 0
        #: The OSError a write failed with, if one did.
        self.error: OSError | None = None
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                       0o644)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < _SMALL:
            self._small += view
            if len(self._small) >= _SMALL:
                self._flush_small()
            return n
        self._flush_small()
        for start in range(0, n, self.chunk):
            self._put(view[start:start + self.chunk])
        return n

    def flush(self) -> None:
        """Nothing to do: durability comes with :meth:`finish`."""

    def finish(self) -> tuple[int, int]:
        """Write what is gathered, fsync, close; return (bytes, CRC-32) of the whole file."""
        assert self._fd is not None
        self._flush_small()
        started = time.perf_counter()
        os.fsync(self._fd)
        # Clean pages now: dropping them keeps the page cache for the training's data.
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.io_seconds += time.perf_counter() - started
        os.close(self._fd)
        self._fd = None
        return self.nbytes, self.crc

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _flush_small(self) -> None:
        if self._small:
            data, self._small = self._small, bytearray()
            self._put(memoryview(data))

    def _put(self, piece: memoryview) -> None:
        assert self._fd is not None
        clock = time.perf_counter
        t0 = clock()
        self.crc = crc32(piece, self.crc)
        io = clock() - t0
        rest = piece
        while rest:
            t0 = clock()
            try:
                written = os.write(self._fd, rest)
            except OSError as e:  # torch.save reports it as "unexpected pos": keep the cause
                self.error = e
                raise
            io += clock() - t0
            rest = rest[written:]
        self.nbytes += len(piece)
        if self.nbytes - self._writeback_from >= self.chunk:
            t0 = clock()
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fd, self._writeback_from,
                                 self.nbytes - self._writeback_from, os.POSIX_FADV_DONTNEED)
            io += clock() - t0
            self._writeback_from = self.nbytes
        self.io_seconds += io
        if self.pause_per_chunk:
            time.sleep(self.pause_per_chunk)


_torch_crc_lock = threading.Lock()


@contextlib.contextmanager
def _torch_zip_crc_off() -> Iterator[None]:
    """Skip the CRC-32 that torch's zip writer computes per record: the manifest already has
    one of the whole file, and a second pass over every byte would cost as much CPU as the
    first. Zip CRCs are not checked by ``torch.load``. The option is global in torch, so a
    ``torch.save`` that another thread runs at the same moment also skips it (harmlessly)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or put is None:  # older torch: nothing to switch off
        yield
        return
    with _torch_crc_lock:
        before = get()
        put(False)
        try:
            yield
        finally:
            put(before)


def save_payload(pending: PendingCheckpoint, name: str, payload: Any) -> StreamingFileWriter:
    """``torch.save`` ``payload`` as file ``name`` of ``pending``; record its size and CRC."""
    writer = StreamingFileWriter(pending.path / name)
    try:
        with _torch_zip_crc_off():
            torch.save(payload, writer)
        nbytes, crc = writer.finish()
    except BaseException as e:
        writer.abort()
        if writer.error is not None and writer.error is not e:
            raise writer.error from e
        raise
    pending.record_file(name, nbytes, crc)
    return writer


def write_checkpoint(store: CheckpointStore, meta: dict[str, Any], payload: Any,
                     name: str = "state.pt") -> CheckpointInfo:
    """Write ``payload`` as a new checkpoint of ``store``; durable and in place on return.

    Raises:
        StorageError: no space or no permission: a failure that trying again would repeat.
    """
    with lasting_errors_explained(store, payload), store.begin(meta) as pending:
        save_payload(pending, name, payload)
        return pending.commit()


@contextlib.contextmanager
def lasting_errors_explained(store: CheckpointStore, payload: Any) -> Iterator[None]:
    """Turn a write that failed for lack of space or permission into its one-line
    :class:`StorageError` (with the bytes needed and free); other failures pass unchanged."""
    try:
        yield
    except OSError as e:
        lasting = lasting_write_error(e, store.root, need=payload_bytes(payload))
        if lasting is None:
            raise
        raise lasting from e


def payload_bytes(payload: Any) -> int:
    """About how many bytes ``payload`` takes in a file: the sum of its distinct storages."""
    seen: dict[int, int] = {}
    for t in _tensors(payload):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + (64 << 10)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for value in obj:
            yield from _tensors(value)


def detach_from_file(payload: Any, holders: list[Any]) -> int:
    """Give every tensor that a stateful kept from a memory-mapped ``payload`` memory of its
    own; return how many bytes that copied.

    ``load_state_dict`` of a module copies into the module's parameters, but an optimizer
    keeps the loaded tensors themselves. Left mapped, they would be copied page by page on
    their first update and would keep the checkpoint file's blocks allocated after pruning
    deletes it. ``holders`` are the statefuls: their ``state_dict()`` returns the very tensors
    they hold, which are re-pointed (``set_``) at a private copy.
    """
    mapped = {t.untyped_storage().data_ptr() for t in _tensors(payload) if t.numel()}
    copied = 0
    with torch.no_grad():
        for holder in holders:
            for t in _tensors(holder.state_dict()):
                if t.numel() and t.untyped_storage().data_ptr() in mapped:
                    t.set_(t.clone())
                    copied += t.numel() * t.element_size()
    return copied


def private_copy(obj: Any) -> Any:
    """``obj`` with every tensor cloned (for loaded state that procckpt itself keeps)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for k, value in obj.items():
            new[k] = private_copy(value)
        return new
    if isinstance(obj, list):
        return [private_copy(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        items = [private_copy(v) for v in obj]
        return obj._make(items) if hasattr(obj, "_make") else tuple(items)
    return obj


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_madvise = _libc_madvise()
_MADV_POPULATE_READ = 22  # Linux 5.14; older kernels answer EINVAL and faults do the work


def _file_mapping(path: Path, address: int, size: int) -> int | None:
    """The start of this process's mapping of ``path`` (from file offset 0, at least ``size``
    bytes) that contains ``address``, from /proc/self/maps; None if there is none."""
    st = os.stat(path)
    spans: list[tuple[int, int, int]] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or int(fields[4]) != st.st_ino:
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end, int(fields[2], 16)))
    except (OSError, ValueError):
        return None
    for start, end, offset in spans:
        if start <= address < end:
            # The kernel may split one mapping into several entries; they share a base.
            base = start - offset
            reach = max(e for s, e, o in spans if s - o == base)
            return base if reach - base >= size else None
    return None


#: fadvise(WILLNEED) reads at most the device's read-ahead size per call (8 MiB here)...
_READ_STEP = 8 << 20
#: ...so the checksum thread keeps asking for this much ahead of itself: the disk never idles.
_READ_AHEAD = 64 << 20


class MappedVerification:
    """Checksums a checkpoint file that ``torch.load(mmap=True)`` mapped in, on a thread and
    on the mapping itself, while the caller loads from the same mapping.

    Verifying first and loading after would read the file, then go over it a second time;
    here the thread keeps the kernel reading ahead, checksums each piece as it lands in the
    page cache (populating the mapping's page tables as it goes), and ``load_state_dict``
    copies from pages that are already there. The caller must treat what it loaded as
    unverified until :meth:`result` returns None, and load something else (or give up) if
    it does not. Where the mapping cannot be found (another torch), the file is read instead.
    """

    def __init__(self, payload: Any, path: Path, nbytes: int, expected_crc: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.expected_crc = expected_crc
        self._payload = payload  # keeps the mapping alive while the thread reads it
        self._problem: str | None = None
        #: Set when reading failed (EIO, a stale handle), as opposed to a wrong checksum.
        self.read_error: OSError | None = None
        pointers = [t.untyped_storage().data_ptr() for t in _tensors(payload)
                    if t.untyped_storage().nbytes()]
        self._base = (_file_mapping(path, min(pointers), nbytes)
                      if pointers and nbytes > 0 else None)
        # Not a daemon: it reads the mapping, which must outlive it.
        self._thread = threading.Thread(target=self._run, name="procckpt-verify")
        self._thread.start()

    def result(self) -> str | None:
        """Wait for the checksum; return why the file is unusable, or None if it is intact."""
        self._thread.join()
        self._payload = None
        return self._problem

    def _run(self) -> None:
        from ..store.store import file_crc32

        try:
            if self._base is None:
                crc, size = file_crc32(self.path)
            else:
                crc, size = self._crc_of_mapping(self._base), self.nbytes
        except OSError as e:  # the storage's fault, not the file's: the caller stops
            self.read_error = e
            self._problem = f"{self.path.name} cannot be read ({e})"
            return
        if (crc, size) != (self.expected_crc, self.nbytes):
            self._problem = f"{self.path.name} fails its checksum (the file is corrupt)"

    def _crc_of_mapping(self, base: int) -> int:
        n = self.nbytes
        view = memoryview((ctypes.c_ubyte * n).from_address(base)).cast("B")
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            crc = 0
            requested = 0
            for start in range(0, n, _READ_STEP):
                while requested < min(n, start + _READ_AHEAD):
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, requested, _READ_STEP, os.POSIX_FADV_WILLNEED)
                    requested += _READ_STEP
                length = min(_READ_STEP, n - start)
                if _madvise is not None:  # page tables in one call, not a fault per 64 KiB
                    _madvise(base + start, length, _MADV_POPULATE_READ)
                crc = crc32(view[start:start + length], crc)
            return crc
        finally:
            os.close(fd)
            view.release()


def verify_mapped(payload: Any, path: Path, nbytes: int, expected_crc: int) -> str | None:
    """:class:`MappedVerification` without loading alongside: start it and wait."""
    return MappedVerification(payload, path, nbytes, expected_crc).result()


# -- the host copy ---------------------------------------------------------------------------
class NotSnapshottable(Exception):
    """The state holds something that cannot be copied into host buffers (sparse, quantized
    or subclassed tensors); such a checkpoint is written synchronously instead."""


class _Pinning(Enum):
    NONE = "none"
    REGISTERED = "registered"  # our own mmap, page-locked with cudaHostRegister
    ALLOCATED = "allocated"  # torch's pinned allocator (rounds sizes up: the fallback)


@dataclass
class Snapshot:
    """A copy of a payload whose tensors live in a :class:`HostArena`."""

    payload: Any
    nbytes: int
    tensors: int
    seconds: float
    _events: list[Any] = field(default_factory=list, repr=False)

    def wait_copied(self) -> None:
        """Wait for asynchronous device-to-host copies (GPU state) to land."""
        for event in self._events:
            event.synchronize()
        self._events = []


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """Tensors with equal keys are the same data; they are copied (and saved) once."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()))


def _check_tensor(t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise NotSnapshottable(f"a {type(t).__name__} tensor subclass")
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
        raise NotSnapshottable(f"a {t.layout} / quantized / nested / meta tensor")


_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, torch.memory_format, torch.layout)


class HostArena:
    """Host memory for snapshot copies: allocated at the first checkpoint, reused after.

    The arena is one anonymous mapping, as large as the state's tensors (rounded to whole
    pages), populated when it is made; only the first checkpoint (or one after the state
    grew) pays for that. When the state has CUDA tensors the mapping is page-locked
    (``cudaHostRegister``) so that copies from the GPU are asynchronous DMAs. Each tensor's
    copy gets a storage of its own inside the arena, so ``torch.save`` writes exactly the
    tensor's bytes (not a whole shared storage).
    """

    def __init__(self) -> None:
        self.capacity = 0
        self.allocations = 0
        self._mm: mmap.mmap | None = None
        self._flat: torch.Tensor | None = None
        self._pinning = _Pinning.NONE
        self._signature: tuple[Any, ...] | None = None
        self._slots: list[torch.Tensor] = []

    @property
    def pinned(self) -> bool:
        return self._pinning is not _Pinning.NONE

    def capture(self, payload: Any) -> Snapshot:
        """Copy ``payload`` (nested dicts/lists/tuples of tensors and plain values) into the
        arena and return the copy. Only CUDA copies may still be in flight on return:
        :meth:`Snapshot.wait_copied` waits for them.

        Raises:
            NotSnapshottable: a tensor that cannot be copied this way; nothing was changed.
        """
        started = time.perf_counter()
        unique: dict[tuple[Any, ...], int] = {}
        sources: list[torch.Tensor] = []
        order: list[int] = []
        self._collect(payload, unique, sources, order)
        signature = tuple((s.dtype, tuple(s.shape), s.device.type) for s in sources)
        wants_pinned = any(s.is_cuda for s in sources)
        if signature != self._signature or wants_pinned != self.pinned:
            self._plan(sources, wants_pinned)
            self._signature = signature
        slots = self._slots
        with torch.no_grad():
            if sources:
                _copy_all(slots, sources)
        events = _record_events(sources) if wants_pinned else []
        copies = [slots[i] for i in order]
        copies.reverse()  # popped in walk order below
        for i, src in enumerate(sources):
            if src.requires_grad != slots[i].requires_grad:
                slots[i].requires_grad_(src.requires_grad)
        rebuilt = self._rebuild(payload, copies)
        nbytes = sum(s.untyped_storage().nbytes() for s in slots)
        return Snapshot(rebuilt, nbytes, len(sources), time.perf_counter() - started, events)

    def release(self) -> None:
        """Give the memory back (the next capture allocates again)."""
        self._slots = []
        self._signature = None
        self._free()

    # -- internals ---------------------------------------------------------------------------
    def _collect(self, obj: Any, unique: dict[tuple[Any, ...], int],
                 sources: list[torch.Tensor], order: list[int]) -> None:
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj)
            key = _key(obj)
            index = unique.get(key)
            if index is None:
                index = unique[key] = len(sources)
                sources.append(obj)
            order.append(index)
        elif isinstance(obj, dict):
            for value in obj.values():
                self._collect(value, unique, sources, order)
        elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            for value in obj:
                self._collect(value, unique, sources, order)

    def _rebuild(self, obj: Any, copies: list[torch.Tensor]) -> Any:
        """The same structure with each tensor replaced by its copy; containers are new, so
        that the training may change its own dicts and lists while the copy is written."""
        if isinstance(obj, torch.Tensor):
            copied = copies.pop()
            if isinstance(obj, torch.nn.Parameter):
                return torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
            return copied
        if isinstance(obj, dict):
            new = copy.copy(obj)  # keeps the type and attributes (state_dict's _metadata)
            for k, value in obj.items():
                new[k] = self._rebuild(value, copies)
            return new
        if isinstance(obj, list):
            items = [self._rebuild(value, copies) for value in obj]
            if type(obj) is list:
                return items
            new_list = copy.copy(obj)
            new_list[:] = items
            return new_list
        if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
            items = [self._rebuild(value, copies) for value in obj]
            if all(a is b for a, b in zip(items, obj)):
                return obj
            if type(obj) is tuple:
                return tuple(items)
            if hasattr(obj, "_make"):  # a namedtuple
                return obj._make(items)
            raise NotSnapshottable(f"tensors inside a {type(obj).__name__}")
        if isinstance(obj, _ATOMS):
            return obj
        return copy.deepcopy(obj)  # something mutable and unusual: copy it whole

    def _plan(self, sources: list[torch.Tensor], pinned: bool) -> None:
        """Lay out one slot per tensor, growing (or re-pinning) the arena if needed."""
        offsets = []
        total = 0
        for s in sources:
            offsets.append(total)
            total += _round_up(s.numel() * s.element_size(), _ALIGN)
        wanted = _Pinning.REGISTERED if pinned else _Pinning.NONE
        if total > self.capacity or (pinned != self.pinned):
            self._allocate(total, wanted)
        assert self._flat is not None or total == 0
        storage = self._flat.untyped_storage() if self._flat is not None else None
        slots = []
        for s, offset in zip(sources, offsets):
            nbytes = s.numel() * s.element_size()
            if storage is None:
                slot = torch.empty(s.shape, dtype=s.dtype)
            else:
                part = storage[offset:offset + nbytes]
                slot = torch.empty(0, dtype=s.dtype).set_(part, 0, s.shape, _contiguous(s.shape))
            slots.append(slot)
        self._slots = slots
        logger.debug("host arena: %d tensors, %.1f MB in %.1f MB (%s)", len(slots), total / 1e6,
                     self.capacity / 1e6, self._pinning.value)

    def _allocate(self, nbytes: int, pinning: _Pinning) -> None:
        self._slots = []
        self._free()
        if nbytes == 0:
            return
        # Whole pages only, so the arena stays within a page of the state's size. The
        # kernel populates it in one go (MAP_POPULATE): on the VM of BENCHMARKS.md that
        # costs 0.4 s per GiB, against 1-3 s when the first copy faults pages in one by one
        # (with or without transparent huge pages), and later copies are as fast.
        size = _round_up(nbytes, mmap.PAGESIZE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(-1, size, flags=flags)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        if pinning is _Pinning.REGISTERED and not _cuda_register(flat):
            # Registration refused (e.g. a locked-memory limit): use torch's pinned allocator,
            # which rounds up to a power of two, so say so.
            del flat
            mm.close()
            mm = None
            flat = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            pinning = _Pinning.ALLOCATED
            logger.warning("could not page-lock the checkpoint buffer in place; using torch's "
                           "pinned allocator, which may take up to twice the state's size")
        self._mm, self._flat, self._pinning = mm, flat, pinning
        self.capacity = flat.numel()
        self.allocations += 1

    def _free(self) -> None:
        if self._flat is not None and self._pinning is _Pinning.REGISTERED:
            _cuda_unregister(self._flat)
        self._flat = None
        self._pinning = _Pinning.NONE
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a tensor still uses it: GC frees it later
                self._mm.close()
            self._mm = None
        self.capacity = 0


def _copy_all(slots: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy every source into its slot; this is the training's stall on a CPU-only run."""
    flat: list[tuple[int, int, int]] = []
    slow_dst: list[torch.Tensor] = []
    slow_src: list[torch.Tensor] = []
    for slot, src in zip(slots, sources):
        if (src.device.type == "cpu" and src.is_contiguous() and not src.is_conj()
                and not src.is_neg()):
            nbytes = src.numel() * src.element_size()
            if nbytes:
                flat.append((slot.data_ptr(), src.data_ptr(), nbytes))
        else:
            slow_dst.append(slot)
            slow_src.append(src)
    if slow_src:
        cuda = any(s.is_cuda for s in slow_src)
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None:
            # One call for all tensors: a Python loop of copy_ calls would be a visible
            # part of the stall for a model with thousands of tensors.
            foreach(slow_dst, slow_src, non_blocking=cuda)
        else:
            for slot, src in zip(slow_dst, slow_src):
                slot.copy_(src, non_blocking=src.is_cuda)
    if flat:
        _parallel_memmove(flat)


def _copy_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_COPY_THREADS, cores))


def _parallel_memmove(segments: list[tuple[int, int, int]]) -> None:
    """Copy (dst, src, nbytes) segments with glibc's memmove on a few threads.

    Measured on the 2-core VM of BENCHMARKS.md, 1 GiB: torch's copy_ 72 ms, one memmove
    66 ms (it uses non-temporal stores for large copies), two memmoves side by side 50 ms.
    ctypes releases the GIL around the call, so the threads run in parallel. The caller
    guarantees contiguous CPU tensors that stay alive until this returns.
    """
    total = sum(n for _, _, n in segments)
    workers = _copy_threads() if total >= _PARALLEL_COPY_MIN else 1
    share = -(-total // workers)
    plans: list[list[tuple[int, int, int]]] = [[] for _ in range(workers)]
    worker, room = 0, share
    for dst, src, n in segments:
        while n:
            take = min(n, room)
            plans[worker].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room == 0 and worker < workers - 1:
                worker, room = worker + 1, share

    def run(plan: list[tuple[int, int, int]]) -> None:
        for d, s, k in plan:
            ctypes.memmove(d, s, k)

    threads = [threading.Thread(target=run, args=(plan,), daemon=True) for plan in plans[1:]]
    for t in threads:
        t.start()
    run(plans[0])
    for t in threads:
        t.join()


def _record_events(sources: list[torch.Tensor]) -> list[Any]:
    """One CUDA event per device, recorded on the stream the copies were queued on."""
    events = []
    for device in sorted({s.device for s in sources if s.is_cuda}, key=str):
        with torch.cuda.device(device):
            event = torch.cuda.Event()
            event.record()
            events.append(event)
    return events


def _cuda_register(flat: torch.Tensor) -> bool:
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    except Exception as e:  # no CUDA runtime binding: fall back
        logger.debug("cudaHostRegister unavailable: %s", e)
        return False
    return int(rc) == 0


def _cuda_unregister(flat: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple)) * multiple if n else 0


# -- the background writer -------------------------------------------------------------------
class BackgroundWriteError(ProcckptError):
    """A checkpoint written in the background failed; the previous one is still intact."""


@dataclass
class WriteResult:
    """What a background write reports when its checkpoint is durable."""

    info: CheckpointInfo
    snapshot_seconds: float
    write_seconds: float
    gil_free_seconds: float


class BackgroundSaver:
    """Writes one snapshot at a time on a (non-daemon) thread.

    ``capture`` copies the state into the arena (waiting first for a write in flight, whose
    memory it reuses); ``start`` writes that copy on a new thread. ``on_durable`` runs on the
    writer thread once the checkpoint is renamed into place (it acknowledges, logs, prunes);
    ``on_failed`` when the write raised. :meth:`wait` raises such a failure again.
    """

    def __init__(self, store: CheckpointStore, name: str = "state.pt") -> None:
        self.store = store
        self.name = name
        self.arena = HostArena()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, *, raise_failure: bool = True) -> None:
        """Wait for the write in flight, if any.

        Raises:
            BackgroundWriteError: the last background write failed (raised once; with
                ``raise_failure=False`` it is only forgotten: it was logged when it happened).
        """
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if raise_failure:
                raise BackgroundWriteError(
                    f"writing a checkpoint in the background failed ({error}); the previous "
                    f"checkpoint in {self.store.root} is intact. Set {ENV_ASYNC}=0 to write "
                    "checkpoints synchronously"
                ) from error

    def capture(self, payload: Any) -> Snapshot:
        """Wait for a write in flight, then copy ``payload`` into the arena.

        Raises:
            NotSnapshottable: nothing was copied; write this checkpoint synchronously.
        """
        self.wait(raise_failure=False)
        return self.arena.capture(payload)

    def start(self, snapshot: Snapshot, meta: dict[str, Any],
              on_durable: Callable[[WriteResult], None],
              on_failed: Callable[[BaseException], None]) -> None:
        """Write ``snapshot`` as a new checkpoint on the writer thread."""
        assert not self.in_flight, "capture() waits for the previous write"
        thread = threading.Thread(target=self._write, name="procckpt-writer",
                                  args=(snapshot, meta, on_durable, on_failed), daemon=False)
        self._thread = thread
        thread.start()

    def close(self) -> None:
        """Wait for the write in flight and give the arena's memory back."""
        try:
            self.wait()
        finally:
            self.arena.release()

    def _write(self, snapshot: Snapshot, meta: dict[str, Any],
               on_durable: Callable[[WriteResult], None],
               on_failed: Callable[[BaseException], None]) -> None:
        started = time.perf_counter()
        try:
            snapshot.wait_copied()
            with lasting_errors_explained(self.store, snapshot.payload), \
                    self.store.begin(meta) as pending:
                writer = save_payload(pending, self.name, snapshot.payload)
                info = pending.commit()
        except BaseException as e:  # raised again by the training thread's next wait()
            self._error = e
            snapshot.payload = None
            logger.error("writing a checkpoint in the background failed: %s; the previous "
                         "checkpoint stays the one to resume from", e)
            with contextlib.suppress(Exception):
                on_failed(e)
            return
        snapshot.payload = None  # the arena is free for the next capture
        result = WriteResult(info, snapshot.seconds, time.perf_counter() - started,
                             writer.io_seconds)
        try:
            on_durable(result)
        except BaseException as e:
            self._error = e
            logger.error("after writing checkpoint %s: %s", info.name, e)
