"""Whether the training is making progress, for the launcher's hang detection.

Safe points are not the only sign of progress: a validation pass, data preparation after
``Checkpointer()`` or the end of an epoch run for minutes without one. A thread samples the
training thread five times a second: where it is (its Python frames, each code object and
instruction), how often it has given up the processor of its own accord (its voluntary
context switches), and how much processor time it has used. A sample sees the thread active
when the stack changed (or the thread slept and woke again) *and* the thread ran for at least
MOVE_CPU_SECONDS since the sample before; it counts as a move when the sample before saw it
active too: a validation pass or data preparation works sample after sample, a wait does
not. A thread stuck in a collective, a lock, a read or a sleep shows the same stack and uses
no time; a wait loop that wakes now and then to look again (the DataLoader's
``queue.get(timeout=5)`` for a batch a stuck worker will never send, ``while not ready:
sleep(0.1)``) cycles through the same few frames, and each wake-up is one active sample at
most, however slow the machine makes it (on a loaded node one took more than the CPU
threshold, and a single active sample used to count: the hang was never caught). One
spinning on a device that never answers uses time but shows the same stack, and switches only
when preempted (those are not counted); one that holds the GIL forever keeps the sampler from
running at all. All of these look stuck.

Once a second at most (when something changed) the sampler writes the heartbeat: the step
reached, how many samples saw the thread move, and the longest stretch between two safe points
so far (the deadline's checkpoint must be asked for early enough to cover it). The launcher
counts a new step or a new move as progress (launcher/hang.py).

A loop that polls in a tight circle (a millisecond's sleep or less) still uses enough time
to move, and is not caught.

A long call into C that releases the GIL (a huge single kernel, a blocking library call)
shows one stack while it works: :meth:`Liveness.working` marks such a stretch as progress,
and procckpt marks its own checkpoint work so.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

from ...protocol import control as ctl

__all__ = ["Liveness", "NoLiveness", "SAMPLE_SECONDS", "HEARTBEAT_SECONDS",
           "stack_fingerprint"]

logger = logging.getLogger(__name__)

#: How often the training thread's stack is sampled.
SAMPLE_SECONDS = 0.2
#: How often, at most, the launcher is told (its hang detection reads it).
HEARTBEAT_SECONDS = 1.0
#: A changed stack is a move only when the thread ran this long since the sample before (1/4 %
#: of a core): a wait loop's wake-ups cost microseconds, real work milliseconds.
MOVE_CPU_SECONDS = 0.0005


def thread_cpu_clock(thread_id: int | None) -> int | None:
    """The clock of the processor time thread ``thread_id`` used (POSIX); None elsewhere."""
    try:
        return time.pthread_getcpuclockid(thread_id)  # type: ignore[arg-type]
    except (AttributeError, OSError, TypeError, OverflowError):
        return None


def cpu_seconds(clock: int | None) -> float | None:
    """The processor time on ``clock`` so far; None without one, or once its thread ended."""
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None


def voluntary_switches(native_id: int) -> int | None:
    """How often the thread has blocked of its own accord (Linux: /proc; None elsewhere)."""
    try:
        with open(f"/proc/self/task/{native_id}/status", "rb") as f:
            for line in f:
                if line.startswith(b"voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def stack_fingerprint(thread_id: int) -> int | None:
    """A hash of where thread ``thread_id`` is: each frame's code object and last instruction.

    None when the thread is gone.
    """
    frame = sys._current_frames().get(thread_id)
    where = []
    while frame is not None:
        where.append((id(frame.f_code), frame.f_lasti))
        frame = frame.f_back
    del frame
    return hash(tuple(where)) if where else None


class Liveness:
    """Samples the training thread and writes the heartbeat (rank 0 of a launched run).

    Args:
        control: the control channel the heartbeat goes into.
        thread: the thread that trains (the one that created the Checkpointer).
    """

    def __init__(self, control: ctl.ControlChannel, thread: threading.Thread) -> None:
        self.control = control
        self.thread_id = thread.ident
        self.native_id = thread.native_id
        self._cpu_clock = thread_cpu_clock(thread.ident)
        #: The step reached, set by the safe points (a plain store: read by the sampler).
        self.step = 0
        #: How many samples found the training elsewhere than the sample before.
        self.moves = 0
        #: The longest time between the end of one safe point and the next one so far.
        self.longest_gap = 0.0
        self._left_safe_point: float | None = None
        self._working = 0  # depth of working() blocks: each sample counts as a move
        self._said: tuple[int, int] | None = None
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (stopped by :meth:`close` or when the interpreter exits)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="procckpt-liveness",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def close(self) -> None:
        """Stop sampling (joined, so that no heartbeat follows)."""
        self._stop.set()
        atexit.unregister(self.close)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * SAMPLE_SECONDS + 1.0)

    def at_safe_point(self, step: int, now: float) -> None:
        """A safe point begins (``now``, monotonic) at ``step``; measures the gap since the
        last one ended."""
        self.step = step
        if self._left_safe_point is not None:
            self.longest_gap = max(self.longest_gap, now - self._left_safe_point)

    def left_safe_point(self) -> None:
        """The safe point's own work (a checkpoint, say) is done: the training goes on."""
        self._left_safe_point = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Count the whole block as progress, whatever the stack shows."""
        self._working += 1
        try:
            yield
        finally:
            self._working -= 1

    def _where(self) -> tuple[int, int | None] | None:
        stack = stack_fingerprint(self.thread_id)  # type: ignore[arg-type]
        if stack is None:
            return None
        return stack, voluntary_switches(self.native_id)  # type: ignore[arg-type]

    def _run(self) -> None:
        last, last_cpu = self._where(), cpu_seconds(self._cpu_clock)
        next_beat = 0.0
        was_active = False
        while not self._stop.wait(SAMPLE_SECONDS):
            here, cpu = self._where(), cpu_seconds(self._cpu_clock)
            if here is None:
                return  # the training thread ended
            worked = cpu is None or last_cpu is None or cpu - last_cpu >= MOVE_CPU_SECONDS
            active = here != last and worked
            if self._working or (active and was_active):  # one wake-up is no progress
                self.moves += 1
            was_active = active
            last, last_cpu = here, cpu
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_SECONDS
                self._beat()

    def _beat(self) -> None:
        said = (self.step, self.moves)
        if said == self._said:
            return  # nothing new: the launcher's clock runs on
        try:
            self.control.beat(*said, gap=round(self.longest_gap, 3))
        except OSError as e:
            if not self._failed:  # say it once: the launcher then cannot see hangs
                self._failed = True
                logger.warning("cannot tell procckpt run the step reached (%s: %s); its hang "
                               "detection is blind until this passes", self.control.dir,
                               e.strerror or e)
            return
        self._said = said


class NoLiveness:
    """A script no launcher watches (or a rank other than 0): nothing to sample or tell."""

    longest_gap = 0.0
    step = 0  # told, never read

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def working(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def at_safe_point(self, step: int, now: float) -> None:
        pass

    def left_safe_point(self) -> None:
        pass
