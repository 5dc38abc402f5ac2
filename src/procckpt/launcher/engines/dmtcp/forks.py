"""What DMTCP 4.2 needs to checkpoint programs that fork, and what to say when it cannot.

Measured (gdb on a stuck training script): a torch script that runs a subprocess hangs in
``fork()`` for good under DMTCP, because NumPy's OpenBLAS joins its threads in a pre-fork
handler while one of them waits, in DMTCP's thread-start wrapper, for the lock the forking
thread holds. With one OpenBLAS thread the fork returns and the image restores. A program
with DataLoader worker processes forks fine then, but none of its images can be trusted: the
workers hand batches over in shared memory, by file descriptors passed over a socket, and
after a restore those are gone. Images taken while a worker is alive mostly never complete;
one that did trained on garbage targets (a CI run; ``OSError: Bad file descriptor`` by hand);
one taken between epochs aborted a second after its restore, freeing a batch that came from
a worker (a CI run, and by hand). So no image of a command with a lasting forked copy is kept
(:class:`CopyWatch`, :meth:`StuckImages.refuse`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from ....protocol.events import append_event
from ...hang import descendants, stat_fields

__all__ = ["STALL_S", "CopyWatch", "StuckImages", "fork_safe_env", "own_processes",
           "stuck_message"]

logger = logging.getLogger(__name__)

#: An image with no byte written for this long after the request will not complete: DMTCP
#: suspends the threads and starts writing within a second or two (a torch process's 650 MB
#: take ~1 s here), and writes on without pause.
STALL_S = 15.0
#: How often the command's processes are looked at for forked copies (CopyWatch), and how
#: old a copy is when it counts: a child between its fork and its exec lives microseconds.
WATCH_S = 1.0
LASTING_S = 1.0
#: A stop whose image had not begun this long after the request, when the command was killed
#: at the deadline: as telling as a stall, once two cycles in a row end so.
UNSTARTED_S = 3.0


def fork_safe_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the command's environment needs so that it can fork under DMTCP 4.2.

    NumPy's OpenBLAS joins its worker threads before every fork (a pthread_atfork handler);
    under DMTCP a thread started meanwhile waits for the lock the forking thread holds, so the
    fork never returns (gdb: blas_thread_shutdown_ in pthread_join, the thread in DMTCP's
    thread_start). One OpenBLAS thread has none to join. torch's own threads (OpenMP, MKL)
    are not affected, so the training computes as before. A value the user set is kept.
    """
    if "OPENBLAS_NUM_THREADS" in environ:
        return {}
    return {"OPENBLAS_NUM_THREADS": "1"}


def own_processes(root: int, restored: int = 0) -> tuple[int, int]:
    """The command's live processes under DMTCP (``root`` and those below it that map DMTCP's
    library: not procckpt's keeper in front of the command), from /proc, and how many of them
    are forked copies of their parent (see :func:`command_processes`). An image may hold the
    others only; see the module docstring.

    Processes DMTCP restored all look alike in /proc (``mtcp_restart``, no command line): the
    ``restored`` processes of the image a cycle started from (kept, so without copies) would
    pass for copies of one another, and are not counted as such.
    """
    found = command_processes(root)
    copies = sum(1 for _, copy, _ in found if copy)
    alike = sum(1 for _, copy, restored_alike in found if copy and restored_alike)
    return len(found), copies - min(alike, max(restored - 1, 0))


def command_processes(root: int) -> list[tuple[int, bool, bool]]:
    """(pid, a forked copy of its parent, reads as restored) for each live process of the
    command under DMTCP, ``root`` and below. A forked copy has the same executable and
    command line as its parent, as DataLoader workers and multiprocessing's ``fork`` make
    them (and a child between its fork and its exec)."""
    # Each process is read once per call, though it is also every child's parent: a torch
    # process's maps run to thousands of lines, and CopyWatch asks every second.
    is_under, identity_of = functools.cache(_under_dmtcp), functools.cache(_identity)
    found = []
    for pid in [root, *descendants(root)]:
        fields = stat_fields(pid)
        if fields is None or fields[0] == "Z" or not is_under(pid):  # zombies are in no image
            continue
        me, parent = identity_of(pid), int(fields[1])
        copy = me is not None and is_under(parent) and me == identity_of(parent)
        found.append((pid, copy, me is not None
                      and os.path.basename(me[0]).startswith("mtcp_restart")))
    return found


