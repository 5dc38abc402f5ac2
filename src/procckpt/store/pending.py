"""A checkpoint being written: payload files in a temporary directory, committed by one rename.

A checkpoint is built in a temporary directory beside its final place and renamed into place
only after every file and the manifest are fsynced, so a crash at any moment leaves either the
whole checkpoint or none of it under its final name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .chunks import ChunkStore
from .files import (
    ChecksumWriter,
    file_crc32,
    fsync_dir,
    open_new_file,
    plain_name,
    write_file_atomic,
)
from .manifest import CHUNKED_FORMAT, FORMAT_VERSION, MANIFEST, CheckpointInfo

__all__ = ["PendingCheckpoint", "ENV_COMMIT_PAUSE"]

#: A test seam: seconds to wait once a checkpoint's files are written, and again once its
#: manifest is, before the rename that commits it (so that the kill campaign can land kills
#: in a checkpoint's write and in its commit).
ENV_COMMIT_PAUSE = "PROCCKPT_COMMIT_PAUSE"


class PendingCheckpoint:
    """A checkpoint being written. Write payload files with :meth:`open` or :meth:`add_file`,
    then :meth:`commit`; leaving the ``with`` block without a commit removes it."""

    def __init__(self, ckpt_root: Path, seq: int, meta: dict[str, Any],
                 next_seq: Callable[[], int],
                 adopt: Callable[[PendingCheckpoint], None] | None = None,
                 chunk_store: ChunkStore | None = None,
                 publish: Callable[[CheckpointInfo], None] | None = None) -> None:
        self.ckpt_root = ckpt_root
        self.seq = seq
        self.meta = dict(meta)
        self._next_seq = next_seq  # asked again if another writer took ``seq`` meanwhile
        self.tmp = ckpt_root / f".tmp-ckpt-{seq:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=False)
        self.files: dict[str, dict[str, int]] = {}
        #: Chunks the checkpoint lists (see chunks.py), and the bytes of those written now.
        self.chunks: dict[str, int] = {}
        self.chunk_bytes_written = 0
        self._chunk_store = chunk_store
        #: Called once the checkpoint is in place, before it counts: its upload (remote.py).
        self._publish = publish
        self._committed = False
        #: Called once before the manifest is written, to add files written by others (a
        #: framework's own checkpoint files) with :meth:`adopt_file`.
        self._adopt = adopt

    def __enter__(self) -> PendingCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            self.abort()

    @property
    def path(self) -> Path:
        """The temporary directory; engines that write files themselves write here."""
        return self.tmp

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[ChecksumWriter]:
        """Open payload file ``name`` for writing; its size and CRC go into the manifest."""
        _check_name(name)
        with open_new_file(self.tmp / name) as raw:
            writer = ChecksumWriter(raw)
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
        self.files[name] = {"bytes": writer.nbytes, "crc32": writer.crc}

    def add_file(self, name: str) -> None:
        """Record a payload file that an engine already wrote into :attr:`path`."""
        _check_name(name)
        target = self.tmp / name
        with open(target, "rb") as f:
            os.fsync(f.fileno())
        crc, size = file_crc32(target)
        self.files[name] = {"bytes": size, "crc32": crc}

    def record_file(self, name: str, nbytes: int, crc32: int) -> None:
        """Record a payload file that an engine wrote into :attr:`path` and fsynced itself,
        with the size and CRC-32 it computed while writing (saves reading it back)."""
        _check_name(name)
        self.files[name] = {"bytes": nbytes, "crc32": crc32}

    def put_chunk(self, data: memoryview) -> str:
        """Store ``data`` as a chunk of this checkpoint (written only if the dir's chunk
        store lacks it); return its id. Durable on return."""
        if self._chunk_store is None:
            raise StoreError("this checkpoint has no chunk store")
        chunk_id, written = self._chunk_store.put(data)
        self.chunks[chunk_id] = len(data)
        self.chunk_bytes_written += len(data) if written else 0
        return chunk_id

    def put_chunk_file(self, source: Path) -> tuple[str, int]:
        """Move file ``source`` (fsynced, on this file system) into the dir's chunk store as
        a chunk of this checkpoint; return its id and size. Durable on return."""
        if self._chunk_store is None:
            raise StoreError("this checkpoint has no chunk store")
        chunk_id, nbytes, written = self._chunk_store.put_file(source)
        self.chunks[chunk_id] = nbytes
        self.chunk_bytes_written += nbytes if written else 0
        return chunk_id, nbytes

    def list_chunk(self, chunk_id: str, nbytes: int) -> bool:
        """List a chunk the store holds already (written by an earlier checkpoint); False
        if it is not there (then the caller writes it with :meth:`put_chunk`)."""
        if self._chunk_store is None or not self._chunk_store.has(chunk_id, nbytes):
            return False
        self.chunks[chunk_id] = nbytes
        return True

    def adopt_file(self, source: Path, copy: bool = False) -> None:
        """Move file ``source`` (written and closed by someone else) into the checkpoint,
        under its own name; copied where it is on another file system, or with ``copy``
        (the source stays: it is someone else's)."""
        target = self.tmp / source.name
        _check_name(source.name)
        if target.exists():
            raise StoreError(f"{source.name} is in the checkpoint already")
        if copy:
            shutil.copyfile(source, target)
            self.add_file(source.name)
            return
        try:
            os.rename(source, target)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            shutil.copyfile(source, target)
            os.unlink(source)
        self.add_file(source.name)

    def commit(self) -> CheckpointInfo:
        """Write the manifest and rename the checkpoint into place. Durable on return."""
        if self._adopt is not None:
            adopt, self._adopt = self._adopt, None
            adopt(self)
        if not self.files:
            raise StoreError("refusing to commit a checkpoint with no payload files")
        pause = float(os.environ.get(ENV_COMMIT_PAUSE) or 0)
        time.sleep(pause)
        file_bytes = sum(f["bytes"] for f in self.files.values())
        manifest = {
            "format": FORMAT_VERSION,
            "seq": self.seq,
            "time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "files": self.files,
            "bytes": file_bytes,
            **self.meta,
        }
        if self.chunks:
            manifest.update(format=CHUNKED_FORMAT, chunks=self.chunks,
                            bytes=file_bytes + sum(self.chunks.values()),
                            written=file_bytes + self.chunk_bytes_written)
        with open_new_file(self.tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        time.sleep(pause)
        final = self.ckpt_root / f"ckpt-{self.seq:08d}"
        if final.exists():  # another writer took this number: take the next free one
            self.seq = self._next_seq()
            manifest["seq"] = self.seq
            write_file_atomic(self.tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            final = self.ckpt_root / f"ckpt-{self.seq:08d}"
        os.rename(self.tmp, final)
        fsync_dir(self.ckpt_root)
        self._committed = True
        info = CheckpointInfo(final, self.seq, manifest)
        if self._publish is not None:  # a failure leaves the local checkpoint in place
            self._publish(info)
        return info

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _check_name(name: str) -> None:
    if not plain_name(name) or name == MANIFEST or name.startswith(".tmp-"):
        raise StoreError(f"bad payload file name {name!r}")
