"""What the launcher cannot see of a cycle's time: when the training became ready, how much
longer its first step took than its second (compiling, warming caches), and, after a restart,
where the time from the failure to the first resumed step went. For ``procckpt status`` and
``procckpt report`` (inspect/goodput.py, inspect/status.py); from rank 0 of a launched run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ...protocol.control import ENV_RECOVERY
from ...protocol.events import append_event

__all__ = ["CycleTimer", "process_started"]


class CycleTimer:
    """Journals ``ready`` once the Checkpointer has resumed, and ``warm`` at the second safe
    point of the cycle: the first two steps' lengths. In a cycle the launcher started after a
    failure (``PROCCKPT_RECOVERY`` holds when it saw the failure and when it started this
    command), ``recovery`` at the first safe point: each phase from the failure to the first
    resumed step. Nothing is journalled when ``journal`` is None (another rank, or a script
    run without the launcher)."""

    def __init__(self, journal: Path | None) -> None:
        self.journal = journal
        self._marks: list[float] = []
        #: Wall-clock time the Checkpointer made this (the script's imports were done by then).
        self._created = time.time()
        self._recovery: dict[str, Any] | None = None

    def ready(self, restore_seconds: float | None, restored_bytes: int | None = None,
              source: str | None = None, touched: int = 0) -> None:
        """The Checkpointer is ready; ``source``: where the state it restored was kept (the
        memory tier or the checkpoint dir); ``touched``: the bytes it copied into memory
        touched already (a warm restart's, or the optimizer's earlier state)."""
        if self.journal is None:
            return
        self._marks.append(time.monotonic())
        ready = time.time()  # (the same moment: the journal's write below is no phase)
        append_event(self.journal, "ready", restore=round(restore_seconds or 0.0, 4))
        self._recovery = _recovery_start(self._created, ready, restore_seconds, restored_bytes)
        if self._recovery is not None and source is not None:
            self._recovery["source"] = source
        if self._recovery is not None and touched:
            self._recovery["touched"] = touched

    def at_safe_point(self, now: float) -> None:
        """Called at every safe point; cheap once the first two steps are measured."""
        if self.journal is None or not 0 < len(self._marks) < 3:
            return
        self._marks.append(now)
        if len(self._marks) == 2 and self._recovery is not None:
            phases = self._recovery
            self._recovery = None
            phases["first_step"] = round(now - self._marks[0], 4)
            phases["total"] = round(time.time() - phases.pop("seen_at"), 4)
            append_event(self.journal, "recovery", **phases)
        if len(self._marks) == 3:
            ready, first, second = self._marks
            append_event(self.journal, "warm", first=round(first - ready, 4),
                         second=round(second - first, 4))


def _recovery_start(created: float, now: float, restore: float | None, nbytes: int | None,
                    ) -> dict[str, Any] | None:
    """The phases up to the Checkpointer's readiness, from the launcher's times in the
    environment and this process's own; None outside a restart after a failure."""
    try:
        launcher = json.loads(os.environ.get(ENV_RECOVERY, ""))
        seen, spawned = float(launcher["seen"]), float(launcher["spawned"])
    except (ValueError, KeyError, TypeError):
        return None
    restore = restore or 0.0
    started = process_started()
    phases: dict[str, Any] = {"seen_at": seen, "backoff": round(spawned - seen, 4)}
    if started is not None and spawned - 0.02 <= started <= created:  # (to a tick or two)
        started = max(started, spawned)
        phases["spawn"] = round(started - spawned, 4)
        phases["imports"] = round(created - started, 4)
    else:  # no process start time to split them by
        phases["spawn_and_imports"] = round(created - spawned, 4)
    phases["checkpointer"] = round(max(0.0, now - created - restore), 4)
    phases["restore"] = round(restore, 4)
    if nbytes is not None:
        phases["bytes"] = nbytes
    return phases


def process_started() -> float | None:
    """When this process started, wall-clock, to a clock tick (10 ms), from /proc: its age is
    the time since boot less its start in ticks since boot (/proc/stat's whole-second boot
    time would be a second off). None where there is no /proc."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
