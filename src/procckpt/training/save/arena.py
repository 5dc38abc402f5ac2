"""The host arena: one reusable block of host memory that a snapshot copies the state into.

At a safe point :class:`HostArena` copies every tensor of the state into host memory that is
allocated once and reused at every checkpoint (page-locked when the state lives on a GPU, so
that the copy is an asynchronous DMA). The training goes on as soon as the copy is made.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import logging
import math
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from .device import CpuTwin, CudaOps, device_ops
from .standing import Standing

if TYPE_CHECKING:
    from .fence import StepFence

__all__ = ["HostArena", "Snapshot", "NotSnapshottable", "map_populated", "round_up", "ALIGN",
           "madvise"]

logger = logging.getLogger(__name__)

#: Storages are placed at multiples of this in the host arena (torch.save's own alignment).
ALIGN = 64
#: Copies below this size are not worth starting threads for.
_PARALLEL_COPY_MIN = 8 << 20
#: Memory bandwidth is saturated by a few copying threads; more only take cores.
_MAX_COPY_THREADS = 4
#: What each copying thread takes at a time (see :func:`_parallel_memmove`).
_COPY_PIECE = 256 << 10
#: Where the shares of a copy beyond the caller's own run (made on the first large copy).
_COPY_HELPERS = Standing("procckpt-copy", _MAX_COPY_THREADS - 1)


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
    _sources: list[torch.Tensor] = field(default_factory=list, repr=False)

    def wait_copied(self) -> None:
        """Wait for asynchronous device-to-host copies (GPU state) to land."""
        for event in self._events:
            event.synchronize()
        self._events = []
        self._sources = []


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
    """Host memory for snapshot copies: allocated ahead (:meth:`reserve`) or at the first
    checkpoint, reused after.

    The arena is one anonymous mapping, as large as the state's tensors (rounded to whole
    pages), populated when it is made; only the first checkpoint (or one after the state
    grew) pays for that. When the state has CUDA tensors the mapping is page-locked
    (``cudaHostRegister``) so that copies from the GPU are asynchronous DMAs. Each tensor's
    copy gets a storage of its own inside the arena, so ``torch.save`` writes exactly the
    tensor's bytes (not a whole shared storage).
    """

    def __init__(self, backing: Callable[[int], mmap.mmap] | None = None) -> None:
        #: Where the memory comes from: a populated mapping of at least the bytes asked for
        #: (private anonymous memory by default; the memory tier's: a file of its own).
        self._backing = backing or map_populated
        #: How many times the tensors were laid out (a new layout: new slot tensors).
        self.layouts = 0
        self.capacity = 0
        self.allocations = 0
        self._mm: mmap.mmap | None = None
        self._flat: torch.Tensor | None = None
        self._pinning = _Pinning.NONE
        self._signature: tuple[Any, ...] | None = None
        self._slots: list[torch.Tensor] = []
        self._streams: dict[torch.device, Any] = {}  # the side stream per GPU, made once
        self._ops: CudaOps | CpuTwin = device_ops()  # what page-locked the arena

    @property
    def pinned(self) -> bool:
        return self._pinning is not _Pinning.NONE

    def offset_of(self, data_ptr: int, nbytes: int) -> int | None:
        """Where ``nbytes`` at ``data_ptr`` lie in the mapping the backing gave, None if not
        inside it (or if the arena is not in that mapping: torch's pinned fallback)."""
        flat = self._flat
        if flat is None or self._mm is None:
            return None
        offset = data_ptr - flat.data_ptr()
        return offset if 0 <= offset and offset + nbytes <= flat.numel() else None

    def capture(self, payload: Any, fence: StepFence | None = None) -> Snapshot:
        """Copy ``payload`` (nested dicts/lists/tuples of tensors and plain values) into the
        arena and return the copy. Only CUDA copies may still be in flight on return:
        :meth:`Snapshot.wait_copied` waits for them. With a ``fence``, the copies of what
        changes only in its optimizers' ``step()`` may still run while the training goes on
        (see fence.py).

        Raises:
            NotSnapshottable: a tensor that cannot be copied this way; nothing was changed.
        """
        started = time.perf_counter()
        unique: dict[tuple[Any, ...], int] = {}
        sources: list[torch.Tensor] = []
        order: list[int] = []
        self._collect(payload, unique, sources, order)
        ops = device_ops()
        self._lay_out(sources, ops)
        wants_pinned = self.pinned
        slots = self._slots
        late = fence.late_storages(ops) if fence is not None and wants_pinned else set()
        events: list[Any] = []
        with torch.no_grad():
            if sources:
                events, lasts = _copy_all(slots, sources, late, self._streams, ops)
                if lasts and fence is not None:
                    fence.hold(lasts)
        copies = [slots[i] for i in order]
        copies.reverse()  # popped in walk order below
        for i, src in enumerate(sources):
            if src.requires_grad != slots[i].requires_grad:
                slots[i].requires_grad_(src.requires_grad)
        rebuilt = self._rebuild(payload, copies)
        nbytes = sum(s.untyped_storage().nbytes() for s in slots)
        # The sources stay referenced until the copies landed: a temporary of state_dict()
        # freed earlier could be reused by the training stream while the side stream reads it.
        return Snapshot(rebuilt, nbytes, len(sources), time.perf_counter() - started, events,
                        sources if events else [])

    def reserve(self, payload: Any) -> None:
        """Lay out (and allocate) the arena for ``payload`` without copying anything, so that
        a later :meth:`capture` of a payload of the same shapes only copies. Reads the
        tensors' shapes and dtypes only: it may run while the training changes their values.

        Raises:
            NotSnapshottable: the payload cannot be captured this way (nor reserved for).
        """
        unique: dict[tuple[Any, ...], int] = {}
        sources: list[torch.Tensor] = []
        self._collect(payload, unique, sources, [])
        self._lay_out(sources, device_ops())

    def release(self) -> None:
        """Give the memory back (the next capture allocates again)."""
        self._slots = []
        self._signature = None
        self._free()

    # -- internals ---------------------------------------------------------------------------
    def _lay_out(self, sources: list[torch.Tensor], ops: CudaOps | CpuTwin) -> None:
        """Plan the slots again where the tensors' shapes or places changed: page-locked
        memory exactly when some of the state is device state."""
        signature = tuple((s.dtype, tuple(s.shape), s.device.type) for s in sources)
        wants_pinned = any(ops.holds(s) for s in sources)
        if signature != self._signature or wants_pinned != self.pinned:
            self._plan(sources, wants_pinned, ops)
            self._signature = signature
            self.layouts += 1

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

    def _plan(self, sources: list[torch.Tensor], pinned: bool, ops: CudaOps | CpuTwin) -> None:
        """Lay out one slot per tensor, growing (or re-pinning) the arena if needed."""
        offsets = []
        total = 0
        for s in sources:
            offsets.append(total)
            total += round_up(s.numel() * s.element_size(), ALIGN)
        wanted = _Pinning.REGISTERED if pinned else _Pinning.NONE
        if total > self.capacity or (pinned != self.pinned):
            self._allocate(total, wanted, ops)
        assert self._flat is not None or total == 0
        storage = self._flat.untyped_storage() if self._flat is not None else None
        slots = []
        for s, offset in zip(sources, offsets):
            nbytes = s.numel() * s.element_size()
            # (An empty tensor gets no place: at the next one's, it would share its address,
            # and torch.save refuses two dtypes at one address.)
            if storage is None or nbytes == 0:
                slot = torch.empty(s.shape, dtype=s.dtype)
            else:
                part = storage[offset:offset + nbytes]
                slot = torch.empty(0, dtype=s.dtype).set_(part, 0, s.shape, _contiguous(s.shape))
            slots.append(slot)
        self._slots = slots
        logger.debug("host arena: %d tensors, %.1f MB in %.1f MB (%s)", len(slots), total / 1e6,
                     self.capacity / 1e6, self._pinning.value)

    def _allocate(self, nbytes: int, pinning: _Pinning, ops: CudaOps | CpuTwin) -> None:
        self._slots = []
        self._free()
        self._ops = ops
        if nbytes == 0:
            return
        mm = self._backing(nbytes)
        size = len(mm)
        # Not inherited by forked children (DataLoader workers start at every epoch): in a
        # child's lifetime each page the next capture writes would be copied first (1.5 s
        # instead of 0.06 s per GiB here, and 1x the state more memory), and page-locked
        # pages are copied at the fork itself.
        with contextlib.suppress(AttributeError, OSError):
            mm.madvise(mmap.MADV_DONTFORK)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        kept: mmap.mmap | None = mm
        if pinning is _Pinning.REGISTERED and not ops.page_lock(flat):
            # Registration refused (e.g. a locked-memory limit): use torch's pinned allocator,
            # which rounds up to a power of two, so say so.
            del flat
            mm.close()
            kept = None
            flat = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            pinning = _Pinning.ALLOCATED
            logger.warning("could not page-lock the checkpoint buffer in place; using torch's "
                           "pinned allocator, which may take up to twice the state's size")
        self._mm, self._flat, self._pinning = kept, flat, pinning
        self.capacity = flat.numel()
        self.allocations += 1

    def _free(self) -> None:
        if self._flat is not None and self._pinning is _Pinning.REGISTERED:
            self._ops.unlock(self._flat)
        self._flat = None
        self._pinning = _Pinning.NONE
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a tensor still uses it: GC frees it later
                self._mm.close()
            self._mm = None
        self.capacity = 0


def _copy_all(slots: list[torch.Tensor], sources: list[torch.Tensor], late: set[int],
              streams: dict[torch.device, Any],
              ops: CudaOps | CpuTwin) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Copy every source into its slot; host copies are the training's stall on a CPU-only
    run. GPU copies are queued on a side stream (see :func:`_copy_from_gpus`); returns its
    events and the (device, event) pairs a step fence must wait for."""
    flat: list[tuple[int, int, int]] = []
    slow_dst: list[torch.Tensor] = []
    slow_src: list[torch.Tensor] = []
    gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
    for slot, src in zip(slots, sources):
        if ops.holds(src):
            gpu.append((slot, src))
        elif (src.device.type == "cpu" and src.is_contiguous() and not src.is_conj()
              and not src.is_neg()):
            nbytes = src.numel() * src.element_size()
            if nbytes:
                flat.append((slot.data_ptr(), src.data_ptr(), nbytes))
        else:
            slow_dst.append(slot)
            slow_src.append(src)
    events: tuple[list[Any], list[tuple[Any, Any]]] = ([], [])
    if gpu:
        events = _copy_from_gpus(gpu, late, streams, ops)
    if slow_src:
        _copy_list(slow_dst, slow_src, non_blocking=False)
    if flat:
        _parallel_memmove(flat)
    return events


def _copy_list(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        # One call for all tensors: a Python loop of copy_ calls would be a visible part of
        # the stall for a model with thousands of tensors.
        foreach(dst, src, non_blocking=non_blocking)
    else:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=non_blocking)


def _copy_from_gpus(pairs: list[tuple[torch.Tensor, torch.Tensor]], late: set[int],
                    streams: dict[torch.device, Any],
                    ops: CudaOps | CpuTwin) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Per GPU: on a side stream that first waits for the training stream's queued work,
    copy what is not ``late`` (record "first"), then what is (record "last"). The training
    stream waits for "first" at once; "last" is returned for the step fence (or waited for
    at once too, when nothing is late). The CPU waits for neither."""
    events: list[Any] = []
    fenced: list[tuple[Any, Any]] = []
    for device in sorted({src.device for _, src in pairs}, key=str):
        early = [(d, s) for d, s in pairs if s.device == device
                 and s.untyped_storage().data_ptr() not in late]
        deferred = [(d, s) for d, s in pairs if s.device == device
                    and s.untyped_storage().data_ptr() in late]
        training = ops.current_stream(device)
        side = streams.get(device)
        if side is None:
            side = streams[device] = ops.new_stream(device)
        side.wait_stream(training)  # the copies see the state at the safe point
        for part in (early, deferred):
            if part:
                dst, src = [d for d, _ in part], [s for _, s in part]
                ops.copy(side, functools.partial(_copy_list, dst, src))
            events.append(ops.record(side))
        first, last = events[-2], events[-1]
        training.wait_event(first)
        if deferred:
            fenced.append((device, last))
    return events, fenced


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

    The threads take pieces of :data:`_COPY_PIECE` bytes in turn until none is left, rather
    than a half each: a helper woken from its wait starts a few hundred microseconds after
    the caller, and with halves the caller then waited for it to finish its own (0.3-0.7 ms
    of a 64-MB copy's 4-5 ms); with pieces both end within a piece of each other. Between
    two pieces a thread takes the GIL for a moment, while the other copies without it.
    """
    total = sum(n for _, _, n in segments)
    workers = _copy_threads() if total >= _PARALLEL_COPY_MIN else 1
    if workers == 1:
        for dst, src, n in segments:
            ctypes.memmove(dst, src, n)
        return
    pieces = [(dst + at, src + at, min(_COPY_PIECE, n - at))
              for dst, src, n in segments for at in range(0, n, _COPY_PIECE)]
    taken = iter(pieces)  # (next() on it is atomic: one piece to one thread)

    def run() -> None:
        for d, s, k in taken:
            ctypes.memmove(d, s, k)

    # The helpers are threads that stay (standing.py): a thread started here would make this
    # copy wait for the scheduler to run it first.
    helped = [_COPY_HELPERS.submit(run) for _ in range(workers - 1)]
    run()
    for done in helped:
        done.result()


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def map_populated(nbytes: int) -> mmap.mmap:
    """Private anonymous memory of ``nbytes`` in whole pages (so within a page of what was
    asked), populated by the kernel in one go (MAP_POPULATE): on the VM of BENCHMARKS.md that
    costs 0.4 s per GiB, against 1-3 s when the first copy faults pages in one by one (with or
    without transparent huge pages), and later copies are as fast. Raises OSError."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, round_up(nbytes, mmap.PAGESIZE), flags=flags)


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


#: madvise(2) by address, without the GIL (as ctypes calls C), for memory that no Python
#: object maps whole (mmap's own method holds the GIL throughout); None where libc has none.
madvise: Callable[[int, int, int], int] | None = _libc_madvise()


def round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple)) * multiple if n else 0
