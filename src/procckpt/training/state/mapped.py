"""Loads from a memory-mapped checkpoint: checksum the mapping while the state is loaded from it.

Also the helpers that give loaded tensors memory of their own once the file may go away.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ...store.checksum import crc32
from ..save.writer import tensors_of
from . import reserve
from .contents import plain_print

__all__ = ["MappedVerification", "verify_mapped", "detach_from_file", "Detached",
           "private_copy"]


class Detached(NamedTuple):
    """What :func:`detach_from_file` copied: bytes in all, and those of them written over
    tensors the holders held before they loaded."""

    nbytes: int
    written_over: int


def detach_from_file(payload: Any, holders: list[Any], displaced: list[torch.Tensor] | None = None,
                     prints: dict[int, tuple[int, int]] | None = None) -> Detached:
    """Give every tensor that a stateful kept from a memory-mapped ``payload`` memory of its
    own; return how many bytes that copied, and how many of them went over ``displaced``.

    ``load_state_dict`` of a module copies into the module's parameters, but an optimizer
    keeps the loaded tensors themselves. Left mapped, they would be copied page by page on
    their first update and would keep the checkpoint file's blocks allocated after pruning
    deletes it. ``holders`` are the statefuls: their ``state_dict()`` returns the very tensors
    they hold, which are re-pointed (``set_``) at a private copy. The copy goes where memory
    is touched already: first into a tensor of ``displaced`` (what the holders held before
    they loaded: an optimizer that stepped before its Checkpointer was made) that nothing
    holds any more, then into the memory a warm restart's spare touched in advance
    (reserve.py), else into new memory. Freeing the displaced state and faulting in new pages
    for the same bytes cost a 64-MB restore here about 4 ms each.

    ``prints``, where given, gets the fingerprint of every copy (contents.py), by the ``id``
    of the tensor re-pointed at it, with its address: taken while the copy is in the cache,
    it costs a fifth of one read back from memory afterwards (first_step.py uses them).
    """
    mapped = {t.untyped_storage().data_ptr() for t in tensors_of(payload) if t.numel()}
    held = [t for holder in holders for t in tensors_of(holder.state_dict())]
    reusable = _unheld(displaced, held) if displaced else {}
    copied = over = 0
    try:
        with torch.no_grad():
            for t in held:
                if t.numel() and t.untyped_storage().data_ptr() in mapped:
                    same = reusable.get((t.dtype, t.shape))
                    nbytes = t.numel() * t.element_size()
                    if same:
                        own: torch.Tensor | None = same.pop()
                        over += nbytes
                    else:
                        own = reserve.take(t)
                    own = t.clone() if own is None else own.copy_(t)
                    # set_ takes a tensor too; torch's stubs name only storages.
                    t.set_(own)  # type: ignore[call-overload]
                    copied += nbytes
                    if prints is not None:
                        prints[id(t)] = (t.data_ptr(), plain_print(t))
    finally:
        reserve.release()
    return Detached(copied, over)


def _unheld(displaced: list[torch.Tensor], held: list[torch.Tensor],
            ) -> dict[tuple[torch.dtype, torch.Size], list[torch.Tensor]]:
    """The tensors of ``displaced`` that can be written over, by dtype and shape: plain dense
    host tensors that own their memory whole, whose memory no tensor of ``held`` (what the
    holders hold after their loads) shares, and that nothing else refers to (no name in
    Python, no view of their memory). It empties ``displaced`` as it goes, so that the list's
    own references are not counted; the tensors it does not keep are freed there."""
    in_use = {t.untyped_storage().data_ptr() for t in held}
    probe = torch.empty(1)
    alone = _users(probe.untyped_storage())  # a tensor's memory that it alone refers to
    found: dict[tuple[torch.dtype, torch.Size], list[torch.Tensor]] = {}
    seen: set[int] = set()
    while displaced:
        t = displaced.pop()
        storage = t.untyped_storage()
        if (storage.data_ptr() in in_use or storage.data_ptr() in seen or t.requires_grad
                or t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
                or not t.is_contiguous() or t.storage_offset() != 0 or not t.numel()
                or storage.nbytes() != t.numel() * t.element_size()):
            continue
        seen.add(storage.data_ptr())
        # Named by ``t`` (and the call's argument) alone; its memory by ``t`` alone.
        if sys.getrefcount(t) == 2 and _users(storage) == alone:
            found.setdefault((t.dtype, t.shape), []).append(t)
    return found


def _users(storage: torch.UntypedStorage) -> int:
    """How many refer to ``storage``'s memory (tensors, views, and this Python object)."""
    return int(torch._C._storage_Use_Count(storage._cdata))


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
    here the thread keeps the kernel reading ahead and checksums each piece as it lands in
    the page cache, and ``load_state_dict`` copies from pages that are already there. The
    caller must treat what it loaded as unverified until :meth:`result` returns None, and
    load something else (or give up) if it does not. Where the mapping cannot be found
    (another torch), the file is read instead.

    The thread lets the page faults map the pages (64 KiB at a time, the kernel's fault-
    around) rather than populate the page tables ahead (``MADV_POPULATE_READ``): beside the
    load's copies, populating took 5-6 ms of the thread's 12 for 64 MB, and the restore of
    a stepped optimizer ran at 3.64 GB/s without it against 2.67 (BENCHMARKS.md).
    """

    def __init__(self, payload: Any, path: Path, nbytes: int, expected_crc: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.expected_crc = expected_crc
        self._payload = payload  # keeps the mapping alive while the thread reads it
        self._problem: str | None = None
        #: Set when reading failed (EIO, a stale handle), as opposed to a wrong checksum.
        self.read_error: OSError | None = None
        pointers = [t.untyped_storage().data_ptr() for t in tensors_of(payload)
                    if t.untyped_storage().nbytes()]
        #: An address in the mapping, if there is one: the thread finds the mapping from it
        #: (reading the process's maps takes a millisecond, which the load need not wait for).
        self._inside = min(pointers) if pointers and nbytes > 0 else None
        # Not a daemon: it reads the mapping, which must outlive it.
        self._thread = threading.Thread(target=self._run, name="procckpt-verify")
        self._thread.start()

    def running(self) -> bool:
        """Whether the checksum is still being computed."""
        return self._thread.is_alive()

    def result(self) -> str | None:
        """Wait for the checksum; return why the file is unusable, or None if it is intact."""
        self._thread.join()
        self._payload = None
        return self._problem

    def _run(self) -> None:
        from ...store import file_crc32

        try:
            base = None if self._inside is None else \
                _file_mapping(self.path, self._inside, self.nbytes)
            if base is None:
                crc, size = file_crc32(self.path)
            else:
                crc, size = self._crc_of_mapping(base), self.nbytes
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
                crc = crc32(view[start:start + _READ_STEP], crc)  # (the last piece: shorter)
            return crc
        finally:
            os.close(fd)
            view.release()


def verify_mapped(payload: Any, path: Path, nbytes: int, expected_crc: int) -> str | None:
    """:class:`MappedVerification` without loading alongside: start it and wait."""
    return MappedVerification(payload, path, nbytes, expected_crc).result()
