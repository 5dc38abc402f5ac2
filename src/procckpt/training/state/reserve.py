"""Memory touched in advance for a restore: a warm restart's spare interpreter fills it while
it waits, and the restore gives the optimizer's state its memory there (issue 55).

A restore from the memory tier loads a memory-mapped checkpoint; the optimizer keeps the
loaded tensors themselves, so each gets memory of its own (mapped.py, ``detach_from_file``).
Into memory the process has never touched, that copy runs at the speed of the kernel's page
faults (a fault and a zeroed page for every 4 KiB): on a 2-core VM without huge pages, about
1.7 GB/s, two thirds of a 64-MB restore. Into memory already touched it runs at the speed of
a copy.

The spare (launcher/warm.py) calls :func:`wait_readable` on its pipe. While no restart comes,
it looks at the launcher's memory tier once a second, and once a slot is there, maps an
anonymous region of the slot's size, populated by the kernel in one go as the host arena is
(save/arena.py), if the machine and the cgroup have room for it. The restart then runs the
script in that process; the restore's copies are carved from the region (:func:`take`),
64-byte aligned, each a tensor of its own; :func:`release` gives the rest back to the kernel.
A region carved from lives as long as one of its tensors does.
Any process without a region (a cold start, a tier that is off) copies as before.
"""

from __future__ import annotations

import mmap
import os
import select
import threading
from pathlib import Path
from typing import Any

import torch

from ...protocol.control import ENV_TIER
from ...store.cgroups import HEADROOM, memory_short
from ..save.arena import ALIGN, madvise, map_populated, round_up

__all__ = ["wait_readable", "prepare", "take", "release", "held", "carved"]

#: How often a waiting spare looks for the tier's first slot, in seconds.
LOOK_EVERY = 1.0

#: The region (a view of its mapping), and how much of it was carved.
_view: memoryview | None = None
_used = 0
#: Bytes the restores of this process copied into a region (for its recovery event).
_carved = 0


def wait_readable(fd: int, tier: str | None = None) -> None:
    """Return once ``fd`` can be read; meanwhile prepare the region from the tier's newest
    slot (``tier``: its directory, by default the one the launcher named in the
    environment)."""
    tier = tier if tier is not None else os.environ.get(ENV_TIER)
    while _view is None and tier:
        readable, _, _ = select.select([fd], [], [], LOOK_EVERY)
        if readable:
            return
        nbytes = _newest_slot_bytes(Path(tier))
        if nbytes:
            prepare(nbytes)
            break
    select.select([fd], [], [])


def _newest_slot_bytes(tier: Path) -> int:
    """The size of the newest slot's state in ``tier`` (its data file: the tensors, each
    aligned as a restore's copies are), 0 if there is none yet."""
    from ...protocol.slots import slot_files, slots_newest_first

    slots = slots_newest_first(tier)
    try:
        return slot_files(tier, slots[0][0]).data.stat().st_size if slots else 0
    except OSError:
        return 0


def prepare(nbytes: int) -> bool:
    """Map a populated region of ``nbytes`` (one at a time); False where there is no room for
    it or the kernel refused it."""
    global _view, _used
    if _view is not None or nbytes <= 0 or memory_short(nbytes + HEADROOM) is not None:
        return False
    try:
        region = map_populated(nbytes)
    except OSError:
        return False
    _view, _used = memoryview(region), 0
    return True


def held() -> int:
    """Bytes of the region not carved yet (0 without one)."""
    return 0 if _view is None else len(_view) - _used


def carved() -> int:
    """Bytes this process's restores copied into memory touched in advance."""
    return _carved


def take(like: torch.Tensor) -> torch.Tensor | None:
    """A tensor of ``like``'s dtype and shape in the region, not filled; None where ``like``
    is not a plain dense CPU tensor or the region has no room for it."""
    global _used, _carved
    if _view is None or like.layout != torch.strided or like.is_quantized \
            or like.device.type != "cpu" or not like.is_contiguous():
        return None
    nbytes = like.numel() * like.element_size()
    start = round_up(_used, ALIGN)
    if nbytes == 0 or start + nbytes > len(_view):
        return None
    _used, _carved = start + nbytes, _carved + nbytes
    return torch.frombuffer(_view[start:start + nbytes], dtype=like.dtype).view(like.shape)


def release() -> None:
    """Forget the region, and give the pages not carved from it back to the kernel on a
    thread of its own (at 64 MB that took 1.7 ms, which the restore need not wait for): what
    was carved keeps the region mapped while it lives."""
    global _view, _used
    view, used = _view, _used
    _view, _used = None, 0
    if view is None:
        return
    region = view.obj
    assert isinstance(region, mmap.mmap)
    first_free = round_up(used, mmap.PAGESIZE)
    free = len(region) - first_free
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr() + first_free
    view.release()
    if not used:
        work: Any = region.close  # munmap, without the GIL
        args: tuple[Any, ...] = ()
    elif free > 0 and madvise is not None:
        work, args = _dont_need, (region, address, free)
    else:
        if free > 0:  # no libc madvise: mmap's own, here (it holds the GIL)
            region.madvise(mmap.MADV_DONTNEED, first_free, free)
        return
    threading.Thread(target=work, args=args, name="procckpt-release", daemon=True).start()


def _dont_need(region: mmap.mmap, address: int, nbytes: int) -> None:
    """Give ``nbytes`` of ``region`` from ``address`` back (``region``, passed along, stays
    mapped meanwhile); mmap's own ``madvise`` would hold the GIL throughout."""
    assert madvise is not None
    madvise(address, nbytes, mmap.MADV_DONTNEED)