class CopyWatch:
    """Sees a forked copy of the command that lives: a DataLoader worker, a multiprocessing
    pool. No image of such a command is kept (module docstring): even one taken with no
    worker alive aborted after its restore, in a CI run and by hand (a tensor received from a
    worker keeps the file descriptor of its shared memory, which is gone: torch's
    MapAllocator::close fails, SIGABRT). A copy counts once it is :data:`LASTING_S` old, so
    that a child between its fork and its exec never does, and not while a checkpoint is
    under way or in the :data:`LASTING_S` after it (:meth:`checkpointing`)."""

    def __init__(self) -> None:
        #: The pid of the first lasting copy seen in this run; None while there is none.
        self.seen: int | None = None
        self._restored: set[int] = set()
        self._first = True
        self._lock = threading.Lock()
        self._checkpoints = 0
        self._checkpoint_ended = float("-inf")

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a checkpoint. DMTCP suspends every process of the command for it, a child
        between its fork and its exec too (``subprocess.run``): that one then reads as a copy
        for as long as the checkpoint takes, which may be a stall of :data:`STALL_S` (a CI
        run ended so for a script that runs ``true`` every 25 steps). So no copy counts until
        :data:`LASTING_S` after the checkpoint ended."""
        with self._lock:
            self._checkpoints += 1
        try:
            yield
        finally:
            with self._lock:
                self._checkpoints -= 1
                self._checkpoint_ended = time.monotonic()

    def watch(self, root: int, restored: bool, over: threading.Event,
              stuck: StuckImages) -> None:
        """Sample the command ``root`` every :data:`WATCH_S` until ``over``; on a lasting
        copy, tell ``stuck``. In a ``restored`` cycle the processes of the first sample are
        those the image held (kept, so no copies), however alike they read."""
        self._restored, self._first = set(), restored
        while self.seen is None:
            pid = self.sample(root)
            if pid is not None:
                stuck.copies_found(pid)
            if over.wait(WATCH_S):
                return

    def sample(self, root: int) -> int | None:
        """Look at the command's processes; the pid of a lasting copy first seen now."""
        copies = {pid for pid, copy, _ in command_processes(root) if copy}
        if self._first:
            self._restored, self._first = copies, False
        with self._lock:
            if (self._checkpoints
                    or time.monotonic() - self._checkpoint_ended < LASTING_S):
                return None
        lasting = [pid for pid in copies - self._restored if _age(pid) >= LASTING_S]
        if not lasting or self.seen is not None:
            return None
        self.seen = min(lasting)
        return self.seen


def _age(pid: int) -> float:
    """Seconds since the process started; 0 once it is gone."""
    fields = stat_fields(pid)
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK") if fields else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


def _under_dmtcp(pid: int) -> bool:
    """Whether the process maps DMTCP's library (launched or restored by DMTCP both do)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return any(b"libdmtcp" in line for line in f)
    except OSError:
        return False


def _identity(pid: int) -> tuple[str, bytes] | None:
    """A process's executable and command line; None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.readlink(f"/proc/{pid}/exe"), f.read()
    except OSError:
        return None


def stuck_message(what: str, processes: int) -> str:
    """Why DMTCP cannot checkpoint this command, and the ways out, in one line."""
    if processes > 1:
        why = (f"the command runs {processes} processes (DataLoader workers, or a child it "
               "started?), and DMTCP 4.2 cannot checkpoint PyTorch programs with worker "
               "processes (their images stall, or restore without the workers' shared memory). "
               "Ways out: DataLoader(num_workers=0), or --engine hooks (procckpt.Checkpointer "
               "in the script)")
    else:
        why = ("the command is likely stuck in a fork under threads of a library other than "
               "NumPy's OpenBLAS (procckpt sets OPENBLAS_NUM_THREADS=1 unless it is set). Ways "
               "out: OMP_NUM_THREADS=1, or --engine hooks (procckpt.Checkpointer in the script)")
    return f"DMTCP could not checkpoint the command ({what}): {why}"


