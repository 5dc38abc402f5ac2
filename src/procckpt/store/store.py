"""The checkpoint directory: atomic writes, manifests with checksums, lock, keep-N, fallback.

Layout of a checkpoint directory::

    DIR/
      .procckpt                 marker: this directory belongs to procckpt (format version)
      lock                      flock()ed by the process that owns the run; says who in its text
      events.jsonl              the journal (see events.py)
      control/                  launcher <-> training process requests and acks (see control.py)
      COMPLETE                  written once the training finished
      checkpoints/
        ckpt-00000007/          one directory per checkpoint, named by a sequence number
          state.pt              payload file(s), written by an engine
          MANIFEST.json         written last: sizes and CRC-32 of every payload file
        .tmp-ckpt-...           a checkpoint being written; never loaded, removed at start

A checkpoint is built in a temporary directory beside its final place and renamed into place
only after every file and the manifest are fsynced, so a crash at any moment leaves either the
whole checkpoint or none of it under its final name. The manifest's checksums catch what the
rename cannot: a disk or copy that later truncates or flips bits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .checksum import crc32 as checksum_crc32
from ..errors import (CheckpointCorruptError, CheckpointReadError, LockedError, StorageError,
                     StoreError)

__all__ = [
    "CheckpointInfo",
    "CheckpointStore",
    "PendingCheckpoint",
    "DirLock",
    "FORMAT_VERSION",
    "MANIFEST",
    "read_with_retries",
    "read_small_file",
    "lasting_write_error",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = ".procckpt"
MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})$")
_CHUNK = 8 << 20
#: Files procckpt writes are opened with these: a symbolic link planted inside the checkpoint
#: dir (``lock -> /etc/passwd``) is refused instead of followed.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Small files procckpt reads (manifests, markers, control files) are at most this large.
_SMALL_FILE_LIMIT = 16 << 20
#: Errors that mean the file is missing or is not a plain file (a link, a device), i.e. the
#: checkpoint is damaged; every other OSError on a read is the storage's fault.
_DAMAGED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
#: Tries, and the pause before each retry, of a read that failed with an I/O error.
_READ_RETRY_PAUSES = (0.2, 0.5, 1.0)
#: Write errors that will happen again on the next try: no restart can get past them.
_LASTING_WRITE_ERRORS = {errno.ENOSPC: "no space", errno.EDQUOT: "no space",
                         errno.EACCES: "permission", errno.EPERM: "permission",
                         errno.EROFS: "read-only"}


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as its manifest describes it."""

    path: Path
    seq: int
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def step(self) -> int | None:
        return self.manifest.get("step")

    @property
    def epoch(self) -> int | None:
        return self.manifest.get("epoch")

    @property
    def nbytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.manifest.get("files", {}).values())

    @property
    def created(self) -> float:
        return float(self.manifest.get("time", 0.0))

    @property
    def metric(self) -> float | None:
        value = self.manifest.get("metric")
        return None if value is None else float(value)

    def file(self, name: str) -> Path:
        return self.path / name


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_name(name: object) -> bool:
    """Whether ``name`` names a file directly inside a directory: no separator, not ``..``."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\0" not in name)


def read_small_file(path: Path, limit: int = _SMALL_FILE_LIMIT) -> bytes:
    """The content of the regular file ``path`` (a link, a device or a FIFO is refused with
    ``OSError``); at most ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ELOOP, "not a regular file", str(path))
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_new_file(path: Path, mode: str = "wb") -> IO[Any]:
    """Create ``path``, which must not exist (not even as a link), and open it for writing."""
    return os.fdopen(os.open(path, _NEW_FILE, 0o644), mode)


def lasting_write_error(error: BaseException, root: Path, need: int | None = None,
                        ) -> StorageError | None:
    """The one-line error for a write into ``root`` that failed in a way that would fail
    again (no space, no permission, read-only); None for any other failure."""
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    if cause is None or cause.errno not in _LASTING_WRITE_ERRORS:
        return None
    kind = _LASTING_WRITE_ERRORS[cause.errno]
    if kind == "no space":
        try:
            st = os.statvfs(root)
            free = f"{st.f_bavail * st.f_frsize:,} free"
        except OSError:
            free = "free space unknown"
        needed = f"need {need:,} bytes" if need is not None else "a checkpoint needs more"
        return StorageError(f"no space left in {root}: {needed}, {free}; make room (or lower "
                            "--keep) and run again: the previous checkpoint is intact")
    return StorageError(f"cannot write checkpoints in {root}: {cause.strerror}; fix its "
                        "permissions or choose another --dir: the previous checkpoint is intact")


