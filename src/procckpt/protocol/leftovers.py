"""Folders a launcher makes in shared memory (``/dev/shm``), named by its machine's boot and
its pid, and swept by a later launcher once theirs is gone: a launcher killed with SIGKILL
cannot remove them, and memory on a shared node is nobody else's to free until it reboots."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..store.lock import machine_id

__all__ = ["make_owned_dir", "sweep_dead"]


def _machine() -> str:
    """:func:`machine_id` as a part of a folder's name (no '-' or '/')."""
    return (machine_id() or "unknown").replace("-", "").replace("/", ".")


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
