"""Folders a launcher makes in shared memory (``/dev/shm``), named by its machine's boot and
its pid, and swept by a later launcher once theirs is gone: a launcher killed with SIGKILL
cannot remove them, and memory on a shared node is nobody else's to free until it reboots."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["make_owned_dir", "sweep_dead"]


def _machine() -> str:
    """This boot of this machine, and this pid namespace: where a pid names one process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        return f"{boot}.{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return boot


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def make_owned_dir(root: Path, prefix: str) -> Path:
    """A new private folder ``root/PREFIX<boot>-<pid>-<random>``."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{_machine()}-{os.getpid()}-", dir=root))


def sweep_dead(root: Path, prefix: str) -> list[Path]:
    """Remove the folders in ``root`` that :func:`make_owned_dir` made for launchers of this
    boot and pid namespace whose pid is gone; the ones removed."""
    machine, removed = _machine(), []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if not entry.name.startswith(prefix):
                continue
            parts = entry.name[len(prefix):].split("-")
            if len(parts) < 3 or parts[0] != machine or not parts[1].isdigit():
                continue
            if not _alive(int(parts[1])):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed
