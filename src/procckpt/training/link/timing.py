"""What the launcher cannot see of a cycle's time: when the training became ready, and how much
longer its first step took than its second (compiling, warming caches), for ``procckpt status``
and ``procckpt report`` (inspect/goodput.py). Two events a cycle, from rank 0 of a launched run."""

from __future__ import annotations

import time
from pathlib import Path

from ...protocol.events import append_event

__all__ = ["CycleTimer"]


class CycleTimer:
    """Journals ``ready`` once the Checkpointer has resumed, and ``warm`` at the second safe
    point of the cycle: the first two steps' lengths. Nothing is journalled when ``journal``
    is None (another rank, or a script run without the launcher)."""

    def __init__(self, journal: Path | None) -> None:
        self.journal = journal
        self._marks: list[float] = []

    def ready(self, restore_seconds: float | None) -> None:
        if self.journal is None:
            return
        self._marks.append(time.monotonic())
        append_event(self.journal, "ready", restore=round(restore_seconds or 0.0, 4))

    def at_safe_point(self, now: float) -> None:
        """Called at every safe point; cheap once the first two steps are measured."""
        if self.journal is None or not 0 < len(self._marks) < 3:
            return
        self._marks.append(now)
        if len(self._marks) == 3:
            ready, first, second = self._marks
            append_event(self.journal, "warm", first=round(first - ready, 4),
                         second=round(second - first, 4))
