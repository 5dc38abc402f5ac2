"""The in-process side of the hooks engine: what a training script imports.

    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    for epoch in ckpt.epochs(num_epochs):      # starts at the saved epoch on resume
        for batch in ckpt.batches(loader):     # resumes at the exact next batch
            ...

Exactness. A resumed run must draw the same random numbers as an uninterrupted one. Every
checkpoint therefore holds two RNG snapshots: the state *now* and the state at the *start of
the current epoch*. Resuming mid-epoch replays the epoch's start: the epoch-start state is
restored, the data loader is iterated again (so the sampler shuffles, and worker processes are
seeded, exactly as before) and the batches already trained on are drawn and dropped; then the
"now" state is restored and training continues with the next batch. Dropping batches costs
reading them once more, and buys exactness for samplers, worker seeds and random transforms
without knowing anything about them.

Safe points. The checkpointer only saves between steps: after each batch that ``batches``
yielded, and at the end of each epoch. Signals (SIGTERM from Slurm, Kubernetes or the
launcher) only set a flag; the save happens at the next safe point, never inside a handler.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ..protocol import control as ctl
from . import distributed as dist_
from ..errors import (EX_TEMPFAIL, CheckpointCorruptError, CheckpointReadError, ProcckptError,
                     StorageError, UsageError, exiting)
from ..protocol.events import append_event
from ..log import setup_logging
from .rng import capture_rng, generator_states, restore_generators, restore_rng
from .io.arena import NotSnapshottable
from .io.background import BackgroundSaver, WriteResult, async_wanted
from .io.mapped import MappedVerification, detach_from_file, private_copy
from .io.writer import write_checkpoint
from ..store import (CheckpointInfo, CheckpointStore, DirLock,
                    read_with_retries)

__all__ = ["Checkpointer", "DEFAULT_DIR", "default_dir"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_DIR = "procckpt-checkpoints"
PAYLOAD = "state.pt"
PAYLOAD_FORMAT = 1
#: How often a safe point looks at the control directory for a launcher's request.
POLL_SECONDS = 0.2


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


def default_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint dir: the launcher's, else ``explicit``, else $PROCCKPT_DIR, else
    ``./procckpt-checkpoints``."""
    launched = os.environ.get(ctl.ENV_TOKEN) and os.environ.get(ctl.ENV_DIR)
    if launched:
        chosen = Path(os.environ[ctl.ENV_DIR])
        if explicit is not None and Path(explicit).absolute() != chosen.absolute():
            logger.warning("procckpt run chose checkpoint dir %s; ignoring %s given in the script",
                           chosen, explicit)
        return chosen
    if explicit is not None:
        return Path(explicit)
    return Path(os.environ.get(ctl.ENV_DIR) or DEFAULT_DIR)


