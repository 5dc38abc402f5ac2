"""The streaming file writer: ``torch.save`` at the disk's speed, checksummed on the way.

A checkpoint of the hooks engine is one ``torch.save`` file, ``state.pt``, loadable by plain
``torch.load(weights_only=True)``. ``torch.save`` streams straight from the tensors into
:class:`StreamingFileWriter`, which checksums and writes in large pieces and starts the disk's
writeback while it goes, so the file is durable soon after its last byte is handed over. The
synchronous path (:func:`write_checkpoint`) and the background writer both end here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import torch

from ...store import CheckpointInfo, CheckpointStore, PendingCheckpoint, lasting_write_error
from ...store.checksum import crc32
from .direct import DirectWrites, direct_wanted, direct_writes
from .frozen import ChunkPlan

__all__ = ["StreamingFileWriter", "save_payload", "write_checkpoint", "lasting_errors_explained",
           "payload_bytes", "tensors_of", "torch_zip_crc_off", "CHUNK"]

#: Tensor data is checksummed and written in pieces of this size: large enough that the
#: per-piece cost (a GIL hand-over, three system calls) vanishes, small enough that the
#: disk starts writing the first piece while the next one is checksummed.
CHUNK = 32 << 20
#: Writes smaller than this (zip headers, small tensors) are gathered before writing; the
#: gathering buffer is the only memory the writer adds to the host copy.
_SMALL = 64 << 10


class StreamingFileWriter:
    """A write-only file for ``torch.save`` that writes at the disk's speed.

    Where the file system allows, the file is written around the page cache (``O_DIRECT``,
    see direct.py): the bytes are copied into a reused aligned buffer, and a helper thread
    checksums and writes each full buffer while the next one fills.

    Elsewhere (or with ``PROCCKPT_DIRECT_IO=0``) tensor data passes from the caller's memory
    straight to ``os.write`` in :data:`CHUNK` pieces (no copy); each piece is checksummed
    just before it is written, and the kernel is told to start writing it back right after
    (``POSIX_FADV_DONTNEED`` starts writeback of dirty pages without waiting), so the disk
    works while the next piece is checksummed and the final fsync has little left to do.
    Once durable, the file's pages are dropped from the page cache: a checkpoint does not
    push the training's data set out of memory.

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
        self._direct: DirectWrites | None = None
        direct = direct_wanted()
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                       0o644)
        if direct:
            try:
                self._direct = direct_writes(self._fd, self.chunk)
            except BaseException:
                self.abort()
                raise

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self._direct is not None:
            pieces = self._direct.pieces
            try:
                self.io_seconds += self._direct.put(view)
            except OSError as e:  # torch.save reports it as "unexpected pos": keep the cause
                self.error = e
                raise
            if self.pause_per_chunk and self._direct.pieces != pieces:
                time.sleep(self.pause_per_chunk)
            self.nbytes += n
            return n
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

    @property
    def position(self) -> int:
        """Bytes handed over so far (written, or gathered to be written)."""
        return self.nbytes + len(self._small)  # a direct write counts them as they come

    def fileno(self) -> int:
        assert self._fd is not None
        return self._fd

    def write_gathered(self) -> None:
        """Write what is gathered now: the file then holds every byte handed over, and its
        descriptor takes plain writes (no longer direct ones) from here on."""
        if self._direct is not None:
            try:
                self.crc = self._direct.to_plain()
            finally:
                self._direct = None
        self._flush_small()

    def finish(self) -> tuple[int, int]:
        """Write what is gathered, fsync, close; return (bytes, CRC-32) of the whole file."""
        assert self._fd is not None
        if self._direct is not None:
            try:
                self.crc, seconds = self._direct.finish()
            except OSError as e:
                self.error = e
                raise
            finally:
                self._direct.release()
            self.io_seconds += seconds
            self._direct = None
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
        if self._direct is not None:
            self._direct.release()
            self._direct = None
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


class _ZipCrcSwitch:
    """Who needs torch's zip CRC off right now; it is back as it was once none does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.before = True


_zip_crc = _ZipCrcSwitch()


@contextlib.contextmanager
def torch_zip_crc_off() -> Iterator[None]:
    """Skip the CRC-32 that torch's zip writer computes per record: the manifest already has
    one of the whole file, and a second pass over every byte would cost as much CPU as the
    first (0.14 s per 512 MiB here). Zip CRCs are not checked by ``torch.load``. The option is
    global in torch, so a ``torch.save`` that another thread runs meanwhile also skips it
    (harmlessly). Nests, and may be held by several threads at once (a writer thread's
    ``dcp.save`` while the training thread writes): the option is restored when the last
    leaves. No lock is held while the caller works."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or put is None:  # older torch: nothing to switch off
        yield
        return
    with _zip_crc.lock:
        if not _zip_crc.users:
            _zip_crc.before = get()
            put(False)
        _zip_crc.users += 1
    try:
        yield
    finally:
        with _zip_crc.lock:
            _zip_crc.users -= 1
            if not _zip_crc.users:
                put(_zip_crc.before)


def save_payload(pending: PendingCheckpoint, name: str, payload: Any,
                 plan: ChunkPlan | None = None) -> StreamingFileWriter:
    """``torch.save`` ``payload`` as file ``name`` of ``pending``; record its size and CRC.
    With a ``plan``, its frozen tensors go to the chunk store first (see frozen.py)."""
    if plan is not None:
        payload = plan.write(pending, payload)
    writer = StreamingFileWriter(pending.path / name)
    try:
        with torch_zip_crc_off():
            torch.save(payload, cast(IO[bytes], writer))  # it has what save() calls
        nbytes, crc = writer.finish()
    except BaseException as e:
        writer.abort()
        if writer.error is not None and writer.error is not e:
            raise writer.error from e
        raise
    pending.record_file(name, nbytes, crc)
    return writer


def write_checkpoint(store: CheckpointStore, meta: dict[str, Any], payload: Any,
                     name: str = "state.pt", plan: ChunkPlan | None = None) -> CheckpointInfo:
    """Write ``payload`` as a new checkpoint of ``store``; durable and in place on return.

    Raises:
        StorageError: no space or no permission: a failure that trying again would repeat.
    """
    try:
        with lasting_errors_explained(store, payload), store.begin(meta) as pending:
            save_payload(pending, name, payload, plan)
            info = pending.commit()
    except BaseException:
        if plan is not None:
            plan.failed()
        raise
    if plan is not None:
        plan.durable()
    return info


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
    for t in tensors_of(payload):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + (64 << 10)


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_of(value)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for value in obj:
            yield from tensors_of(value)
