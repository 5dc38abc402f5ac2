"""Hang detection: no progress for ``--hang-timeout`` means the training is stuck.

Progress is a step completed or the training thread's stack seen to move: the hooks engine
passes both to the launcher (``control/heartbeat.json``, at most every second; see
training/link/liveness.py), so a validation pass or data preparation that runs Python code between
safe points is no hang, and a thread blocked in a lock, a collective, a read or a sleep is.
When neither has moved for the timeout, the launcher has every Python process of the command print
its stacks into the
log (``faulthandler`` on SIGURG, registered by the Checkpointer; ``py-spy dump`` too when it
is installed), stops the command and restarts it from its last checkpoint. ``auto`` is
``max(10 min, 50 x the median step time)``. In a process group any stuck rank stops rank 0 at
its next collective, so rank 0's heartbeat covers the group.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import subprocess
from collections import deque

from ..protocol.control import STACK_DUMP_SIGNAL, Heartbeat

__all__ = ["HangWatch", "dump_stacks", "descendants"]

logger = logging.getLogger(__name__)

#: ``auto``: at least this long, and at least this many median step times.
AUTO_MIN = 600.0
AUTO_STEPS = 50


class HangWatch:
    """Follows one cycle's heartbeats and says when the training stopped making progress.

    Times are the launcher's monotonic clock: when it *saw* the step change.
    """

    def __init__(self, setting: float | str | None) -> None:
        self.setting = setting
        self._step_times: deque[float] = deque(maxlen=50)
        self._longest_gap: float | None = None
        self.start_cycle()

    def start_cycle(self) -> None:
        self._last: tuple[int, float] | None = None  # (step, when it was seen to change)
        self._moves: int | None = None  # the heartbeat's count of stack moves
        self._moved = 0.0  # when a step or a move was last seen

    @property
    def enabled(self) -> bool:
        return self.setting is not None

    @property
    def step_seconds(self) -> float | None:
        """The median seconds per step seen so far (in every cycle of this run)."""
        return statistics.median(self._step_times) if self._step_times else None

    @property
    def timeout(self) -> float | None:
        if self.setting is None:
            return None
        if isinstance(self.setting, str):  # auto
            per_step = self.step_seconds
            return max(AUTO_MIN, AUTO_STEPS * per_step) if per_step else AUTO_MIN
        return float(self.setting)

    def observe(self, beat: Heartbeat | None, connected: bool, now: float) -> None:
        """Note the newest heartbeat (the clock starts once the training connected)."""
        if beat is None:
            if connected and self._last is None:
                self._last = (-1, now)
                self._moved = now
            return
        if self._last is None or beat.step != self._last[0]:
            if self._last is not None and self._last[0] >= 0 and beat.step > self._last[0]:
                self._step_times.append((now - self._last[1]) / (beat.step - self._last[0]))
            self._last = (beat.step, now)
            self._moved = now
        if beat.moves != self._moves:
            self._moves = beat.moves
            self._moved = now
        if beat.gap > (self._longest_gap or 0.0):
            self._longest_gap = beat.gap

    @property
    def longest_gap(self) -> float | None:
        """The longest time the training went between two safe points (a step and what
        follows it: a validation pass, the epoch's end), in any cycle of this run; None
        before it was measured."""
        return self._longest_gap

    def stuck_for(self, now: float) -> float | None:
        """Seconds without progress, once that is longer than the timeout; else None."""
        timeout = self.timeout
        if timeout is None or self._last is None:
            return None
        quiet = now - self._moved
        return quiet if quiet > timeout else None

    @property
    def last_step(self) -> int | None:
        return None if self._last is None or self._last[0] < 0 else self._last[0]


def dump_stacks(root: int, timeout: float = 10.0) -> None:
    """Ask every process below ``root`` (the command's keeper) for its Python stacks.

    Every descendant, not the process group: torchrun starts each worker in a session of its
    own. The signal is ignored by processes that did not register for it. ``py-spy dump`` of
    each, too, where py-spy is installed.
    """
    below = descendants(root)
    for pid in below:
        try:
            os.kill(pid, STACK_DUMP_SIGNAL)
        except (ProcessLookupError, PermissionError):
            pass
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return
    for pid in below:
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as e:
            logger.debug("py-spy dump of %d failed: %s", pid, e)
            continue
        if done.returncode == 0 and done.stdout.strip():
            logger.error("py-spy dump of pid %d:\n%s", pid, done.stdout.rstrip())


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first, then the parent),
    or None when the process is gone. The name may hold spaces and parentheses: split after the
    last ')'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """The processes below ``root``, from /proc (parents before their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(entry) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop(0)
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found
