"""The training's side of the memory tier (launcher/tier.py): its newest state, every few steps,
in memory the launcher holds.

At a safe point where no checkpoint is taken, :class:`TierWriter` copies the state into a host
arena of its own (the training's only pause) and a thread writes the copy as a checkpoint of a
store in the launcher's tmpfs directory, keeping the newest two. The cadence follows what the
copy costs: a slot at every safe point where that is at most 0.9 % of the time between safe
points, else every k of them; never while the previous slot is still being written. (Of the
1 % the tier may take, a tenth is left for what a copy of the whole state leaves behind: the
caches it emptied. Measured, the tier cost the training 5-15 % more than its copies' time.)

The write takes no core the training wants: its thread runs under SCHED_IDLE, which any other
thread that wakes preempts at once, and starts a third of a step after the copy, once the
compute that follows a safe point has had the cores. Measured on 2 cores, 64 MB, 25-ms steps
(BENCHMARKS.md): the slot's write then costs the training nothing measurable; at nice 19 and
at once, 0.5-0.9 % of its time.

Before the first slot, the room for it is checked (the memory file system, the machine, the
cgroup): a tier that does not fit is said in one line, and the training goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import ProcckptError
from ...protocol.control import ENV_TIER
from ...protocol.events import append_event
from ...store import CheckpointStore
from ...store.cgroups import HEADROOM, memory_short
from ...store.files import format_size
from .arena import HostArena, NotSnapshottable, Snapshot
from .writer import payload_bytes, write_checkpoint

__all__ = ["TierWriter", "BUDGET", "tier_room"]

logger = logging.getLogger(__name__)

#: The share of the training's time the tier may take from it.
BUDGET = 0.01
#: The share the copy at a safe point is planned at (the rest: its wake, see the module).
COPY_BUDGET = 0.009
#: The write of a slot starts this share of a step after its copy, at most WRITE_WAIT_MAX s.
WRITE_WAIT = 1 / 3
WRITE_WAIT_MAX = 0.1
#: Slots kept, plus the one being written: what the memory file system must hold.
_FILES = 3


def tier_room(root: Path, nbytes: int) -> str | None:
    """Why a tier of ``nbytes`` a slot does not fit here, or None if it does: its files in
    ``root`` and one host copy in memory, with a margin, in the file system, the machine's
    available memory and the cgroup's limit."""
    files = _FILES * nbytes
    need = files + nbytes + HEADROOM
    try:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
    except OSError as e:
        return f"cannot see the room in {root} ({e.strerror or e})"
    if free < files:
        return (f"its {_FILES} slots of {format_size(nbytes)} need {format_size(files)} in "
                f"{root.parent}, which has {format_size(free)} free")
    needs = (f"it needs {format_size(need)} of memory ({_FILES} slots and a copy of "
             f"{format_size(nbytes)}, and a margin)")
    short = memory_short(need)
    return None if short is None else f"{needs}, and {short}"


