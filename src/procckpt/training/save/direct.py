"""Checkpoint files written around the page cache (``O_DIRECT``), from a few reused buffers.

A checkpoint is written once and not read again until a restart, so passing it through the
page cache only costs: the kernel copies every byte into cache pages, the writer has to push
them out (and drop them, so as not to evict the training's data), and the pages themselves
must be found. That last part is not free everywhere: in a virtual machine whose free memory
is handed back to the host (free page reporting, as on this project's Firecracker machines),
pages that were freed a few seconds earlier are faulted in again from the host one by one:
writing 512 MiB into the page cache took 1.2-1.8 s there against 0.32 s with ``O_DIRECT``
(the disk's speed), and a checkpoint is exactly a write that comes seconds after the last
one's pages were dropped.

:class:`DirectWrites` copies what it is given into one of two aligned buffers (the only copy,
as the kernel's would be) and, once a buffer is full, checksums and writes it on a helper
thread while the caller fills the other. The buffers are kept in a small pool and reused, so
their memory stays allocated (and warm). Where the file system refuses ``O_DIRECT``, or
``PROCCKPT_DIRECT_IO=0``, the caller writes through the page cache as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time

import numpy as np

from ...protocol.switches import DIRECT_IO
from ...store.checksum import crc32

__all__ = ["DirectWrites", "direct_wanted", "direct_writes", "ALIGN", "PIECE", "ENV_DIRECT"]

#: ``PROCCKPT_DIRECT_IO=0`` writes checkpoints through the page cache instead.
ENV_DIRECT = DIRECT_IO.name
#: Offsets, lengths and buffer addresses of direct writes are multiples of this (4 KiB
#: covers devices with 512-byte and with 4 KiB logical blocks).
ALIGN = 4096
#: Bytes per direct write: large enough that the per-write cost vanishes, small enough that
#: two buffers are little memory and the copy of one overlaps the write of the other.
PIECE = 8 << 20
#: Buffers kept for reuse once their writer is done (two per file being written).
_POOL_SIZE = 4


class _Pool:
    """Page-aligned buffers of :data:`PIECE` bytes, reused from one file to the next."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = mmap.mmap(-1, PIECE)  # anonymous mappings start page-aligned
        # Like the arena: a forked child (a DataLoader worker) does not share these pages,
        # so writing them later copies nothing.
        if hasattr(mmap, "MADV_DONTFORK"):
            buf.madvise(mmap.MADV_DONTFORK)
        return buf

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < _POOL_SIZE:
                self._free.append(buf)
                return
        with contextlib.suppress(BufferError):  # a view still held: the collector closes it
            buf.close()


_pool = _Pool()


def direct_wanted() -> bool:
    """Whether files should be written directly (``PROCCKPT_DIRECT_IO``, on unless 0).

    Raises:
        UsageError: ``PROCCKPT_DIRECT_IO`` is neither on nor off.
    """
    return DIRECT_IO.read() and hasattr(os, "O_DIRECT")


def direct_writes(fd: int, piece: int = PIECE) -> DirectWrites | None:
    """Switch ``fd`` (a new, empty file open for writing) to direct writes and return the
    object that makes them, or None (``fd`` unchanged) where the file system refuses:
    write through the page cache then."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    return DirectWrites(fd, piece)


class DirectWrites:
    """Direct writes of one file, in order: the caller :meth:`put` s bytes, a helper thread
    checksums and writes each full buffer, :meth:`finish` writes the rest and sets the
    file's length. Errors of the helper thread are raised in the caller's next call."""

    def __init__(self, fd: int, piece: int = PIECE) -> None:
        self.fd = fd
        #: Bytes per write: ``piece`` rounded up to :data:`ALIGN`, at most :data:`PIECE`.
        self.piece = min(PIECE, max(ALIGN, -(-piece // ALIGN) * ALIGN))
        self.crc = 0
        #: Bytes in the file so far (whole pieces).
        self.written = 0
        #: Full buffers handed to the helper so far.
        self.pieces = 0
        self._bufs = [_pool.take(), _pool.take()]
        self._arrays = [np.frombuffer(b, dtype=np.uint8) for b in self._bufs]
        self._current = 0
        self._used = 0
        self._writing: threading.Thread | None = None
        self._error: BaseException | None = None

    def put(self, view: memoryview) -> float:
        """Copy ``view`` into the buffers, handing each full one to the helper thread.
        Returns the seconds spent outside the GIL (copying, waiting for the helper)."""
        source = np.frombuffer(view, dtype=np.uint8)
        io = 0.0
        done = 0
        while done < len(source):
            take = min(len(source) - done, self.piece - self._used)
            started = time.perf_counter()
            # numpy copies large blocks without holding the GIL
            self._arrays[self._current][self._used:self._used + take] = source[done:done + take]
            io += time.perf_counter() - started
            self._used += take
            done += take
            if self._used == self.piece:
                io += self._hand_over()
        return io

    def finish(self) -> tuple[int, float]:
        """Write what is left (padded to :data:`ALIGN`, then the file cut to its true length);
        return (CRC-32 of the file, seconds outside the GIL). The caller fsyncs."""
        started = time.perf_counter()
        self._wait()
        tail = self._used
        if tail:
            padded = -(-tail // ALIGN) * ALIGN
            array = self._arrays[self._current]
            array[tail:padded] = 0
            self.crc = crc32(memoryview(self._bufs[self._current])[:tail], self.crc)
            length = self.written + tail
            self._write_all(memoryview(self._bufs[self._current])[:padded])
            os.ftruncate(self.fd, length)  # the padding goes
            self.written = length
            self._used = 0
        self.release()
        return self.crc, time.perf_counter() - started

    def to_plain(self) -> int:
        """Turn the descriptor back into a plain (page cache) one, writing what is gathered
        first: the file then holds every byte put. Returns the CRC-32 so far."""
        self._wait()
        _plain(self.fd)
        if self._used:
            rest = memoryview(self._bufs[self._current])[:self._used]
            self.crc = crc32(rest, self.crc)
            self._write_all(rest)
            self._used = 0
        self.release()
        return self.crc

    def release(self) -> None:
        """Wait for the helper (ignoring its error) and give the buffers back; idempotent."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        bufs, self._bufs, self._arrays = self._bufs, [], []
        for buf in bufs:
            _pool.give(buf)

    def _hand_over(self) -> float:
        """Start writing the full current buffer; switch to the other one."""
        started = time.perf_counter()
        self._wait()  # the other buffer's write: it must be done before we fill it
        view = memoryview(self._bufs[self._current])[:self.piece]

        def write() -> None:
            try:
                self.crc = crc32(view, self.crc)
                self._write_all(view)
            except BaseException as e:  # noqa: BLE001 - raised in the caller's next call
                self._error = e

        # Not a daemon, as the writer thread (see BackgroundSaver.reserve): always joined.
        self._writing = threading.Thread(target=write, name="procckpt-direct", daemon=False)
        self._writing.start()
        self.pieces += 1
        self._current ^= 1
        self._used = 0
        return time.perf_counter() - started

    def _wait(self) -> None:
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write_all(self, view: memoryview) -> None:
        while view:
            n = os.write(self.fd, view)
            self.written += n
            view = view[n:]
            if view and n % ALIGN:  # a short write left the rest unaligned: finish plainly
                _plain(self.fd)


def _plain(fd: int) -> None:
    """Turn ``O_DIRECT`` off on ``fd``: its writes go through the page cache again."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
