"""Results a test session makes once for all its workers: uninterrupted reference runs.

Several modules compare against the same uninterrupted run (the two-rank DDP reference, the
tiny program with the same arguments); made once a worker, such a run cost each of them the
start-up of torch in every process. :func:`once` makes it in a directory of the session's,
under a file lock, and every later caller, on any worker, gets what the first one made.

A reference is only ever read (loaded and compared), so sharing it cannot couple the tests
that use it; one whose making failed is made again, from an empty directory, by the next
caller (which fails the same way, with its own message).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["once", "session_root"]

_root: Path | None = None


def session_root(factory: pytest.TempPathFactory) -> Path:
    """The directory the session's workers share (the parent of a worker's base under
    pytest-xdist), set up by a session fixture in conftest.py."""
    global _root
    base = factory.getbasetemp()
    _root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    _root.mkdir(exist_ok=True)
    return _root


def once(key: list[str], make: Callable[[Path], Path]) -> Path:
    """What ``make(directory)`` returns, made the first time this session asks for ``key``
    (the command's words, say): later callers wait for it and get the same path."""
    if _root is None:
        raise RuntimeError("tests.harness.shared: no session root (conftest.py sets it)")
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    where = _root / digest
    with open(_root / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        made = where / "made.json"
        if made.is_file():
            return Path(json.loads(made.read_text())["path"])
        shutil.rmtree(where, ignore_errors=True)  # what a failed making left
        where.mkdir()
        path = make(where)
        made.write_text(json.dumps({"key": key, "path": str(path)}))
        return path