class Checkpointer:
    """Saves and restores a training run's whole state at safe points.

    Args:
        dir: checkpoint directory; under ``procckpt run`` the launcher's choice wins.
        model, optimizer, scheduler, scaler, **stateful: anything with ``state_dict()`` and
            ``load_state_dict()``; all are saved together and restored on resume.
        keep: how many recent checkpoints to keep (the best one is kept as well).
        save_every: save at the end of every N-th epoch. Default: 1 when the script runs on
            its own, off under ``procckpt run`` (which asks for checkpoints itself).
        interval: also save every ``interval`` seconds (at the next safe point).
        metric_mode: "max" or "min": which value of :meth:`report_metric` is best.
        save_best: save at the next safe point whenever the reported metric improves.
        sync_every: in a process group, agree on checkpoints every N steps (default:
            adaptive, about every 0.2 s; see procckpt.distributed).
        allow_reshard: resume a checkpoint written by another number of ranks (sharded state
            is resharded; the run is then no longer bit-identical to an uninterrupted one).
        async_save: write checkpoints taken at safe points in the background: training
            stalls only while the state is copied into host memory, and the checkpoint counts
            once it is durable. Default: on, unless ``$PROCCKPT_ASYNC=0``. A stop request,
            the end of training and :meth:`save` always write synchronously, and so does a
            process group (its ranks commit one checkpoint together).

    In a process group (torchrun, srun) create it on every rank after
    ``init_process_group()``: the ranks agree on each checkpoint, rank 0 writes the
    replicated state, every rank its random streams and its :class:`procckpt.Sharded` shards.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        *,
        model: Stateful | None = None,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        keep: int = 2,
        save_every: int | None = None,
        interval: float | None = None,
        metric_mode: str = "max",
        save_best: bool = True,
        sync_every: int | None = None,
        allow_reshard: bool = False,
        async_save: bool | None = None,
        **stateful: Stateful,
    ) -> None:
        setup_logging()
        named = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        self._statefuls: dict[str, Stateful] = {
            k: v for k, v in {**named, **stateful}.items() if v is not None
        }
        for name, obj in self._statefuls.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name}={obj!r} has no state_dict()/load_state_dict()")
        if metric_mode not in ("max", "min"):
            raise ValueError(f"metric_mode must be 'max' or 'min', not {metric_mode!r}")

        try:
            token = os.environ.get(ctl.ENV_TOKEN)
            if not token and os.environ.get(ctl.ENV_ENGINE) == "dmtcp":
                # The launcher holds the dir's lock and images this whole process; checkpoints of
                # our own would compete with its images.
                raise ProcckptError(
                    "this script uses procckpt.Checkpointer, but procckpt run is checkpointing it "
                    "with DMTCP (--engine auto could not see the script, or --engine dmtcp was "
                    "given): run it with --engine hooks")
            self.launched = bool(token)
            self.dir = default_dir(dir).absolute()
            self.store = CheckpointStore(self.dir, keep=keep)
            self.restart = _env_count(ctl.ENV_RESTART)
            self.rank = _rank()
            self.is_writer = self.rank == 0
            self._dist = dist_.coordinator_for(sync_every, allow_reshard)
            self._member = _GroupMember(self)  # how the coordinator sees this rank
            self.allow_reshard = allow_reshard
            self._polls_control = dist_.polls_control(self.rank)
            self.save_every = (save_every if save_every is not None
                               else (None if self.launched else 1))
            self.interval = interval
            self.metric_mode = metric_mode
            self.save_best = save_best
            self.extras: dict[str, Any] = {}
            #: Position: ``epoch`` is the epoch in progress (or next to run), ``batch`` the number
            #: of batches of it already trained on, ``step`` the batches (or epochs) done in all.
            self.epoch = 0
            self.batch = 0
            self.step = 0
            self.metric: float | None = None
            self.best_metric: float | None = None
            self.last_checkpoint: CheckpointInfo | None = None
            #: Seconds the last resume took to verify, load and apply the checkpoint.
            self.restore_seconds: float | None = None

            self._lock: DirLock | None = None
            self._control: ctl.ControlChannel | None = None
            self._next_poll = 0.0
            self._request: ctl.Request | None = None
            self._stop_reason: str | None = None
            self._best_pending = False
            self._last_save = time.monotonic()
            self._saved_at: tuple[int, int, int] | None = None
            self._epoch_rng: dict[str, Any] | None = None
            self._epoch_used_batches = False
            self._loader_generators: list[torch.Generator] = []
            self._resume_rng: dict[str, Any] | None = None
            #: Saved states of the loader's generators, for the first batches() after a resume at
            #: an epoch boundary.
            self._boundary_generators: list[torch.Tensor] | None = None
            self._pending_skip: int | None = None
            self._finished = False
            self._in_epochs = False
            #: Inside the body of the batches() loop (between a yield and the next batch).
            self._in_batch = False
            #: Set when procckpt itself ends the process (a planned stop, a storage failure).
            self._exiting = False
            in_background = self.is_writer and self._dist is None and async_wanted(async_save)
            self._background = BackgroundSaver(self.store, PAYLOAD) if in_background else None

            if self.is_writer:
                self.store.open()
            if not self.launched and self.is_writer:
                # On its own the script owns the directory; under procckpt run the launcher does.
                self._lock = self.store.lock(purpose="training script")
                self.store.clean_temporaries()
            if self.launched:
                assert token is not None
                self._control = ctl.ControlChannel(self.store.control_dir, token)
            self._install_signal_handlers()
            try:
                self.resumed_from = self._resume()
            except BaseException:
                self.close()  # a refused checkpoint must not leave the dir locked by a dead object
                raise
            if self._control is not None and self.is_writer:
                try:
                    self._control.say_hello(
                        step=self.step, epoch=self.epoch,
                        resumed_from=self.resumed_from and self.resumed_from.name)
                except OSError as e:
                    logger.warning("could not tell procckpt run that training started (%s: %s)",
                                   self._control.dir, e.strerror or e)
        except ProcckptError as e:
            raise _one_line(e) from e.__cause__

    # -- public API ------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield epoch numbers from the saved epoch (0 on a fresh start) up to ``num_epochs``.

        The end of each epoch is a safe point. After the last epoch a final checkpoint is
        saved and the run is marked complete.
        """
        if self.epoch >= num_epochs:
            if self.resumed_from is not None:
                logger.info("training already finished (epoch %d of %d); nothing to do",
                            self.epoch, num_epochs)
            self._finish()
            return
        first = True
        self._in_epochs = True
        while self.epoch < num_epochs:
            if first and self._resume_rng is not None:
                if self._pending_skip:  # mid-epoch: replay the epoch from its start
                    assert self._epoch_rng is not None
                    restore_rng(self._epoch_rng)
                else:
                    self._restore_boundary_rng()
            else:
                self._epoch_rng = capture_rng()
            first = False
            self._epoch_used_batches = False
            try:
                yield self.epoch
            except GeneratorExit:
                self._left_loop_early()
                raise
            self.epoch += 1
            self.batch = 0
            self._epoch_rng = None
            if not self._epoch_used_batches:
                self.step += 1
            self._safe_point(epoch_end=True)
        self._in_epochs = False
        self._finish()

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches; on resume, start at the first batch not yet trained on.

        After each batch (when the loop body asks for the next one) is a safe point.
        """
        if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0):
            self._exiting = True
            raise _one_line(UsageError(
                "DataLoader(persistent_workers=True) keeps its workers and their random state "
                "from one epoch to the next, where no checkpoint can reach them, so a resumed run "
                "would differ from an uninterrupted one: pass persistent_workers=False (workers "
                "then start each epoch from the checkpointed random state)"))
        generators = _loader_generators(loader)
        skip = self._pending_skip or 0
        self._pending_skip = None
        if skip:
            assert self._epoch_rng is not None
            restore_generators(generators, self._epoch_rng.get("loader_generators", []))
        else:
            if self._resume_rng is not None:  # batches() without epochs(), resumed at its start
                self._restore_boundary_rng()
            if self._boundary_generators is not None:
                # Resumed at an epoch boundary: the loader's own generators continue from the
                # saved state too, as they did in the uninterrupted run.
                restore_generators(generators, self._boundary_generators)
                self._boundary_generators = None
            if self._epoch_rng is None:  # batches() used without epochs()
                self._epoch_rng = capture_rng()
            self._epoch_rng["loader_generators"] = generator_states(generators)
        self._loader_generators = generators
        self._epoch_used_batches = True
        iterator = iter(loader)
        if skip:
            started = time.monotonic()
            for done in range(skip):
                try:
                    next(iterator)
                except StopIteration:
                    self._exiting = True
                    raise _one_line(ProcckptError(
                        f"the data loader ran out after {done} batches, but the checkpoint "
                        f"was taken after batch {skip} of this epoch: did the data set or "
                        "batch size change? Use a new checkpoint dir to start over."
                    )) from None
            assert self._resume_rng is not None
            restore_rng(self._resume_rng)
            restore_generators(generators, self._resume_rng.get("loader_generators", []))
            self._resume_rng = None
            logger.info("skipped the %d batches of epoch %d trained before the restart "
                        "(%.1fs)", skip, self.epoch, time.monotonic() - started)
        self.batch = skip
        for item in iterator:
            self._in_batch = True
            yield item
            self._in_batch = False
            self.batch += 1
            self.step += 1
            self._safe_point()
        if not self._in_epochs:  # a single pass without epochs(): it is over
            self.batch = 0
            self._epoch_rng = None

    def finish(self) -> None:
        """End training here: save a final checkpoint and mark the run complete, so that a
        rerun does not train again. For leaving the loops early::

            for epoch in ckpt.epochs(100):
                for batch in ckpt.batches(loader):
                    ...
                    if loss < target:
                        ckpt.finish()   # the batch just trained counts
                        break
                if ckpt.finished:
                    break

        The loops call it themselves when they run to their end.
        """
        if self._in_batch:  # called from the loop body: the batch it trained on is done
            self._in_batch = False
            self.batch += 1
            self.step += 1
        self._finish()

    @property
    def finished(self) -> bool:
        """Whether training ended: the loops ran to their end, or :meth:`finish` was called."""
        return self._finished

    def report_metric(self, value: float) -> bool:
        """Record a validation metric; returns True if it is the best so far. With
        ``save_best``, a new best is saved at the next safe point and kept by pruning."""
        value = float(value)
        self.metric = value
        better = (self.best_metric is None
                  or (value > self.best_metric if self.metric_mode == "max"
                      else value < self.best_metric))
        if better:
            self.best_metric = value
            self._best_pending = self.save_best
        return better

    def request_checkpoint(self, stop: bool = False, reason: str = "script") -> None:
        """Ask for a checkpoint at the next safe point (and to exit after it with ``stop``)."""
        if stop:
            self._stop_reason = reason
        else:
            self._request = ctl.Request("", 0, ctl.ACTION_CHECKPOINT, reason, time.time())

    def save(self, reason: str = "manual") -> CheckpointInfo | None:
        """Save now. Call only between steps (on every rank in a process group); the loops
        above do it for you.

        Raises:
            StorageError: no space or no permission in the checkpoint dir (logged in one line;
                uncaught, it ends the process with exit code 74 and no traceback).
        """
        try:
            return self._save(reason)
        except ProcckptError as e:
            raise _one_line(e) from e.__cause__

    def _save(self, reason: str) -> CheckpointInfo | None:
        if self._dist is not None:
            return self._dist.save(self._member, reason)
        if not self.is_writer:
            return None
        if self._background is not None:
            # A failed background write was logged; this checkpoint supersedes it.
            self._background.wait(raise_failure=False)
        started = time.monotonic()
        info = write_checkpoint(self.store, self._meta(reason), self._payload(), PAYLOAD)
        self.store.prune()
        self._after_save(info, reason, time.monotonic() - started)
        return info

    def flush(self) -> None:
        """Wait until the checkpoint being written in the background, if any, is durable.

        Raises:
            BackgroundWriteError: that write failed (the previous checkpoint is intact).
        """
        if self._background is not None:
            self._background.wait()

    def _payload(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """The replicated state (rank 0's in a group), without the ``exclude`` statefuls."""
        return {
            "format": PAYLOAD_FORMAT,
            "statefuls": {name: obj.state_dict() for name, obj in self._statefuls.items()
                          if not exclude or name not in exclude},
            "progress": {"epoch": self.epoch, "batch": self.batch, "step": self.step,
                         "best_metric": self.best_metric},
            **self._rng_payload(),
            "extras": _checked_extras(self.extras),
        }

    def _rng_payload(self) -> dict[str, Any]:
        return {"rng": self._rng_now(), "epoch_rng": self._epoch_rng if self.batch else None}

    def _meta(self, reason: str) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "batch": self.batch, "reason": reason,
            "engine": "hooks", "torch": torch.__version__, "restart": self.restart,
            "job_id": _job_id(), "metric": self.metric, "metric_mode": self.metric_mode,
            "python": sys.version.split()[0], "host": socket.gethostname(),
        }

    def _after_save(self, info: CheckpointInfo, reason: str, seconds: float) -> None:
        """Book-keeping after a synchronous save (a group's too, see _GroupMember)."""
        self._last_save = time.monotonic()
        self._saved_at = (self.epoch, self.batch, self.step)
        self._record_saved(info, reason, self._saved_at, seconds)

    def _save_in_background(self, reason: str) -> bool:
        """Copy the state and write it on the writer thread; False if it must be written
        synchronously instead. The request is acknowledged once the checkpoint is durable."""
        assert self._background is not None
        started = time.monotonic()
        position = (self.epoch, self.batch, self.step)
        request = self._request
        meta = self._meta(reason)

        try:
            snapshot = self._background.capture(self._payload())
        except NotSnapshottable as e:
            logger.info("writing this checkpoint synchronously: the state holds %s", e)
            return False
        stall = time.monotonic() - started

        def durable(result: WriteResult) -> None:  # runs on the writer thread
            self._record_saved(result.info, reason, position, time.monotonic() - started,
                               stall=stall)
            self._acknowledge(request, result.info, position[2], stopping=False)
            self.store.prune()  # after the ack: the launcher need not wait for deletions

        def failed(error: BaseException) -> None:  # runs on the writer thread
            self._saved_at = None  # so that the end of training saves again
            append_event(self.store.events_path, "checkpoint-failed", step=position[2],
                         reason=reason, error=str(error))
            self._acknowledge(request, None, position[2], stopping=False, error=str(error))

        self._request = None
        self._last_save = time.monotonic()
        self._saved_at = position  # before the thread starts: failed() may reset it
        self._background.start(snapshot, meta, durable, failed)
        logger.debug("state copied for checkpoint in %.3fs (%.1f MB, %d tensors)", stall,
                     snapshot.nbytes / 1e6, snapshot.tensors)
        return True

    def _record_saved(self, info: CheckpointInfo, reason: str, position: tuple[int, int, int],
                      seconds: float, stall: float | None = None) -> None:
        """Book-keeping once a checkpoint is durable (on the writer thread for async ones)."""
        self.last_checkpoint = info
        if not self.is_writer:
            return
        epoch, batch, step = position
        background = {} if stall is None else {"stall": round(stall, 4), "background": True}
        append_event(self.store.events_path, "checkpoint", checkpoint=info.name, step=step,
                     epoch=epoch, batch=batch, bytes=info.nbytes, seconds=round(seconds, 4),
                     reason=reason, restart=self.restart, **background)
        logger.info("checkpoint %s saved: step %d, epoch %d, %.1f MB in %.2fs%s (%s)", info.name,
                    step, epoch, info.nbytes / 1e6, seconds,
                    "" if stall is None else f", training paused {stall:.3f}s", reason)

    def close(self) -> None:
        """Wait for a checkpoint in flight, then release the checkpoint dir (done
        automatically when the process exits)."""
        try:
            if self._background is not None:
                self._background.close()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # -- internals -------------------------------------------------------------------------
    def _left_loop_early(self) -> None:
        """The ``epochs()`` loop was closed before its end: a ``break``, an exception, or
        our own stop. Only the first needs words: nothing marks the run complete."""
        if self._finished or self._exiting:
            return
        logger.warning(
            "the ckpt.epochs() loop was left before its end (epoch %d, step %d): no final "
            "checkpoint was saved and the run is not marked complete, so running the script "
            "again resumes from the last checkpoint; to end training early, call ckpt.finish() "
            "before break", self.epoch, self.step)

    def _restore_boundary_rng(self) -> None:
        """Resume at the start of an epoch: every random stream continues from the checkpoint;
        the loader's generators are restored once :meth:`batches` sees the loader."""
        assert self._resume_rng is not None
        restore_rng(self._resume_rng)
        self._boundary_generators = list(self._resume_rng.get("loader_generators") or [])
        self._resume_rng = None

    def _rng_now(self) -> dict[str, Any]:
        rng = capture_rng()
        rng["loader_generators"] = generator_states(self._loader_generators)
        return rng

    def _resume(self) -> CheckpointInfo | None:
        started = time.monotonic()
        if self._dist is not None:
            loaded = self._dist.load_latest(self._member)  # collective; the payload is read plainly
            if loaded is not None:
                loaded = loaded[0], self._apply(*loaded)
        elif not self.is_writer and not self.store.ckpt_root.is_dir():
            return None
        else:
            loaded = self._load_latest()  # verified, memory-mapped and applied
        if loaded is None:
            return None
        info, mapped = loaded
        # What procckpt keeps of the payload gets memory of its own; the rest stays mapped.
        payload = private_copy({k: mapped.get(k) for k in ("progress", "extras", "rng",
                                                            "epoch_rng")})
        del mapped
        progress = payload["progress"]
        self.epoch, self.batch, self.step = (int(progress["epoch"]), int(progress["batch"]),
                                             int(progress["step"]))
        self.best_metric = progress.get("best_metric")
        self.extras = dict(payload.get("extras") or {})
        self._resume_rng = payload["rng"]
        if self.batch:
            self._epoch_rng = payload["epoch_rng"]
            self._pending_skip = self.batch
        self._saved_at = (self.epoch, self.batch, self.step)
        saved_restart = info.manifest.get("restart")
        if isinstance(saved_restart, int):  # a rerun by hand is a restart too
            self.restart = max(self.restart, saved_restart + 1)
        self.last_checkpoint = info
        self.restore_seconds = time.monotonic() - started
        if self.is_writer:
            append_event(self.store.events_path, "resume", checkpoint=info.name, step=self.step,
                         epoch=self.epoch, batch=self.batch, restart=self.restart,
                         bytes=info.nbytes, seconds=round(self.restore_seconds, 4))
        logger.info("resumed from %s: epoch %d, batch %d, step %d (restart %d); %.1f MB "
                    "restored in %.2fs", info.name, self.epoch, self.batch, self.step,
                    self.restart, info.nbytes / 1e6, self.restore_seconds)
        return info

    def _single_process_view(self, info: CheckpointInfo, payload: dict[str, Any],
                             ) -> dict[str, Any]:
        """Refuse (or reshard) a checkpoint of several ranks; load its sharded state."""
        saved_world = int(info.manifest.get("world_size", 1) or 1)
        if saved_world != 1:
            dist_.check_world_size(info, saved_world, 1, self.allow_reshard)
            payload = dist_.rescale_position(payload, saved_world, 1)
        dist_.load_sharded(self._statefuls, info.path, list(info.manifest.get("sharded") or []),
                           use_group=False)
        return payload

    def _read_payload(self, info: CheckpointInfo, mmap: bool = False) -> dict[str, Any]:
        # weights_only: safe even on a file whose checksum is not verified yet.
        payload = torch.load(info.file(PAYLOAD), map_location="cpu", weights_only=True,
                             mmap=mmap)
        if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
            raise ValueError("it is not a procckpt hooks checkpoint")
        return payload

    def _load_latest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """The newest checkpoint that verifies *and* loads safely, falling back loudly; its
        state is applied to the statefuls.

        The file is memory-mapped, not read into fresh memory: its tensors are views of the
        page cache until ``load_state_dict`` copies them into the model, so a restore never
        holds the state twice.
        """
        started = time.monotonic()
        # The payload's checksum is verified on the mapping below, before any of it is used;
        # the other files (if any) and all sizes are checked here.
        for info in self.store.valid_checkpoints(skip_crc=frozenset({PAYLOAD})):
            try:
                payload = read_with_retries(
                    info.file(PAYLOAD), lambda: self._read_payload(info, mmap=True))  # noqa: B023
            except CheckpointReadError:
                raise  # the storage failed, not the checkpoint: stop, rename nothing
            except Exception as e:  # UnpicklingError for a foreign pickle, and worse
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.store.quarantine(info.path, f"it cannot be loaded safely ({reason})")
                continue
            mapped = time.monotonic()
            expect = info.manifest["files"].get(PAYLOAD, {})
            check = MappedVerification(payload, info.file(PAYLOAD), int(expect.get("bytes", -1)),
                                       int(expect.get("crc32", -1)))
            try:
                # Loading runs alongside the checksum (one read of the file). If the checksum
                # then fails, the next checkpoint's load overwrites all of it, or we give up.
                payload = self._apply(info, payload)
            except Exception:
                if check.result() is None:
                    raise  # a genuine mismatch between script and checkpoint
            problem = check.result()
            if check.read_error is not None:
                error = check.read_error
                raise CheckpointReadError(
                    f"cannot read {info.file(PAYLOAD)}: {error.strerror or error}; nothing was "
                    "renamed or deleted: fix the file system and run again")
            if problem is not None:
                del payload
                self.store.quarantine(info.path, problem)
                continue
            logger.debug("%s mapped in %.2fs, loaded and verified in %.2fs", info.name,
                         mapped - started, time.monotonic() - mapped)
            return info, payload
        if any(self.store.ckpt_root.glob("ckpt-*")):
            raise CheckpointCorruptError(
                f"no checkpoint in {self.store.ckpt_root} can be loaded (see the warnings above);"
                " refusing to start from scratch: move the directory away to train anew"
            )
        return None

    def _apply(self, info: CheckpointInfo, payload: dict[str, Any]) -> dict[str, Any]:
        """Load the statefuls from a (possibly memory-mapped) payload; return the payload,
        its position rescaled if it was written by another number of ranks."""
        if self._dist is None:
            payload = self._single_process_view(info, payload)
        states = payload["statefuls"]
        sharded = set(info.manifest.get("sharded") or [])
        missing = sorted(set(self._statefuls) - set(states) - sharded)
        if missing:
            raise ProcckptError(
                f"checkpoint {info.name} in {self.dir} has no state for {', '.join(missing)}: it "
                "was written by another script or other Checkpointer arguments; use a new dir"
            )
        for name, obj in self._statefuls.items():
            if name not in sharded:
                obj.load_state_dict(states[name])
        # Nothing may keep pointing into the mapped file (see detach_from_file). Sharded
        # state came through DCP, not from this file (and holds DTensors, which have no
        # storage of their own to compare).
        detach_from_file(payload, [obj for name, obj in self._statefuls.items()
                                   if name not in sharded])
        return payload

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the script (or its launcher, e.g. torchrun) handles SIGTERM itself

        def on_term(signum: int, frame: object) -> None:
            # Only record: the checkpoint is taken at the next safe point.
            self._stop_reason = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, on_term)

    def _safe_point(self, epoch_end: bool = False) -> None:
        now = time.monotonic()
        if self._control is not None and self._polls_control and now >= self._next_poll:
            self._next_poll = now + POLL_SECONDS
            request = self._control.poll()
            if request is not None:
                if request.action == ctl.ACTION_STOP:
                    self._stop_reason = request.reason
                self._request = request
        flags = self._wanted(now, epoch_end)
        if self._dist is not None:
            # Ranks act only on what the whole group agreed on, at the same step.
            agreed = self._dist.agree(self._member, flags or dist_.Flags(), epoch_end)
            if agreed is None:
                return
            self._adopt(agreed)
            flags = agreed
        if flags is None:
            return  # the common case, every step: nothing to save
        reason = self._reason_for(flags)
        if reason is None:
            return
        self._best_pending = False
        if (self._background is not None and self._stop_reason is None
                and self._save_in_background(reason)):
            return  # acknowledged by the writer thread once durable
        try:
            info = self._save(reason)
        except StorageError as e:
            # Trying again would fail again: say so, stop, and let the launcher not restart.
            self._answer(None, stopping=True, error=str(e))
            self._exiting = True
            self.close()
            raise _one_line(e) from e.__cause__
        self._answer(info, stopping=self._stop_reason is not None)
        if self._stop_reason is not None:
            self._exit_after_stop()

    def _wanted(self, now: float, epoch_end: bool) -> dist_.Flags | None:
        """What this rank would save for at this safe point; None for nothing (and no object
        built: this runs after every step)."""
        stop = self._stop_reason is not None
        checkpoint = self._request is not None
        interval = bool(self.interval and now - self._last_save >= self.interval)
        epoch = bool(epoch_end and self.save_every and self.epoch % self.save_every == 0)
        if not (stop or checkpoint or interval or epoch or self._best_pending):
            return None
        return dist_.Flags(
            stop=stop, checkpoint=checkpoint, interval=interval, best=self._best_pending,
            epoch=epoch, seq=self._request.seq if self._request is not None else 0,
        )

    def _adopt(self, agreed: dist_.Flags) -> None:
        """Take on what other ranks asked for, so that this rank saves (and stops) with them."""
        if agreed.stop and self._stop_reason is None:
            self._stop_reason = "stop requested on another rank"
        mine = self._request.seq if self._request is not None else 0
        if (agreed.stop or agreed.checkpoint) and (self._request is None or agreed.seq > mine):
            token = self._control.token if self._control is not None and agreed.seq else ""
            self._request = ctl.Request(
                token, agreed.seq, ctl.ACTION_STOP if agreed.stop else ctl.ACTION_CHECKPOINT,
                self._stop_reason or "checkpoint requested on another rank", time.time())

    def _reason_for(self, flags: dist_.Flags) -> str | None:
        if flags.stop:
            return self._stop_reason
        if flags.checkpoint:
            return self._request.reason if self._request is not None else "checkpoint"
        return flags.reason()

    def _answer(self, info: CheckpointInfo | None, stopping: bool, error: str | None = None,
                ) -> None:
        request, self._request = self._request, None
        self._acknowledge(request, info, self.step, stopping, error)

    def _acknowledge(self, request: ctl.Request | None, info: CheckpointInfo | None, step: int,
                     stopping: bool, error: str | None = None) -> None:
        if self._control is None or not self.is_writer:
            return
        seq = request.seq if request is not None and request.token else 0
        try:
            self._control.acknowledge(ctl.Ack(
                token=self._control.token, seq=seq, checkpoint=info.name if info else None,
                step=step, stopping=stopping, error=error, time=time.time()))
        except OSError as e:  # a full disk: the launcher learns it from the exit instead
            logger.warning("could not answer procckpt run in %s: %s", self._control.dir,
                           e.strerror or e)

    def _exit_after_stop(self) -> None:
        # procckpt run asks for 0: it knows from the ack that this was a planned stop, and a
        # non-zero exit would make torchrun print a failure report for every rank.
        code = (_env_count(ctl.ENV_STOP_EXIT) if os.environ.get(ctl.ENV_STOP_EXIT)
                else EX_TEMPFAIL)
        logger.info("stopping after checkpoint at step %d (%s); run again to resume",
                    self.step, self._stop_reason)
        self._exiting = True
        self.close()
        raise SystemExit(code)

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._background is not None:  # the checkpoint being written is the one to compare
            self._background.wait(raise_failure=False)
        info = self.last_checkpoint
        if self._saved_at != (self.epoch, self.batch, self.step) or info is None:
            info = self.save("end")
        if self.is_writer:
            self.store.mark_complete(step=self.step, epoch=self.epoch,
                                     checkpoint=info.name if info else None,
                                     token=self._control.token if self._control else None)
            append_event(self.store.events_path, "complete", step=self.step, epoch=self.epoch)
        if self._request is not None or self._stop_reason is not None:
            self._answer(info, stopping=True)