def read_with_retries(path: Path, read: Any, pauses: tuple[float, ...] = _READ_RETRY_PAUSES,
                      ) -> Any:
    """``read()``, tried again after each of ``pauses`` if it fails with an I/O error (a stale
    NFS handle, a flaky mount); a file that is missing is not retried.

    Raises:
        OSError: the file is missing or not a regular file (damage, not the storage's fault).
        CheckpointReadError: it could not be read after the retries.
    """
    for pause in (*pauses, None):
        try:
            return read()
        except OSError as e:
            if e.errno in _DAMAGED:
                raise
            if pause is None:
                raise CheckpointReadError(
                    f"cannot read {path}: {e.strerror or e} (errno {e.errno}); nothing was "
                    "renamed or deleted: fix the file system or permissions and run again"
                ) from e
            logger.warning("reading %s failed (%s); trying again", path, e.strerror or e)
            time.sleep(pause)
    raise AssertionError("unreachable")


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new content, never a mix.

    The temporary file lives beside the target because rename is atomic only within one
    filesystem; its name is unique so that two writers never share one.
    """
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open_new_file(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


class ChecksumWriter:
    """A write-only file object that counts bytes and computes CRC-32 of what passes through."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.crc = 0
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = checksum_crc32(view, self.crc)
        self.nbytes += len(view)
        return self._raw.write(view)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


def file_crc32(path: Path) -> tuple[int, int]:
    """Return (crc32, size) of the file at ``path``, read in large chunks.

    The kernel is asked to read the next chunk ahead (``POSIX_FADV_WILLNEED``) while this one
    is checksummed, so that a cold read runs at the disk's speed, not disk + CRC.
    """
    crc = 0
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb",
                   buffering=0) as f:
        fd = f.fileno()
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, size + _CHUNK, _CHUNK, os.POSIX_FADV_WILLNEED)
            n = f.readinto(buf)
            if not n:
                break
            crc = checksum_crc32(view[:n], crc)
            size += n
    return crc, size


