"""The store's file primitives: atomic writes, no links followed, bounded and retried reads, CRC-32.

Every file procckpt writes is new (``O_EXCL``) and opened without following links; every
small file it reads must be a regular file of bounded size, so a link or a device planted in
the checkpoint dir is refused instead of followed or read forever.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
import uuid
from pathlib import Path
from typing import IO, Any

from ..errors import CheckpointReadError, StorageError
from .checksum import crc32 as checksum_crc32

__all__ = ["MEMORY_FS_TYPES", "fs_type", "is_within", "fsync_dir", "plain_name",
           "read_small_file", "open_new_file", "lasting_write_error",
           "read_with_retries", "write_file_atomic", "ChecksumWriter", "file_crc32",
           "READ_RETRY_PAUSES", "format_size", "modified"]

logger = logging.getLogger(__name__)

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
READ_RETRY_PAUSES = (0.2, 0.5, 1.0)
#: Write errors that will happen again on the next try: no restart can get past them.
_LASTING_WRITE_ERRORS = {errno.ENOSPC: "no space", errno.EDQUOT: "no space",
                         errno.EACCES: "permission", errno.EPERM: "permission",
                         errno.EROFS: "read-only"}


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


def read_with_retries(path: Path, read: Any, pauses: tuple[float, ...] = READ_RETRY_PAUSES,
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


def write_file_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new content, never a mix.

    The temporary file lives beside the target because rename is atomic only within one
    filesystem; its name is unique so that two writers never share one. ``durable=False``
    skips the fsyncs, for files that only say how things are now (a heartbeat).
    """
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open_new_file(tmp) as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
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


def format_size(n: float) -> str:
    """A byte count as people read it: ``512 B``, ``18.6 KB``, ``1.5 GB`` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def modified(path: Path) -> float:
    """``path``'s modification time; 0 when it is gone (another cleaner took it)."""
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


#: File systems whose files live in memory (gone with the node, or at its reboot).
MEMORY_FS_TYPES = ("tmpfs", "ramfs")


def fs_type(path: Path, mounts_text: str | None = None) -> str | None:
    """The type of the file system ``path`` is on: the deepest mount point above it in
    ``/proc/mounts`` (or ``mounts_text``); None where that cannot be read."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return None
    path = path.resolve()
    best, found = "", None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if is_within(path, mount) and len(mount) >= len(best):
            best, found = mount, parts[2]
    return found


def is_within(path: Path, root: str) -> bool:
    """Whether ``path`` (resolved by the caller) is ``root`` or below it (resolved here)."""
    try:
        path.relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False