class _GroupMember:
    """This rank's Checkpointer as the group coordinator sees it (``distributed.GroupMember``):
    the one place where the coordinator's needs meet the Checkpointer's internals."""

    payload_name = PAYLOAD

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._ck = checkpointer
        self.store = checkpointer.store

    @property
    def step(self) -> int:
        return self._ck.step

    @property
    def statefuls(self) -> dict[str, Any]:
        return self._ck._statefuls

    def checkpoint_meta(self, reason: str) -> dict[str, Any]:
        return self._ck._meta(reason)

    def replicated_payload(self, exclude: set[str]) -> dict[str, Any]:
        return self._ck._payload(exclude=exclude)

    def rank_payload(self) -> dict[str, Any]:
        return self._ck._rng_payload()

    def record_save(self, info: CheckpointInfo, reason: str, seconds: float) -> None:
        self._ck._after_save(info, reason, seconds)

    def load_newest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        return self._ck._load_latest()

    def read_payload(self, info: CheckpointInfo) -> dict[str, Any]:
        return self._ck._read_payload(info)


def _checked_extras(extras: dict[str, Any]) -> dict[str, Any]:
    """Refuse extras that a weights_only load could not read back."""
    def check(value: Any, where: str) -> None:
        if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{where}[{i}]")
            return
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, (str, int)):
                    raise ProcckptError(f"extras{where}: key {k!r} must be a str or int")
                check(v, f"{where}[{k!r}]")
            return
        raise ProcckptError(
            f"extras{where} is a {type(value).__name__}; checkpoints hold only tensors, "
            "numbers, strings, None, lists and dicts (so that they load with weights_only=True)"
        )

    check(extras, "")
    return extras


def _loader_generators(loader: object) -> list[torch.Generator]:
    """Generators a DataLoader draws its order from besides torch's global one."""
    found: list[torch.Generator] = []
    for owner in (loader, getattr(loader, "sampler", None),
                  getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _one_line(error: ProcckptError) -> ProcckptError:
    """Log ``error`` as the one line a user reads, and make it end the process with its exit
    code (no traceback) unless the script catches it."""
    logger.error("error: %s", error)
    return exiting(error)


def _env_count(name: str) -> int:
    """A count the launcher passes in the environment; 0, with a warning, if it is not one."""
    text = os.environ.get(name, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        logger.warning("ignoring %s=%r: expected a whole number (it is set by procckpt run)",
                       name, text)
        return 0
    return value


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def _job_id() -> str | None:
    job = os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{job}_{task}" if job and task else job
