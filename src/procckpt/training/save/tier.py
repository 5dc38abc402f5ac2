"""The training's side of the memory tier (launcher/tier.py): its newest state, every few steps,
in memory the launcher holds.

At a safe point where no checkpoint is taken, :class:`TierWriter` copies the state into one
of two slots in the launcher's tmpfs directory, in turn (protocol/slots.py). A slot's host
arena *is* a file there, mapped: the copy at the safe point is the whole write of the
state's bytes. A thread then completes the slot: its ``data.pkl`` (pickled as ``torch.save``
pickles, each tensor's reduction made once per layout and reused: about 2 ms for 67
tensors), a skeleton of a few KB once per layout (``torch.save`` with the storages' bytes
left out) and its manifest. It starts a third of a step after the copy (at most 0.1 s),
once the compute that follows the safe point had the GIL and the cores: pickled inline, or
on a thread at once, the slot's pause grew by those 2-3 ms. No bytes of the state are written
after the copy, so a slot waits for no core for long: until issue 55's fourth round the slot
was written again as a checkpoint by a thread at the lowest priority, 50-100 ms later,
seconds where another process (a warm restart's spare importing torch) held the cores.

The cadence follows what a slot costs the training, measured (the pause at the safe point,
all of it, as a share of the time between the safe points of its moment): a slot at every
safe point where the median of the last five shares is at most 0.8 %, else every k of
them. Of the 1 % the tier may take, a fifth is left for what the plan does not see: the
slot's wake (caches a copy of the whole state emptied, its completion's thread) and pauses
longer than their median (their mean is 3-4 % over it here). On the 2-core VM of
BENCHMARKS.md the training paid 0.1-0.15 % over its pauses' share: planned at 0.85 %, the
cost measured 0.94-1.0 %. A state on
a GPU is copied on the side stream as a checkpoint's is; the thread waits for the copies to
land.

Before the first slot, the room for it is checked (the memory file system, the machine, the
cgroup), and each slot's file takes its room when it is made (``posix_fallocate``), so that
a memory file system filled by something else fails the tier in one line, never the
training with a SIGBUS: a tier that does not fit is said in one line, and the training goes
on without it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import math
import mmap
import os
import pickle
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ...protocol.control import ENV_TIER
from ...protocol.events import append_event
from ...protocol.slots import SLOTS, slot_files
from ...store.cgroups import HEADROOM, memory_short
from ...store.files import format_size, write_file_atomic
from .arena import HostArena, NotSnapshottable, Snapshot, round_up
from .standing import Standing
from .writer import payload_bytes

__all__ = ["TierWriter", "BUDGET", "tier_room", "ENV_COPY_PAUSE"]

logger = logging.getLogger(__name__)

#: The share of the training's time the tier may take from it.
BUDGET = 0.01
#: The share a slot's pause is planned at (the rest: its wake, see the module).
COPY_BUDGET = 0.008
#: A slot is completed this share of a step after its copy, at most WRITE_WAIT_MAX s.
WRITE_WAIT = 1 / 3
WRITE_WAIT_MAX = 0.1
#: torch.save's pickle protocol (its default, DEFAULT_PROTOCOL in torch/serialization.py).
_PICKLE_PROTOCOL = 2
#: A test seam: seconds between a slot's manifest removed and its copy, where a kill tears it.
ENV_COPY_PAUSE = "PROCCKPT_TIER_COPY_PAUSE"


def tier_room(root: Path, nbytes: int) -> str | None:
    """Why a tier of ``nbytes`` a slot does not fit here, or None if it does: its slots' files
    in ``root`` (the slots are the training's host copies too), with a margin, in the file
    system, the machine's available memory and the cgroup's limit."""
    files = SLOTS * nbytes
    need = files + HEADROOM
    try:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
    except OSError as e:
        return f"cannot see the room in {root} ({e.strerror or e})"
    if free < files:
        return (f"its {SLOTS} slots of {format_size(nbytes)} need {format_size(files)} in "
                f"{root.parent}, which has {format_size(free)} free")
    needs = (f"it needs {format_size(need)} of memory ({SLOTS} slots of "
             f"{format_size(nbytes)}, and a margin)")
    short = memory_short(need)
    return None if short is None else f"{needs}, and {short}"


class _Slot:
    """One of the writer's slots: its files, and the host arena that is its data file."""

    def __init__(self, root: Path, index: int) -> None:
        self.data, self.skeleton, self.pickle, self.manifest = slot_files(root, index)
        self.arena = HostArena(backing=self._map)
        #: The arena's layout the skeleton was written for, and the tensors' reductions
        #: pickled against it (see :class:`_SlotPickler`).
        self.layout = -1
        self.reductions: dict[int, tuple[Any, bool, Any]] = {}
        self.storages: dict[tuple[int, int], tuple[Any, Any, int]] = {}

    def _map(self, nbytes: int) -> mmap.mmap:
        """The data file, grown to ``nbytes`` (whole pages) with its room taken, mapped
        shared and populated. Raises OSError (ENOSPC: the memory file system is full)."""
        size = round_up(nbytes, mmap.PAGESIZE)
        fd = os.open(self.data, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)

    def remove(self) -> None:
        self.arena.release()
        self.layout, self.reductions, self.storages = -1, {}, {}
        for path in (self.manifest, self.pickle, self.skeleton, self.data):
            with contextlib.suppress(OSError):
                path.unlink()


class TierWriter:
    """Writes the state into the launcher's tier every few safe points (see the module)."""

    def __init__(self, root: Path, journal: Path | None, name: str = "state.pt") -> None:
        self.root = root
        self.journal = journal
        #: The file each slot's state becomes in a checkpoint (a group's other ranks: their
        #: rank file).
        self.name = name
        self._slots = [_Slot(root, i) for i in range(SLOTS)]
        self._next = 0
        #: Why the tier is off for the rest of this process, once it is.
        self.off: str | None = None
        #: Write a slot every this many safe points (planned from the measured pauses).
        self.every = 1
        self.slots = 0
        self._since = 0
        self._last_point: float | None = None
        self._gaps: deque[float] = deque(maxlen=15)
        self._stalls: deque[float] = deque(maxlen=5)
        #: Each of those pauses as a share of the steps around it (see :meth:`_plan`).
        self._shares: deque[float] = deque(maxlen=5)
        self._nbytes = 0
        #: Completes each slot after its copy: a thread that stays (standing.py), and the
        #: slot it was last handed, and its own id, once it ran.
        self._completer = Standing("procckpt-tier")
        self._completing: Future[None] | None = None
        self._completer_id: int | None = None
        self._said_every: int | None = None
        #: Whether the cadence goes to the log (in a group: rank 0's, the one that counts).
        self.says = True
        self._clock = time.perf_counter  # (a seam: a slot's pause, as a unit test sets it)

    @classmethod
    def from_environment(cls, journal: Path | None) -> TierWriter | None:
        """The tier the launcher made for this command, if any."""
        path = os.environ.get(ENV_TIER)
        return cls.opened(Path(path), journal) if path else None

    @classmethod
    def opened(cls, root: Path, journal: Path | None, name: str = "state.pt") -> TierWriter:
        """The tier's directory at ``root``, ready, or off (:attr:`off` says why). Slots an
        earlier process left are removed: the launcher kept what it needed of them before
        this process started."""
        writer = cls(root, journal, name)
        try:
            root.mkdir(exist_ok=True)
            for slot in writer._slots:
                slot.remove()
            for left in root.glob(".tmp-*"):  # (files a kill left half written)
                left.unlink(missing_ok=True)
        except OSError as e:
            writer.turn_off(f"cannot use {root} ({e.strerror or e})")
        return writer

    def at_safe_point(self, now: float, write: bool, meta: Callable[[], dict[str, Any]],
                      payload: Callable[[], dict[str, Any]],
                      before: Callable[[dict[str, Any]], None]) -> None:
        """Count a safe point; with ``write`` (no checkpoint was taken here), write a slot
        when its turn came. ``before(state)`` runs just before a slot of ``state`` is copied
        (the audit's note)."""
        self.count(now, write)
        if write and self.due() and not self.busy():
            self.write_slot(meta, payload, before)

    def count(self, now: float, eligible: bool) -> None:
        """Measure the time since the last safe point (what the cadence is planned from);
        ``eligible``: one that could hold a slot, counted towards the next."""
        last, self._last_point = self._last_point, now
        if last is not None:
            self._gaps.append(now - last)
        if eligible and self.off is None:
            self._since += 1

    def due(self) -> bool:
        """Whether a slot's turn came (never at the first safe point: no step measured)."""
        return self.off is None and self._since >= self.every and bool(self._gaps)

    def busy(self) -> bool:
        """Whether the previous slot is still being completed (its thread not done)."""
        completing = self._completing
        return completing is not None and not completing.done()

    def write_slot(self, meta: Callable[[], dict[str, Any]],
                   payload: Callable[[], dict[str, Any]],
                   before: Callable[[dict[str, Any]], None]) -> None:
        """Copy the state into the next slot (the pause) and complete it; first check the
        room for the tier, once."""
        if self.off is not None:
            return
        started = self._clock()
        state = payload()
        if self.slots == 0 and not self._nbytes:
            self._nbytes = payload_bytes(state)
            room = tier_room(self.root, self._nbytes)
            if room is not None:
                self.turn_off(room)
                return
        slot = self._slots[self._next]
        with contextlib.suppress(FileNotFoundError):
            slot.manifest.unlink()  # torn from here until its new manifest is in place
        started += _pause_for_tests()  # (a seam: not the tier's cost)
        before(state)
        allocations = slot.arena.allocations
        try:
            snapshot = slot.arena.capture(state)
        except NotSnapshottable as e:
            self.turn_off(f"the state holds {e}, which cannot be copied into host memory")
            return
        except OSError as e:
            self.turn_off(f"its slot in {self.root} could not be made "
                          f"({e.strerror or e}): is the memory file system full?")
            return
        except (MemoryError, RuntimeError) as e:  # (the tier must never end the training)
            self.turn_off(f"the copy failed ({type(e).__name__}: {e})")
            return
        self._next = (self._next + 1) % SLOTS
        self._since = 0
        self._nbytes = snapshot.nbytes
        # The rest on the completing thread, once the compute that follows the safe point
        # had the GIL and the cores (the copy's containers are its own: arena.py).
        wait = min(WRITE_WAIT * statistics.median(self._gaps), WRITE_WAIT_MAX) \
            if self._gaps else 0.0
        self._completing = self._completer.submit(self._complete, slot, snapshot, meta(), wait)
        if slot.arena.allocations == allocations:  # (a pause that first made its file is
            pause = self._clock() - started  # no measure of the next)
            self._stalls.append(pause)
            recent = statistics.median(list(self._gaps)[-5:]) if self._gaps else 0.0
            self._shares.append(pause / recent if recent > 0 else math.inf)
        if self._stalls and self._gaps:
            self._plan()

    def _complete(self, slot: _Slot, snapshot: Snapshot, meta: dict[str, Any],
                  wait: float) -> None:
        """After ``wait`` s, the slot's pickle, skeleton (once per layout) and manifest, once
        its bytes are in its data file (a GPU's copies landed)."""
        self._completer_id = threading.get_ident()
        time.sleep(wait)
        try:
            snapshot.wait_copied()
            if slot.layout != slot.arena.layouts:  # new slot tensors: a new skeleton
                slot.reductions, slot.storages = {}, {}
                tmp = slot.skeleton.with_name(f".tmp-{slot.skeleton.name}")
                with torch.serialization.skip_data():
                    torch.save(snapshot.payload, tmp)
                os.replace(tmp, slot.skeleton)
                slot.layout = slot.arena.layouts
            data_pkl, records = _pickled(snapshot.payload, slot)
            write_file_atomic(slot.pickle, data_pkl, durable=False)
            manifest = {"step": meta.get("step"), "meta": meta, "name": self.name,
                        "records": records, "bytes": snapshot.nbytes, "time": time.time()}
            write_file_atomic(slot.manifest, json.dumps(manifest).encode(), durable=False)
            self.slots += 1
        except Exception as e:  # noqa: BLE001 (no failure of the tier may reach the training)
            self.turn_off(f"a slot could not be written ({type(e).__name__}: {e})")

    def _plan(self) -> None:
        step = statistics.median(self._gaps)
        pause = statistics.median(self._stalls)
        # Each pause is measured against the steps of its time: another process that takes
        # the cores (a warm restart's spare importing torch, for seconds after a restart)
        # slows the steps more than the copy. Planned on pauses and steps apart, the slow
        # copies of that time, still in the median once the steps are quick again, spaced the
        # slots by up to twice as many steps for seconds after it. The median of the shares:
        # one pause slowed alone (a page cache flush) moves nothing.
        share = statistics.median(self._shares)  # (appended with every pause)
        every = max(1, math.ceil(share / COPY_BUDGET)) if math.isfinite(share) else 1
        self.every = every
        said = self._said_every
        # Said (and journalled) when new or moved by over half: the copy's time wavers.
        if said is None or not said / 1.5 <= every <= said * 1.5:
            self._said_every = every
            why = (f"the copy takes {_ms(pause)}, {COPY_BUDGET:.1%} of a step of {_ms(step)} "
                   f"is {_ms(COPY_BUDGET * step)}")
            # In the log once; the journal (procckpt status) follows it.
            if said is None and self.says:
                logger.info("memory tier: %s a slot in %s, written every %s (%s)",
                            format_size(self._nbytes), self.root, "step" if every == 1
                            else f"{every} steps", why)
            if self.journal is not None:
                append_event(self.journal, "memory-tier", bytes=self._nbytes, every=every,
                             why=why, copy=round(pause, 5), step_seconds=round(step, 5),
                             root=str(self.root))

    def turn_off(self, why: str, say: bool = True) -> None:
        """Off for the rest of this process, its slots removed; ``say``: the warning line (a
        group's ranks turned off by another rank's say nothing)."""
        self.off = why
        if say:
            logger.warning("memory tier: off, %s; a crash resumes from the newest checkpoint "
                           "(--no-memory-tier says so without this line)", why)
        if self.journal is not None:
            append_event(self.journal, "memory-tier", off=why, root=str(self.root))
        if not self.busy() or self._completer_id == threading.get_ident():
            for slot in self._slots:
                slot.remove()

    def close(self) -> None:
        """Wait for a slot being completed. A script that exits (or raises) meanwhile waits
        for it too, as the interpreter finishes what its standing threads were handed before it
        ends: a daemon thread inside ``torch.save`` when the interpreter ends aborts the process
        (SIGABRT, "terminate called without an active exception") instead of exiting with the
        script's code."""
        completing = self._completing
        if completing is not None:
            concurrent.futures.wait([completing])


class _NotInSlot(Exception):
    """A storage of the state that the copy did not put into the slot's file."""


def _pickled(payload: Any, slot: _Slot) -> tuple[bytes, dict[str, list[int]]]:
    """``payload``'s ``data.pkl`` as ``torch.save`` writes it, and for each of its storage
    records (``data/<key>``) where its bytes are in the slot's data file: [offset, bytes]."""
    buffer = io.BytesIO()
    pickler = _SlotPickler(buffer, slot)
    pickler.dump(payload)
    return buffer.getvalue(), pickler.records


_STORAGES = (torch.storage.TypedStorage, torch.UntypedStorage)


class _SlotPickler(pickle.Pickler):
    """torch.save's pickler (torch/serialization.py ``_save``), in one pass with the slot's
    records, and at a fraction of its time: a tensor's reduction (``__reduce_ex__``, tens of
    microseconds in Python) is made once per slot tensor and layout and reused; the slot's
    tensors keep their storages, shapes and strides while the layout lasts. The bytes are
    the same as torch.save's (a unit test compares them)."""

    def __init__(self, file: Any, slot: _Slot) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.slot = slot
        self.keys: dict[int, str] = {}
        self.records: dict[str, list[int]] = {}

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            return NotImplemented
        cache = self.slot.reductions
        held = cache.get(id(obj))  # (the slot's own tensors: the same objects at every copy)
        if held is not None and held[0] is obj and held[1] == obj.requires_grad:
            return held[2]
        reduced = obj.__reduce_ex__(_PICKLE_PROTOCOL)
        if kind is torch.Tensor:
            cache[id(obj)] = (obj, obj.requires_grad, reduced)
        return reduced

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)  # (called for every object pickled: the common case first)
        if kind not in _STORAGES and not isinstance(obj, _STORAGES):
            return None
        storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
        cdata = storage._cdata
        key = self.keys.get(cdata)
        if key is None:
            key = self.keys[cdata] = str(len(self.keys))
            nbytes = storage.nbytes()
            offset = self.slot.arena.offset_of(storage.data_ptr(), nbytes) if nbytes else 0
            if offset is None:
                raise _NotInSlot(f"a storage of {nbytes} bytes outside the slot")
            self.records[f"data/{key}"] = [offset, nbytes]
        described = self.slot.storages.get((id(obj), cdata))
        if described is None or described[0] is not obj:
            if isinstance(obj, torch.storage.TypedStorage):
                described = (obj, getattr(torch, obj._pickle_storage_type()), obj._size())
            else:
                described = (obj, torch.serialization.normalize_storage_type(type(obj)),
                             storage.nbytes())
            self.slot.storages[(id(obj), cdata)] = described
        # (Every storage is in the slot, host memory: what location_tag says of it.)
        return ("storage", described[1], key, "cpu", described[2])


def _pause_for_tests() -> float:
    pause = float(os.environ.get(ENV_COPY_PAUSE) or 0)
    if pause:
        time.sleep(pause)
    return pause


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
