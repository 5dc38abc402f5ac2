"""What checkpoints cost in this run, learned from the events journal as the run goes.

Two numbers matter to the launcher: how long a checkpoint *pauses training* (the copy into host
memory for a background checkpoint, the whole write for a synchronous one or a DMTCP image),
which sets how often it is worth checkpointing (interval.py); and how long a checkpoint takes
to become *durable* once the training acts on it, which sets how early the deadline's
checkpoint must be asked for (grace.py, which adds a step for reaching the safe point). Both
come from the training's own ``checkpoint`` lines: the launcher's request-to-confirmation time
would also count a start-up the request arrived during. Earlier cycles and jobs in the same
directory count too: their lines are in the same journal.
"""

from __future__ import annotations

import statistics
from collections import deque
from pathlib import Path
from typing import Any

from ..protocol.events import EventTail

__all__ = ["CheckpointCosts"]

#: How many recent checkpoints the estimates look at.
RECENT = 5


class CheckpointCosts:
    """Recent checkpoint costs, read from the journal (call :meth:`update` to catch up)."""

    def __init__(self, journal: Path) -> None:
        self._tail = EventTail(journal)
        self._pauses: deque[float] = deque(maxlen=RECENT)
        self._durable: deque[tuple[float, str]] = deque(maxlen=RECENT)
        #: The longest stretch between two safe points the training journalled with a
        #: checkpoint, in any launch on this dir (a validation pass, an epoch's end).
        self.longest_gap: float | None = None

    def update(self) -> bool:
        """Read what the journal gained; True if an estimate may have changed."""
        changed = False
        for event in self._tail.new_events():
            kind = event.get("event")
            if kind == "checkpoint":
                pause = _seconds(event, "stall")  # a background checkpoint's pause
                if pause is None:
                    pause = _seconds(event, "write_seconds")  # a DMTCP image's
                if pause is None:
                    pause = _seconds(event, "seconds")  # a synchronous write's
                if pause is not None:
                    self._pauses.append(pause)
                    changed = True
                durable = _seconds(event, "seconds")
                if durable is not None:
                    self._durable.append((durable, str(event.get("checkpoint", "?"))))
                    changed = True
                gap = _seconds(event, "gap")
                if gap is not None and gap > (self.longest_gap or 0.0):
                    self.longest_gap = gap
                    changed = True
        return changed

    @property
    def pause(self) -> float | None:
        """The median pause of recent checkpoints; None before the first one."""
        return statistics.median(self._pauses) if self._pauses else None

    @property
    def longest_durable(self) -> tuple[float, str] | None:
        """The longest recent request-to-durable time, and the checkpoint that took it."""
        return max(self._durable) if self._durable else None


def _seconds(event: dict[str, Any], key: str) -> float | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return float(value)