class PendingCheckpoint:
    """A checkpoint being written. Write payload files with :meth:`open` or :meth:`add_file`,
    then :meth:`commit`; leaving the ``with`` block without a commit removes it."""

    def __init__(self, store: CheckpointStore, seq: int, meta: dict[str, Any]) -> None:
        self.store = store
        self.seq = seq
        self.meta = dict(meta)
        self.tmp = store.ckpt_root / f".tmp-ckpt-{seq:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=False)
        self.files: dict[str, dict[str, int]] = {}
        self._committed = False

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

    def commit(self) -> CheckpointInfo:
        """Write the manifest and rename the checkpoint into place. Durable on return."""
        if not self.files:
            raise StoreError("refusing to commit a checkpoint with no payload files")
        manifest = {
            "format": FORMAT_VERSION,
            "seq": self.seq,
            "time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "files": self.files,
            "bytes": sum(f["bytes"] for f in self.files.values()),
            **self.meta,
        }
        with open_new_file(self.tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        final = self.store.ckpt_root / f"ckpt-{self.seq:08d}"
        if final.exists():  # another writer took this number: take the next free one
            self.seq = self.store.next_seq()
            manifest["seq"] = self.seq
            write_file_atomic(self.tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            final = self.store.ckpt_root / f"ckpt-{self.seq:08d}"
        os.rename(self.tmp, final)
        fsync_dir(self.store.ckpt_root)
        self._committed = True
        return CheckpointInfo(final, self.seq, manifest)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _check_name(name: str) -> None:
    if not plain_name(name) or name == MANIFEST or name.startswith(".tmp-"):
        raise StoreError(f"bad payload file name {name!r}")


@dataclass
class DirLock:
    """An exclusive ``flock`` on ``DIR/lock``; the kernel drops it when its holder dies,
    so a lock left by a dead process is taken over without any clean-up."""

    path: Path
    _fd: int | None = field(default=None, repr=False)

    def acquire(self, purpose: str = "run") -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(f"{self.path} is a symbolic link, and procckpt follows no links "
                                 "inside its checkpoint dir: remove it and run again") from e
            raise StoreError(f"cannot open {self.path}: {e.strerror}; fix the checkpoint dir's "
                             "permissions or choose another --dir") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"{self.path} is not a regular file: remove it and run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise StoreError(f"cannot lock {self.path}: {e.strerror}") from e
            holder = self.holder()
            who = (
                f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('purpose', 'run')})"
                if holder
                else "another process"
            )
            raise LockedError(
                f"checkpoint dir {self.path.parent} is in use by {who}; wait for it to end "
                "or use another --dir"
            ) from e
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "purpose": purpose}
        try:  # who holds it, for messages; the flock alone is the lock (a full disk keeps it)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        except OSError as e:
            logger.warning("could not note this process in %s (%s); the lock holds anyway",
                           self.path, e.strerror)
        self._fd = fd

    def holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(read_small_file(self.path) or b"null")
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with the shape of a parsed manifest, or None: every field procckpt reads
    must have the type it expects, and every file must be a plain name in the checkpoint."""
    if not isinstance(manifest, dict):
        return "not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no files"
    for name, entry in files.items():
        if not plain_name(name) or name == MANIFEST:
            return f"file name {name!r} is not a plain name inside the checkpoint"
        if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
                and entry.get(k) >= 0 for k in ("bytes", "crc32")):
            return f"entry of {name!r} has no whole-number bytes and crc32"
    for key in ("step", "epoch", "batch", "seq", "world_size"):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{key} is {value!r}, not a whole number"
    dmtcp = manifest.get("dmtcp")
    if dmtcp is not None:
        images = dmtcp.get("images") if isinstance(dmtcp, dict) else None
        if not isinstance(images, list) or not all(n in files for n in images):
            return "its DMTCP images are not files of the checkpoint"
    for key in ("time", "metric", "write_seconds"):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"{key} is {value!r}, not a number"
    return None


class CheckpointStore:
    """A checkpoint directory. ``open()`` must be called before anything else."""

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 2) -> None:
        if keep < 1:
            raise StoreError(f"keep must be at least 1, got {keep}")
        self.root = Path(root).absolute()
        self.keep = keep
        self.ckpt_root = self.root / "checkpoints"
        self.control_dir = self.root / "control"
        self.events_path = self.root / "events.jsonl"
        self.complete_path = self.root / COMPLETE

    # -- set-up -----------------------------------------------------------------------------
    def open(self, *, create: bool = True) -> CheckpointStore:
        """Check that the directory is ours and writable, creating it if needed.

        Raises:
            StoreError: the directory is unwritable, is a file, or holds someone else's files.
        """
        try:
            return self._open(create)
        except OSError as e:
            raise StoreError(f"cannot use checkpoint dir {self.root}: {e.strerror or e}; fix its "
                             "permissions or choose another with --dir") from e

    def _open(self, create: bool) -> CheckpointStore:
        root = self.root
        if root.exists() and not root.is_dir():
            raise StoreError(f"checkpoint dir {root} is a file; pass a directory with --dir")
        if root.is_dir():
            marker = root / MARKER
            if not marker.exists():
                others = [p.name for p in root.iterdir()][:3]
                if others:
                    raise StoreError(
                        f"{root} is not a procckpt checkpoint dir (it holds {', '.join(others)}"
                        f"{', ...' if len(others) == 3 else ''}); pick a new or empty directory"
                    )
            else:
                self._check_marker(marker)
        elif not create:
            raise StoreError(f"checkpoint dir {root} does not exist")
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.ckpt_root.mkdir(exist_ok=True)
            self.control_dir.mkdir(exist_ok=True)
            marker = root / MARKER
            if not marker.exists():
                write_file_atomic(marker, json.dumps({"format": FORMAT_VERSION,
                                                      "created": time.time()}).encode())
            probe = root / f".tmp-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            probe.write_bytes(b"")
            probe.unlink()
        except PermissionError as e:
            raise StoreError(
                f"checkpoint dir {root} is not writable ({e.strerror}); fix its permissions "
                "or choose another with --dir"
            ) from e
        except OSError as e:
            raise StoreError(f"cannot use checkpoint dir {root}: {e.strerror or e}") from e
        return self

    @staticmethod
    def _check_marker(marker: Path) -> None:
        try:
            text = read_small_file(marker)
        except OSError as e:
            raise StoreError(f"cannot read {marker}: {e.strerror}; fix the checkpoint dir's "
                             "permissions or choose another --dir") from e
        try:
            fmt = json.loads(text).get("format")
        except (ValueError, AttributeError) as e:
            raise StoreError(f"{marker} is damaged; pick a new directory") from e
        if fmt != FORMAT_VERSION:
            raise StoreError(
                f"{marker.parent} was written by an incompatible procckpt (format {fmt}, "
                f"this one reads {FORMAT_VERSION}); use the matching version or a new --dir"
            )

    def lock(self, purpose: str = "run") -> DirLock:
        """Take the directory's lock; raises LockedError if a live process holds it."""
        lock = DirLock(self.root / "lock")
        lock.acquire(purpose)
        return lock

    def clean_temporaries(self) -> list[Path]:
        """Remove checkpoints that a crash left half-written. Call while holding the lock."""
        removed = []
        for parent in (self.ckpt_root, self.root, self.control_dir):
            if not parent.is_dir():
                continue
            for p in parent.iterdir():
                if p.name.startswith(".tmp-"):
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            p.unlink()
                    removed.append(p)
        if removed:
            logger.info("removed %d unfinished temporary file(s) from an earlier crash",
                        len(removed))
        return removed

    # -- writing ----------------------------------------------------------------------------
    def next_seq(self) -> int:
        seqs = [self._seq_of(p) for p in self._ckpt_dirs(include_bad=True)]
        return max(seqs, default=0) + 1

    def begin(self, meta: dict[str, Any]) -> PendingCheckpoint:
        """Start a new checkpoint; ``meta`` (step, epoch, reason, ...) goes into its manifest."""
        return PendingCheckpoint(self, self.next_seq(), meta)

    def prune(self) -> list[Path]:
        """Delete old checkpoints: keep the newest ``keep`` valid ones and the best one.

        Only checkpoints older than the newest kept one are deleted, and never the last
        valid checkpoint, so a failure here can cost disk space but never the run.
        """
        infos = self.checkpoints()
        keep: set[Path] = {i.path for i in infos[: self.keep]}
        best = self.best(infos)
        if best is not None:
            keep.add(best.path)
        removed = []
        for info in infos[self.keep:]:
            if info.path not in keep:
                # Rename first: a crash in the middle of rmtree then leaves a temporary that
                # the next start removes, not a half-deleted checkpoint that looks corrupt.
                doomed = self.ckpt_root / f".tmp-delete-{info.name}-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(info.path, doomed)
                except OSError:
                    continue
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(info.path)
        return removed

    # -- reading ----------------------------------------------------------------------------
    def _ckpt_dirs(self, include_bad: bool = False) -> list[Path]:
        if not self.ckpt_root.is_dir():
            return []
        dirs = [p for p in self.ckpt_root.iterdir() if _CKPT_RE.match(p.name.split(".")[0])
                and (include_bad or _CKPT_RE.match(p.name))]
        return sorted(dirs, key=self._seq_of, reverse=True)

    @staticmethod
    def _seq_of(path: Path) -> int:
        return int(path.name.split(".")[0].split("-")[1])

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest parses, newest first (contents not verified);
        one whose manifest cannot be read right now is left out."""
        infos = []
        for p in self._ckpt_dirs():
            try:
                manifest = self._read_manifest(p, retry=False)
            except CheckpointReadError:
                continue
            if manifest is not None:
                infos.append(CheckpointInfo(p, self._seq_of(p), manifest))
        return infos

    @staticmethod
    def _read_manifest(path: Path, retry: bool = True) -> dict[str, Any] | None:
        """The manifest of the checkpoint at ``path``; None if it is missing or malformed.

        Raises:
            CheckpointReadError: it exists but cannot be read (permissions, I/O).
        """
        manifest, _ = CheckpointStore._manifest_and_problem(path, retry)
        return manifest

    @staticmethod
    def _manifest_and_problem(path: Path, retry: bool = True,
                              ) -> tuple[dict[str, Any] | None, str | None]:
        """The checkpoint's manifest if it is usable, else None and why not.

        Raises:
            CheckpointReadError: it exists but cannot be read (permissions, I/O).
        """
        target = path / MANIFEST
        pauses = _READ_RETRY_PAUSES if retry else ()
        try:
            manifest = json.loads(read_with_retries(target, lambda: read_small_file(target),
                                                    pauses))
        except FileNotFoundError:
            return None, "its manifest is missing"
        except OSError as e:
            return None, f"its manifest is not a regular file ({e.strerror})"
        except (ValueError, UnicodeDecodeError):
            return None, "its manifest is not valid JSON"
        problem = manifest_problem(manifest)
        if problem is not None:
            return None, f"its manifest is malformed ({problem})"
        return manifest, None

    def verify(self, path: Path, *, skip_crc: frozenset[str] = frozenset()) -> str | None:
        """Return why the checkpoint at ``path`` cannot be used, or None if it is intact.

        ``skip_crc`` names files whose checksum the caller verifies itself (an engine that
        checksums a file while mapping it in); their presence and size are still checked.
        """
        manifest, problem = self._manifest_and_problem(path)
        if manifest is None:
            return problem
        if manifest.get("format") != FORMAT_VERSION:
            return f"it has format {manifest.get('format')}, expected {FORMAT_VERSION}"
        for name, expect in manifest["files"].items():
            target = path / name
            try:
                st = read_with_retries(target, lambda: os.lstat(target))  # noqa: B023
            except FileNotFoundError:
                return f"{name} is missing"
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file"
            if st.st_size != expect["bytes"]:
                return f"{name} has {st.st_size} bytes, the manifest says {expect['bytes']}"
            if name in skip_crc:
                continue
            try:
                crc, _ = read_with_retries(target, lambda: file_crc32(target))  # noqa: B023
            except OSError:
                return f"{name} is missing or was replaced while being read"
            if crc != expect["crc32"]:
                return f"{name} fails its checksum (the file is corrupt)"
        return None

    def valid_checkpoints(self, *, skip_crc: frozenset[str] = frozenset(),
                          ) -> Iterator[CheckpointInfo]:
        """Yield intact checkpoints, newest first; each damaged one is logged loudly and
        moved aside as ``ckpt-N.corrupt`` (kept for inspection, never loaded again).
        ``skip_crc``: see :meth:`verify`."""
        for p in self._ckpt_dirs():
            problem = self.verify(p, skip_crc=skip_crc)
            if problem is None:
                manifest = self._read_manifest(p)
                assert manifest is not None
                yield CheckpointInfo(p, self._seq_of(p), manifest)
                continue
            self.quarantine(p, problem)

    def quarantine(self, path: Path, problem: str) -> None:
        """Log that the checkpoint at ``path`` is unusable and move it aside."""
        logger.warning("checkpoint %s is unusable: %s; falling back to the previous one",
                       path.name, problem)
        with contextlib.suppress(OSError):
            os.rename(path, path.with_name(path.name + ".corrupt"))
        from ..protocol.events import append_event  # local: the store is below the protocol

        append_event(self.events_path, "corrupt", checkpoint=path.name, problem=problem)

    def latest_valid(self) -> CheckpointInfo | None:
        """The newest intact checkpoint, None if there never was one.

        Raises:
            CheckpointCorruptError: checkpoints exist but every one of them is damaged; starting
                from scratch silently would throw the run away.
        """
        for info in self.valid_checkpoints():
            return info
        if self._ckpt_dirs(include_bad=True):
            raise CheckpointCorruptError(
                f"every checkpoint in {self.ckpt_root} is damaged (see the warnings above); "
                "refusing to start from scratch: move the directory away to train anew"
            )
        return None

    @staticmethod
    def best(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
        scored = [i for i in infos if i.metric is not None]
        if not scored:
            return None
        mode = scored[0].manifest.get("metric_mode", "max")
        return (max if mode == "max" else min)(scored, key=lambda i: i.metric)  # type: ignore[arg-type,return-value]

    # -- completion -------------------------------------------------------------------------
    def is_complete(self) -> dict[str, Any] | None:
        """What the finished run noted in ``COMPLETE``; None while training is not done."""
        try:
            record = json.loads(read_small_file(self.complete_path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict):
            return record
        try:
            return {"time": os.lstat(self.complete_path).st_mtime}
        except OSError:
            return {"time": time.time()}

    def mark_complete(self, **fields: Any) -> None:
        write_file_atomic(self.complete_path,
                          json.dumps({"time": time.time(), **fields}).encode())

    def archive(self) -> Path | None:
        """Move checkpoints and the completion marker into ``previous-<time>/`` (for --force):
        training starts anew without deleting what an earlier run produced."""
        if not self._ckpt_dirs(include_bad=True) and not self.complete_path.exists():
            return None
        dest = self.root / time.strftime("previous-%Y%m%d-%H%M%S")
        dest.mkdir()
        os.rename(self.ckpt_root, dest / "checkpoints")
        if self.complete_path.exists():
            os.rename(self.complete_path, dest / COMPLETE)
        self.ckpt_root.mkdir()
        fsync_dir(self.root)
        return dest