class TierWriter:
    """Writes the state into the launcher's tier every few safe points (see the module)."""

    def __init__(self, root: Path, journal: Path | None, name: str = "state.pt") -> None:
        self.root = root
        self.store = CheckpointStore(root, keep=2)
        self.journal = journal
        #: The file each slot's state goes into (a group's other ranks: their rank file).
        self.name = name
        self.arena = HostArena()
        #: Why the tier is off for the rest of this process, once it is.
        self.off: str | None = None
        #: Write a slot every this many safe points (planned from the measured copy).
        self.every = 1
        self.slots = 0
        self._since = 0
        self._last_point: float | None = None
        self._gaps: deque[float] = deque(maxlen=15)
        self._stalls: deque[float] = deque(maxlen=5)
        self._nbytes = 0
        self._thread: threading.Thread | None = None
        self._said_every: int | None = None
        #: Whether the cadence goes to the log (in a group: rank 0's, the one that counts).
        self.says = True

    @classmethod
    def from_environment(cls, journal: Path | None) -> TierWriter | None:
        """The tier the launcher made for this command, if any."""
        path = os.environ.get(ENV_TIER)
        return cls.opened(Path(path), journal) if path else None

    @classmethod
    def opened(cls, root: Path, journal: Path | None, name: str = "state.pt") -> TierWriter:
        """The tier's store at ``root``, ready, or off (:attr:`off` says why)."""
        writer = cls(root, journal, name)
        try:
            writer.store.open()
            writer.store.clean_temporaries()  # a slot torn by the last process's kill
        except (OSError, ProcckptError) as e:
            writer.turn_off(f"cannot use {root} ({e})")
        return writer

    def at_safe_point(self, now: float, write: bool, meta: Callable[[], dict[str, Any]],
                      payload: Callable[[], dict[str, Any]],
                      before: Callable[[], None]) -> None:
        """Count a safe point; with ``write`` (no checkpoint was taken here), write a slot
        when its turn came. ``before`` runs just before a slot is copied (the audit's note)."""
        self.count(now, write)
        if write and self.due() and not self.busy():
            self.write_slot(meta, payload, before)

    def count(self, now: float, eligible: bool) -> None:
        """Measure the time since the last safe point (what the cadence is planned from);
        ``eligible``: one that could hold a slot, counted towards the next."""
        last, self._last_point = self._last_point, now
        if last is not None:
            self._gaps.append(now - last)
        if eligible and self.off is None:
            self._since += 1

    def due(self) -> bool:
        """Whether a slot's turn came (never at the first safe point: no step measured)."""
        return self.off is None and self._since >= self.every and bool(self._gaps)

    def busy(self) -> bool:
        """Whether the previous slot is still being written."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def write_slot(self, meta: Callable[[], dict[str, Any]],
                   payload: Callable[[], dict[str, Any]], before: Callable[[], None]) -> None:
        """Copy the state into the arena (the pause) and write it as a slot in the
        background; first check the room for it, once."""
        if self.off is not None:
            return
        started = time.perf_counter()
        state = payload()
        if self.slots == 0 and not self._nbytes:
            self._nbytes = payload_bytes(state)
            room = tier_room(self.root, self._nbytes)
            if room is not None:
                self.turn_off(room)
                return
        before()
        allocations = self.arena.allocations
        try:
            snapshot = self.arena.capture(state)
        except NotSnapshottable as e:
            self.turn_off(f"the state holds {e}, which cannot be copied into host memory")
            return
        except (MemoryError, RuntimeError) as e:  # (the tier must never end the training)
            self.turn_off(f"the copy failed ({type(e).__name__}: {e})")
            return
        if self.arena.allocations == allocations:  # (a copy that first made its buffer is
            self._stalls.append(time.perf_counter() - started)  # no measure of the next)
        self._since = 0
        self._nbytes = snapshot.nbytes
        if self._stalls:
            self._plan()
        wait = min(WRITE_WAIT * statistics.median(self._gaps), WRITE_WAIT_MAX) \
            if self._gaps else 0.0
        self._thread = threading.Thread(target=self._write, args=(snapshot, meta(), wait),
                                         name="procckpt-tier", daemon=False)
        self._thread.start()

    def _plan(self) -> None:
        step = statistics.median(self._gaps)
        stall = statistics.median(self._stalls)
        every = max(1, math.ceil(stall / (COPY_BUDGET * step))) if step > 0 else 1
        self.every = every
        said = self._said_every
        # Said (and journalled) when new or moved by over half: the copy's time wavers.
        if said is None or not said / 1.5 <= every <= said * 1.5:
            self._said_every = every
            why = (f"the copy takes {_ms(stall)}, {COPY_BUDGET:.1%} of a step of {_ms(step)} "
                   f"is {_ms(COPY_BUDGET * step)}")
            # In the log once; the journal (procckpt status) follows it.
            if said is None and self.says:
                logger.info("memory tier: %s a slot in %s, written every %s (%s)",
                            format_size(self._nbytes), self.root, "step" if every == 1
                            else f"{every} steps", why)
            if self.journal is not None:
                append_event(self.journal, "memory-tier", bytes=self._nbytes, every=every,
                             why=why, copy=round(stall, 5), step_seconds=round(step, 5),
                             root=str(self.root))

    def _write(self, snapshot: Snapshot, meta: dict[str, Any], wait: float) -> None:
        # The training comes first: where it leaves no core idle, the slot waits for it.
        _yield_to_others()
        time.sleep(wait)
        try:
            snapshot.wait_copied()  # (a GPU's copies land on their own stream)
            write_checkpoint(self.store, meta, snapshot.payload, self.name)
            self.store.prune()
            self.slots += 1
        except Exception as e:  # noqa: BLE001 (no failure of the tier may reach the training)
            self.turn_off(f"a slot could not be written ({type(e).__name__}: {e})")

    def turn_off(self, why: str, say: bool = True) -> None:
        """Off for the rest of this process; ``say``: the warning line (a group's ranks
        turned off by another rank's say nothing)."""
        self.off = why
        if say:
            logger.warning("memory tier: off, %s; a crash resumes from the newest checkpoint "
                           "(--no-memory-tier says so without this line)", why)
        if self.journal is not None:
            append_event(self.journal, "memory-tier", off=why, root=str(self.root))
        self.arena.release()

    def close(self) -> None:
        """Wait for a slot in flight. Its thread is no daemon, so that a script that exits
        (or raises) while a slot is written waits for it too: a daemon thread inside
        ``torch.save`` when the interpreter ends aborts the process (SIGABRT, "terminate
        called without an active exception") instead of exiting with the script's code."""
        thread = self._thread
        if thread is not None:
            thread.join()


def _yield_to_others() -> None:
    """This thread under SCHED_IDLE (any other thread that wakes takes its core at once), or
    at nice 19 where that is refused."""
    me = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, me, 19)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(me, os.SCHED_IDLE, os.sched_param(0))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
