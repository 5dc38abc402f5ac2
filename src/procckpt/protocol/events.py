"""The events journal: one JSON object per line in ``DIR/events.jsonl``.

Both the launcher and the training process append to it. Each line is written with a single
``write`` on an ``O_APPEND`` descriptor, which keeps concurrent lines from interleaving.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["append_event", "read_events", "EventTail"]

_unwritable: set[Path] = set()


def append_event(path: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event; a journal that cannot be written never stops a run."""
    event = {"time": round(time.time(), 3), "event": kind, "host": socket.gethostname(),
             "pid": os.getpid(), **fields}
    line = (json.dumps(event, default=str) + "\n").encode()
    try:
        # O_NOFOLLOW: a link planted in the dir must not have procckpt append to its target.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        if path not in _unwritable:  # say it once per process, then keep quiet
            _unwritable.add(path)
            logging.getLogger(__name__).warning("cannot write the events journal %s (%s); "
                                                "training goes on without it", path,
                                                e.strerror or e)
    return event


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the journal's events in order, skipping a line a crash cut short."""
    try:
        with open(path, "rb") as f:
            yield from _parsed(f)
    except FileNotFoundError:
        return


def unreadable_lines(path: Path) -> int:
    """How many lines of the journal are no event (cut short by a crash, or damaged)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip() and not _event(line))
    except FileNotFoundError:
        return 0


def _event(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _parsed(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The events among ``lines``; a line a crash cut short (or any other junk) is skipped."""
    for line in lines:
        event = _event(line)
        if event is not None:
            yield event


class EventTail:
    """The journal's new events since the last call: for a reader that follows a run (the
    launcher learns checkpoint costs from it). Cheap when nothing was appended (a ``stat``)."""

    def __init__(self, path: Path, *, from_start: bool = True) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        if not from_start:
            try:
                self._offset = path.stat().st_size
            except OSError:
                pass

    def new_events(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self._offset:  # replaced (an archive, a new dir): start over
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return list(_parsed(lines))
