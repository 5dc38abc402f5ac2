"""The checkpoint dir's lock: one run (or one ``procckpt`` command that changes it) at a time."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LockedError, StoreError
from .files import read_small_file

__all__ = ["DirLock", "machine_id"]

logger = logging.getLogger(__name__)


@dataclass
class DirLock:
    """An exclusive ``flock`` on ``DIR/lock``; the kernel drops it when its holder dies,
    so a lock left by a dead process is taken over without any clean-up.

    The file is readable by its owner alone (0600): ``flock`` needs only a descriptor open for
    reading, so a file others can read is one they can lock, blocking the owner's runs.
    """

    path: Path
    _fd: int | None = field(default=None, repr=False)

    def acquire(self, purpose: str = "run") -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(f"{self.path} is a symbolic link, and procckpt follows no links "
                                 "inside its checkpoint dir: remove it and run again") from e
            raise StoreError(f"cannot open {self.path}: {e.strerror}; fix the checkpoint dir's "
                             "permissions or choose another --dir") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise StoreError(f"{self.path} is not a regular file: remove it and run again")
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            with contextlib.suppress(OSError):  # an older procckpt made it 0644
                os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise StoreError(f"cannot lock {self.path}: {e.strerror}") from e
            holder = self.holder()
            real = _flock_holder(st.st_dev, st.st_ino)
            if real is not None and (not holder or holder.get("pid") != real[0]
                                     or holder.get("host") != socket.gethostname()):
                who = f"pid {real[0]} ({real[1]}) on this host"  # the note names someone else
            elif holder:
                who = (f"pid {holder.get('pid')} on {holder.get('host')} "
                       f"({holder.get('purpose', 'run')})")
            else:
                who = "another process"
            raise LockedError(
                f"checkpoint dir {self.path.parent} is in use by {who}; wait for it to end "
                "or use another --dir"
            ) from e
        self._say_taken_over(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "purpose": purpose}
        try:  # who holds it, for messages; the flock alone is the lock (a full disk keeps it)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        except OSError as e:
            logger.warning("could not note this process in %s (%s); the lock holds anyway",
                           self.path, e.strerror)
        self._fd = fd

    def _say_taken_over(self, fd: int) -> None:
        """A holder's note still in the file means it ended without releasing (killed): the
        kernel dropped its lock; say whose lock this process takes over."""
        try:
            note = json.loads(os.pread(fd, 4096, 0) or b"null")
        except (OSError, ValueError):
            return
        if not isinstance(note, dict) or "pid" not in note:
            return
        since = note.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) \
            if isinstance(since, (int, float)) else "an unknown time"
        logger.warning("taking over the lock of %s: held by %s pid %s on %s since %s, which "
                       "ended without releasing it (killed?)", self.path.parent,
                       note.get("purpose", "a run"), note.get("pid"), note.get("host", "?"), when)

    def holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(read_small_file(self.path) or b"null")
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # a released lock leaves no holder's note
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flock_holder(dev: int, ino: int) -> tuple[int, str] | None:
    """The process holding a ``flock`` on the file (``dev``, ``ino``) of this host, and its
    command line, from /proc/locks; None where that cannot be told."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks a waiter)
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields[:2] \
                and fields[5] == want:
            try:
                pid = int(fields[4])
            except ValueError:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                command = "?"
            return pid, command[:120] or "?"
    return None


def machine_id() -> str | None:
    """This boot of this machine and this process's pid namespace ("BOOT_ID/INODE"): pids
    compare only where these are equal (two containers may share a host name, never both);
    None where /proc does not tell."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None
