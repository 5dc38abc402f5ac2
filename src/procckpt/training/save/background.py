"""The background saver: a snapshot in the host arena, written and committed on a writer thread.

The checkpoint counts (is acknowledged to the launcher, listed, pruned against) only once it
was fsynced and renamed into place. One write is in flight at a time: a second request waits
for the first, so the extra host memory is one copy of the state, never two.

Why a thread and not a helper process: the thread spends its time in ``os.write``, CRC-32 and
``fsync``, which all release the GIL; ``python benchmarks/bench.py`` measures it holding the GIL
for about a millisecond in all while it writes 1 GiB, and a Python-heavy training loop runs
as fast beside the writer thread as beside a helper process doing the same write (the "GIL"
table of BENCHMARKS.md). A helper process would buy nothing measurable and cost the host copy
in shared memory, a second interpreter, and care that it never outlives (or renames a
checkpoint after) its parent.

Exit paths never lose a write in flight: the writer thread is not a daemon, so the interpreter
waits for it at exit (also after an exception in the training script); a stop request and the
end of training wait for it explicitly. A SIGKILL during a write leaves only a ``.tmp-ckpt-*``
directory, which is never loaded and is removed at the next start (see store/).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import ProcckptError, StorageError
from ...protocol.switches import ASYNC
from ...store import CheckpointInfo, CheckpointStore
from .arena import HostArena, NotSnapshottable, Snapshot
from .device import device_ops
from .fence import StepFence
from .frozen import ChunkPlan
from .writer import lasting_errors_explained, save_payload, tensors_of

__all__ = ["BackgroundSaver", "BackgroundWriteError", "WriteResult", "async_wanted", "staged",
           "ENV_ASYNC"]

logger = logging.getLogger(__name__)

#: Environment switch for background checkpoint writes: "0"/"false"/"off" turns them off.
ENV_ASYNC = ASYNC.name


def async_wanted(explicit: bool | None) -> bool:
    """Whether checkpoints should be written in the background: the Checkpointer argument
    wins, then ``$PROCCKPT_ASYNC``; on by default."""
    if explicit is not None:
        return bool(explicit)
    return ASYNC.read()


def staged(saver: BackgroundSaver | None, payload: Any) -> contextlib.AbstractContextManager[Any]:
    """What a checkpoint the caller waits for writes: see :meth:`BackgroundSaver.staged`;
    without a background saver (hence no arena), the state as it is."""
    return contextlib.nullcontext(payload) if saver is None else saver.staged(payload)


class BackgroundWriteError(ProcckptError):
    """A checkpoint written in the background failed; the previous one is still intact."""


@dataclass
class WriteResult:
    """What a background write reports when its checkpoint is durable."""

    info: CheckpointInfo
    snapshot_seconds: float
    write_seconds: float
    gil_free_seconds: float


class BackgroundSaver:
    """Writes one snapshot at a time on a (non-daemon) thread.

    ``capture`` copies the state into the arena (waiting first for a write in flight, whose
    memory it reuses); ``start`` writes that copy on a new thread. ``on_durable`` runs on the
    writer thread once the checkpoint is renamed into place (it acknowledges, logs, prunes);
    ``on_failed`` when the write raised. :meth:`wait` raises such a failure again.
    """

    def __init__(self, store: CheckpointStore, name: str = "state.pt",
                 fence: StepFence | None = None) -> None:
        self.store = store
        self.name = name
        self.arena = HostArena()
        #: Lets GPU copies run beside the next forward/backward (see fence.py).
        self.fence = fence
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reserving: threading.Thread | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, *, raise_failure: bool = True) -> None:
        """Wait for the write in flight, if any.

        Raises:
            BackgroundWriteError: the last background write failed (raised once; with
                ``raise_failure=False`` it is only forgotten: it was logged when it happened).
        """
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if raise_failure:
                raise BackgroundWriteError(
                    f"writing a checkpoint in the background failed ({error}); the previous "
                    f"checkpoint in {self.store.root} is intact. Set {ENV_ASYNC}=0 to write "
                    "checkpoints synchronously"
                ) from error

    @property
    def lasting_failure(self) -> StorageError | None:
        """The last write's failure if it will repeat (no space, no permission): training on
        would only make checkpoints that fail again (see Checkpointer._safe_point)."""
        error = self._error
        return error if isinstance(error, StorageError) else None

    def reserve(self, payload: Any) -> None:
        """Allocate the arena for ``payload`` on a thread of its own, while training goes on,
        so that the first checkpoint copies into ready memory like every later one (mapping
        and populating it costs ~0.4 s per GiB; page-locking for CUDA more)."""
        if self._reserving is not None:
            return

        def run() -> None:
            started = time.perf_counter()
            try:
                self.arena.reserve(payload)
            except Exception as e:  # noqa: BLE001 - the first capture meets it again
                logger.debug("no arena reserved ahead: %s", e)
                return
            logger.debug("host arena reserved ahead: %.1f MB in %.2fs", self.arena.capacity / 1e6,
                         time.perf_counter() - started)

        # Not a daemon: the interpreter waits for it at exit. A daemon thread still inside
        # torch when a script ends (an exception a step after the reserve started) would
        # take the GIL of a finalizing interpreter, and a thread ended in the middle of
        # torch's C++ aborts the process ("terminate called without an active exception"),
        # turning the script's exit code into SIGABRT.
        self._reserving = threading.Thread(target=run, name="procckpt-arena", daemon=False)
        self._reserving.start()

    @property
    def unreserved(self) -> bool:
        """Whether no arena was reserved ahead yet (:meth:`reserve` was not called)."""
        return self._reserving is None

    @property
    def reserved(self) -> bool:
        """Whether the arena reserved ahead is ready (False while it is being made)."""
        return self._reserving is not None and not self._reserving.is_alive()

    def capture(self, payload: Any) -> Snapshot:
        """Wait for a write in flight (and for the arena being reserved), then copy
        ``payload`` into the arena.

        Raises:
            NotSnapshottable: nothing was copied; write this checkpoint synchronously.
        """
        self.wait(raise_failure=False)
        if self._reserving is not None:
            self._reserving.join()
        return self.arena.capture(payload, self.fence)

    @contextlib.contextmanager
    def staged(self, payload: Any) -> Iterator[Any]:
        """The state to write for a checkpoint the caller waits for (a stop, ``save()``).

        State on a GPU is first copied into the arena in one bulk, page-locked copy, instead
        of ``torch.save`` copying it storage by storage through pageable memory; host state is
        written straight from its tensors, where a copy would only add its own time. The
        arena is free again when the block ends.
        """
        snapshot = None
        holds = device_ops().holds
        if any(holds(t) for t in tensors_of(payload)):
            try:
                snapshot = self.capture(payload)
            except NotSnapshottable as e:
                logger.info("writing the state as it is: it holds %s", e)
        if snapshot is None:
            yield payload
            return
        try:
            snapshot.wait_copied()
            yield snapshot.payload
        finally:
            snapshot.payload = None

    def start(self, snapshot: Snapshot, meta: dict[str, Any],
              on_durable: Callable[[WriteResult], None],
              on_failed: Callable[[BaseException], None],
              plan: ChunkPlan | None = None) -> None:
        """Write ``snapshot`` as a new checkpoint on the writer thread (its frozen tensors
        as ``plan`` says)."""
        assert not self.in_flight, "capture() waits for the previous write"
        thread = threading.Thread(target=self._write, name="procckpt-writer",
                                  args=(snapshot, meta, on_durable, on_failed, plan),
                                  daemon=False)
        self._thread = thread
        thread.start()

    def start_task(self, snapshot: Snapshot, write: Callable[[Any], None],
                   on_done: Callable[[], None],
                   on_failed: Callable[[BaseException], None]) -> None:
        """Run ``write(copy)`` on the writer thread: a part of a checkpoint that someone else
        commits (a rank's file in a group checkpoint). Failures go to ``on_failed`` only."""
        assert not self.in_flight, "capture() waits for the previous write"

        def run() -> None:
            try:
                snapshot.wait_copied()
                write(snapshot.payload)
            except BaseException as e:  # noqa: BLE001 - reported through on_failed
                logger.error("writing this rank's part of a checkpoint failed: %s", e)
                snapshot.payload = None
                on_failed(e)
                return
            snapshot.payload = None  # the arena is free for the next capture
            on_done()

        self._thread = threading.Thread(target=run, name="procckpt-writer", daemon=False)
        self._thread.start()

    def close(self) -> None:
        """Wait for the write in flight and give the arena's memory back."""
        try:
            self.wait()
        finally:
            if self._reserving is not None:
                self._reserving.join()
            self.arena.release()

    def _write(self, snapshot: Snapshot, meta: dict[str, Any],
               on_durable: Callable[[WriteResult], None],
               on_failed: Callable[[BaseException], None], plan: ChunkPlan | None) -> None:
        started = time.perf_counter()
        try:
            snapshot.wait_copied()
            with lasting_errors_explained(self.store, snapshot.payload), \
                    self.store.begin(meta) as pending:
                writer = save_payload(pending, self.name, snapshot.payload, plan)
                info = pending.commit()
        except BaseException as e:  # raised again by the training thread's next wait()
            if plan is not None:
                plan.failed()
            self._error = e
            snapshot.payload = None
            if not isinstance(e, StorageError):  # a lasting one ends the run, said there
                logger.error("writing a checkpoint in the background failed: %s; the "
                             "previous checkpoint stays the one to resume from", e)
            with contextlib.suppress(Exception):
                on_failed(e)
            return
        snapshot.payload = None  # the arena is free for the next capture
        if plan is not None:
            plan.durable()
        result = WriteResult(info, snapshot.seconds, time.perf_counter() - started,
                             writer.io_seconds)
        try:
            on_durable(result)
        except BaseException as e:
            self._error = e
            logger.error("after writing checkpoint %s: %s", info.name, e)