class StuckImages:
    """Whether this command's images can complete and be used, from how its checkpoints went.

    Args:
        events_path: the run's event log, which gets the stalls and refusals (None: not kept).
    """

    def __init__(self, events_path: Path | None = None) -> None:
        self.events_path = events_path
        #: Why no image will complete (a failure that repeats), once seen; else None.
        self.message: str | None = None
        #: Images in a row that stalled, were refused, or had not begun at the deadline.
        self._unusable = 0

    def stalled(self, waited: float, processes: int, wrote: bool = False) -> bool:
        """An image stopped growing for :data:`STALL_S` before it was complete. Twice in a
        row (stalled or refused), no image will: once may be a request that met a short-lived
        child process (a ``subprocess.run`` under way), and the next cycle, restarted from the
        last image, takes its images as before. Returns whether it repeats."""
        self._event("image-stuck", seconds=round(waited, 3), processes=processes, wrote=wrote)
        repeats = self._unusable_again(
            f"no byte of its image written for {STALL_S:.0f}s, the last {waited:.0f}s after "
            "the request", processes)
        if repeats:
            logger.error("dmtcp: no byte of the image written for %.0fs, for the second time "
                         "in a row; stopping the command", STALL_S)
        else:
            logger.warning("dmtcp: no byte of the image written for %.0fs; stopping the "
                           "command, to go on from the last image (a second time in a row "
                           "ends the run)", STALL_S)
        return repeats

    def refuse(self, names: list[str], processes: tuple[int, int] | None) -> str | None:
        """Why complete images ``names`` (one per process) must not be kept, or None. They must
        not when they hold more processes than the command's own programs (its ``processes``
        less its forked copies, as they were when the request went out) and a copy may be
        among them: one was alive then, or two images are of one program (a worker forked
        just after the request). A child that started meanwhile and runs another program
        (``subprocess.run``) is no copy. See the module docstring. Counted with the stalls."""
        images = len(names)
        if processes is None or images <= processes[0] - processes[1]:
            return None
        programs = [name.removeprefix("ckpt_").rsplit("_", 1)[0] for name in names]
        if processes[1] == 0 and len(set(programs)) == len(programs):
            return None
        self._event("image-refused", processes=images, copies=processes[1])
        why = (f"the image holds {images} processes, {images - processes[0] + processes[1]} "
               "more than the command's own programs: forked copies of it (DataLoader "
               "workers, multiprocessing), and DMTCP 4.2 restored such images wrong in "
               "procckpt's tests (garbage batches, or a crash), so it is not kept")
        if self._unusable_again("its image held forked copies of the command, which DMTCP "
                                "4.2 did not restore right in procckpt's tests", images):
            logger.error("dmtcp: %s, for the second time in a row", why)
        else:
            logger.warning("dmtcp: %s (a second time in a row ends the run)", why)
        return why

    def copies_found(self, pid: int) -> None:
        """A forked copy of the command lived (CopyWatch): no image of it will be kept, and
        the run ends at its next stop unless it finishes first."""
        self._event("forked-copy", pid=pid)
        what = (f"a forked copy of it, pid {pid}, lived {LASTING_S:.0f}s and more: DMTCP 4.2 "
                "restored such programs wrong even from images taken with no copy alive")
        self.message = self.message or stuck_message(what, 2)
        logger.warning("dmtcp: %s; no image of it is kept from now on, and the run stops at "
                       "its deadline unless it finishes first. Ways out: "
                       "DataLoader(num_workers=0), or --engine hooks", what)

    def _unusable_again(self, what: str, processes: int) -> bool:
        self._unusable += 1
        if self._unusable < 2:
            return False
        if self.message is None:
            self.message = stuck_message(f"twice in a row {what}", processes)
        return True

    def _event(self, event: str, **fields: object) -> None:
        if self.events_path is not None:
            append_event(self.events_path, event, **fields)

    def completed(self) -> None:
        """An image was kept: the stalls and refusals before it were passing ones."""
        self._unusable = 0

    def stop_ended(self, confirmed: bool, wrote: bool, sent_at: float | None, over_at: float,
                   processes: int, counted: bool) -> None:
        """A cycle with a stop request ended. Killed at its deadline before the stop's image
        began is a stuck image seen too briefly to tell; it counts with the stalls and
        refusals unless one of those was ``counted`` for this stop already."""
        if confirmed or counted:
            return
        if wrote or sent_at is None or over_at - sent_at < UNSTARTED_S:
            return
        self._unusable_again(f"no byte of its image written in the {over_at - sent_at:.0f}s "
                             "from the request to the deadline", processes)
