"""The in-process side of the hooks engine: what a training script imports.

    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    for epoch in ckpt.epochs(num_epochs):      # starts at the saved epoch on resume
        for batch in ckpt.batches(loader):     # resumes at the exact next batch
            ...

The Checkpointer is the front of the training side; its parts do the work: ``loops`` (the
three loops), ``progress`` (position and random streams), ``triggers`` (what asks for a
checkpoint), ``saving``, ``resume`` and ``payload`` (what ``state.pt`` holds), ``liveness`` and
``timing`` (for the launcher). It saves only at safe points: after each batch that ``batches``
yielded, and at each epoch's end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, TypeVar

from ..errors import ProcckptError, ResumeAuditError, StorageError, logged_exit
from ..log import setup_logging
from ..protocol import control as ctl
from ..protocol.events import append_event
from ..store import CheckpointInfo, CheckpointStore, DirLock
from . import group as dist_
from . import loops
from .audit import OFF, BatchAudit, audit_mode
from .fingerprints import CheckHook, check_hook
from .group.tier import GroupTier
from .link.context import DEFAULT_DIR, LaunchContext, default_dir, dir_and_remote, open_control
from .link.flags import Flags
from .link.liveness import Liveness, NoLiveness
from .link.timing import CycleTimer
from .link.triggers import SaveTriggers
from .position.progress import Progress
from .position.resplit import BEFORE
from .saving import Saves, background_savers, frozen_chunks, memory_tier
from .shutdown import skip_final_collection
from .state import reserve
from .state.first_step import ADVICE, StateExpectation, live_state
from .state.member import CheckpointerAsMember
from .state.payload import Stateful, build_payload, checkpoint_meta, collect_statefuls
from .state.resume import apply_payload, finished_already, load_newest_verified, resume_newest
from .state.vml import settle_vector_math

__all__ = ["Checkpointer", "DEFAULT_DIR", "default_dir"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _delegated(owner: str, name: str, doc: str) -> Any:
    """A read-write attribute that lives on one of the Checkpointer's parts."""
    return property(lambda self: getattr(getattr(self, owner), name),
                    lambda self, value: setattr(getattr(self, owner), name, value), doc=doc)


def _prepare_process() -> None:
    """What the process needs once, whichever Checkpointer comes first."""
    settle_vector_math()  # before the first step's threads race on MKL's dispatch
    skip_final_collection()  # the exit leaves torch's objects to the system (shutdown.py)


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
            the end of training and :meth:`save` write synchronously. In a process group each
            rank writes its part so, its ``Sharded`` shards too (in DCP's format).

    In a process group (torchrun, srun) create it on every rank after
    ``init_process_group()``: the ranks agree on each checkpoint, rank 0 writes the
    replicated state, every rank its random streams and its :class:`procckpt.Sharded` shards.
    """

    #: The state a resume restored, fingerprinted for its first step's audit (set while it
    #: loads: state/first_step.py).
    _restored_state: tuple[Any, Any, str | None] | None = None
    #: Bytes the restore copied over the optimizer's earlier state (state/mapped.py).
    _written_over = 0
    #: Where the last ``batches()`` pass ended (loops.py: one pass an epoch).
    _pass_ended: tuple[bool, int | None, int | None] | None = None

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
        setup_logging(label="train" if os.environ.get(ctl.ENV_TOKEN) else None)
        _prepare_process()
        self._statefuls = collect_statefuls(model=model, optimizer=optimizer,
                                            scheduler=scheduler, scaler=scaler, **stateful)
        if metric_mode not in ("max", "min"):
            raise ValueError(f"metric_mode must be 'max' or 'min', not {metric_mode!r}")

        try:
            self._context = context = LaunchContext.from_environment()
            token = context.token
            self.launched = context.launched
            local, remote = dir_and_remote(dir)
            self.dir = local.absolute()
            self.store = CheckpointStore(self.dir, keep=keep, journal=append_event, remote=remote)
            self.restart, self.rank = context.restart, context.rank
            self.is_writer = self.rank == 0
            #: The events journal, for the rank that writes it (rank 0).
            self._journal = self.store.events_path if self.is_writer else None
            self._dist = dist_.coordinator_for(sync_every, allow_reshard)
            self._member = CheckpointerAsMember(self)  # how the coordinator sees this rank
            self.allow_reshard = allow_reshard
            self.extras: dict[str, Any] = {}
            self._progress = Progress()
            #: Seconds the last resume took to verify, load and apply the checkpoint.
            self.restore_seconds: float | None = None

            self._lock: DirLock | None = None
            control = open_control(self.store.control_dir, token, self.rank)
            self._triggers = SaveTriggers(
                control, polls_control=dist_.polls_control(self.rank), answers=self.is_writer,
                interval=interval, save_best=save_best, metric_mode=metric_mode,
                save_every=save_every if save_every is not None else (None if token else 1))
            #: Rank 0's heartbeat for hang detection, and its start-up times (launched runs).
            self._liveness = Liveness(control, threading.current_thread()) \
                if control is not None and self.is_writer else NoLiveness()
            self._timer = CycleTimer(self._journal if control is not None else None)
            self._check = check_hook()
            self._control = control
            self._audit = self._open_audit()
            self._finished = False
            #: Inside the body of the batches() loop (between a yield and the next batch).
            self._in_batch = False
            #: Whether the last micro-batch ended a gradient accumulation (accumulation.py).
            self._window: Callable[[], bool] | None = None
            #: Set when procckpt itself ends the process (a planned stop, a storage failure).
            self._exiting = False
            self._background, group_writes = background_savers(
                self.store, self._dist, self.is_writer, self._statefuls, async_save)
            self._saves = Saves(self.store, self._background, self._triggers,
                                is_writer=self.is_writer, group=group_writes,
                                frozen=frozen_chunks(self.store, self._statefuls, self.is_writer))
            self._saves.longest_gap = lambda: self._liveness.longest_gap
            #: The newest state every few steps in the launcher's memory (save/tier.py).
            self._tier = memory_tier(self._journal, self._dist, self.is_writer, self._statefuls)

            if self.is_writer:
                self.store.open()
            if not self.launched and self.is_writer:
                # On its own the script owns the directory; under procckpt run the launcher does.
                self._lock = self.store.lock(purpose="training script")
                self.store.clean_temporaries()
            self._triggers.install_signal_handlers()
            self._liveness.start()  # from here on a long preparation is no hang
            try:
                self._finished = finished_already(self.store, token, self.is_writer)
                with self._liveness.working():
                    self.resumed_from = self._resume()
                self._liveness.step = self.step
                self._timer.ready(self.restore_seconds, *self._restored())
            except BaseException:
                self.close()  # a refused checkpoint must not leave the dir locked by a dead object
                raise
            if control is not None and self.is_writer:
                try:
                    control.say_hello(step=self.step, epoch=self.epoch,
                                      resumed_from=self.resumed_from and self.resumed_from.name)
                except OSError as e:
                    logger.warning("could not tell procckpt run that training started (%s: %s)",
                                   control.dir, e.strerror or e)
        except ProcckptError as e:
            raise logged_exit(e, logger) from e.__cause__

    # -- position (kept by Progress) and settings (kept by SaveTriggers) -------------------
    epoch = _delegated("_progress", "epoch", "The epoch in progress (or next to run).")
    batch = _delegated("_progress", "batch", "Batches of the current epoch already trained on.")
    step = _delegated("_progress", "step", "Batches (or epochs, without batches()) done in all.")
    interval = _delegated("_triggers", "interval", "Seconds between periodic checkpoints.")
    metric = _delegated("_triggers", "metric", "The last metric reported.")
    best_metric = _delegated("_triggers", "best_metric", "The best metric reported.")
    metric_mode = _delegated("_triggers", "metric_mode", '"max" or "min": which metric is best.')

    @property
    def last_checkpoint(self) -> CheckpointInfo | None:
        """The newest durable checkpoint (saved or resumed from)."""
        return self._saves.last

    # -- public API ------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield epoch numbers from the saved epoch (0 on a fresh start) up to ``num_epochs``.

        The end of each epoch is a safe point. After the last epoch a final checkpoint is
        saved and the run is marked complete.
        """
        return loops.epochs(self, num_epochs)

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches; on resume, start at the first batch not yet trained on.

        After each batch (when the loop body asks for the next one) is a safe point.
        """
        return loops.batches(self, loader)

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from the saved step (0 on a fresh start) up to ``total``: the
        loop of an iteration-based script (``while iter_num < max_iters``), in one line.

        A safe point follows each step. Alone, the numbers are steps and the end saves and
        marks the run complete; inside ``epochs()`` they count the epoch's steps. What one step
        carries to the next (a batch fetched ahead) belongs in :attr:`extras`.
        """
        return loops.steps(self, total)

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
            self._progress.batch_done()
        self._finish()

    @property
    def finished(self) -> bool:
        """Whether training ended: the loops ran to their end, or :meth:`finish` was called."""
        return self._finished

    def report_metric(self, value: float) -> bool:
        """Record a validation metric; returns True if it is the best so far. With
        ``save_best``, a new best is saved at the next safe point and kept by pruning."""
        return self._triggers.report_metric(value)

    def request_checkpoint(self, stop: bool = False, reason: str = "script") -> None:
        """Ask for a checkpoint at the next safe point (and to exit after it with ``stop``)."""
        self._triggers.ask(stop, reason)

    def working(self) -> contextlib.AbstractContextManager[None]:
        """A block that counts as progress for ``procckpt run``'s hang detection however long
        it sits in one native call (``with ckpt.working(): build_index_in_c(corpus)``). A
        hang inside it is not caught: keep it around the long call alone."""
        return self._liveness.working()

    def save(self, reason: str = "manual") -> CheckpointInfo | None:
        """Save now. Call only between steps (on every rank in a process group); the loops
        above do it for you.

        Raises:
            StorageError: no space or no permission in the checkpoint dir (logged in one line;
                uncaught, it ends the process with exit code 74 and no traceback).
        """
        self._audit.saved(self._progress.position)
        try:
            with self._liveness.working():
                return self._saves.pruned(self._save(reason))
        except ProcckptError as e:
            raise logged_exit(e, logger) from e.__cause__

    def flush(self) -> None:
        """Wait until the checkpoint being written in the background, if any, is durable
        (in a process group: committed; call it on every rank then).

        Raises:
            BackgroundWriteError: that write failed (the previous checkpoint is intact).
        """
        if self._dist is not None:
            self._dist.settle(self._member)
        elif self._background is not None:
            self._background.wait()

    def close(self) -> None:
        """Wait for a checkpoint in flight, then release the checkpoint dir (done at exit)."""
        self._liveness.close()
        tier = getattr(self, "_tier", None)  # (set late in __init__)
        if tier is not None:
            tier.close()
        self._audit.flush()
        try:
            if self._background is not None:
                self._background.close()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # -- saving ----------------------------------------------------------------------------
    def _save(self, reason: str) -> CheckpointInfo | None:
        if self._dist is not None:
            return self._dist.save(self._member, reason)
        if not self.is_writer:
            return None
        return self._saves.write(self._meta(reason), self._payload(), reason,
                                 self._progress.position)

    def _payload(self, exclude: set[str] | None = None) -> dict[str, Any]:
        progress = {"epoch": self.epoch, "batch": self.batch, "step": self.step,
                    "best_metric": self.best_metric, "loader": self._progress.loader_shape}
        if self._progress.samples_before:  # the epoch was resumed with another world size
            progress[BEFORE] = self._progress.samples_before
        return build_payload(self._statefuls, progress, self._progress.saved_state(),
                             self.extras, exclude)

    def _meta(self, reason: str) -> dict[str, Any]:
        return checkpoint_meta(self._progress.position, reason, self.restart, self.metric,
                               self.metric_mode)

    # -- resuming --------------------------------------------------------------------------
    def _resume(self) -> CheckpointInfo | None:
        info = resume_newest(self)
        if info is not None:  # its first batch is compared with the one recorded (audit.py)
            self._audit.resumed(info.name, self._progress.position)
            if self._restored_state is not None:  # and the state its first step starts from
                prints, counters, advice = self._restored_state
                self._restored_state = None
                self._audit.expect_state(StateExpectation(
                    prints, lambda: live_state(self._statefuls), advice or ADVICE, counters))
        return info

    def _restored(self) -> tuple[int | None, str | None, int]:
        """The bytes of the state this process resumed from, where it was kept, and how many
        of them went into memory touched already: the region a warm restart's spare touched in
        advance (state/reserve.py), or the optimizer's own earlier state (state/mapped.py)."""
        resumed = self.resumed_from
        if resumed is None:
            return None, None, 0
        memory = resumed.manifest.get("reason") == "memory"  # (a slot the launcher kept)
        return (resumed.nbytes, "the memory tier" if memory else "the checkpoint dir",
                reserve.carved() + self._written_over)

    def _load_latest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        return load_newest_verified(self.store, lambda info, payload: apply_payload(
            self, info, payload))

    # -- safe points -----------------------------------------------------------------------
    def _safe_point(self, epoch_end: bool = False, defer: bool = False) -> None:
        """A point where a checkpoint can be taken; ``defer``: one wanted here waits for the
        next safe point (the last batch of an epoch waits for the epoch's end: loops.py)."""
        triggers = self._triggers
        now = time.monotonic()
        self._saves.reserve_ahead(self._payload, self._member)  # once, after the first step
        triggers.poll(now)
        self._end_if_storage_failed()
        self._liveness.at_safe_point(self.step, now)  # the gap since the last one, measured
        self._timer.at_safe_point(now)
        try:
            agreed = self._act_at_safe_point(now, epoch_end, defer)
            if self._tier is not None:
                self._keep_in_tier(now, defer, agreed)
        finally:
            self._liveness.left_safe_point()

    def _keep_in_tier(self, now: float, defer: bool, agreed: Flags | None) -> None:
        """The memory tier's turn at this safe point: not where a checkpoint was just taken,
        nor where one would wait for the next safe point (an epoch's last batch). In a group
        (``agreed``: the group's flags at an agreement step), as every rank decides alike."""
        assert self._tier is not None
        if self.store.adopt is not None:  # (set by an integration after __init__)
            logger.info("memory tier: not used: each checkpoint holds files the framework "
                        "writes itself; a crash resumes from the newest checkpoint")
            self._tier.close()
            self._tier = None
            if self._dist is not None:
                self._dist.tier = None  # (no rank brings it to the agreement any more)
            return
        position = self._progress.position

        def note(state: dict[str, Any]) -> None:  # (the streams the slot holds: see saved())
            self._audit.saved(position, state.get("rng"))

        if isinstance(self._tier, GroupTier):
            saved = agreed is not None and self._triggers.reason_for(agreed) is not None
            self._tier.at_safe_point(now, agreed, not defer and not saved, self._member,
                                     lambda: self._meta("memory"), note)
            return
        self._tier.at_safe_point(now, not defer and self._saves.saved_at != position,
                                 lambda: self._meta("memory"), self._payload, note)

    def _act_at_safe_point(self, now: float, epoch_end: bool,
                           defer: bool = False) -> Flags | None:
        """Checkpoint here if wanted (in a group: if agreed); the group's flags at an
        agreement step, None elsewhere."""
        self._check.at_safe_point(self, epoch_end, defer=defer)  # under procckpt check only
        triggers = self._triggers
        flags = triggers.wanted(now, epoch_end, self.epoch)
        agreed = None
        if self._dist is not None:
            # Ranks act only on what the whole group agreed on, at the same step.
            agreed = self._dist.agree(self._member, flags, epoch_end)
            if agreed is None:
                return None
            triggers.adopt(agreed)
            flags = agreed
        if flags is None or defer:
            return agreed  # the common case, every step: nothing to save (a wish is kept)
        if (reason := triggers.reason_for(flags)) is None:
            return agreed
        triggers.best_pending = False
        with self._liveness.working():  # procckpt's own work is no hang of the training
            self._checkpoint(reason)
        return agreed

    def _end_if_storage_failed(self) -> None:
        """A background checkpoint failed for a reason that will repeat (no space left, no
        permission): end the run now, as a synchronous one does, not after hours of training
        whose checkpoints would fail too."""
        background = self._background
        if background is None or (error := background.lasting_failure) is None:
            return
        background.wait(raise_failure=False)
        self._storage_failed(error)

    def _storage_failed(self, error: StorageError) -> NoReturn:
        # Trying again would fail again: say so, stop, and let the launcher not restart.
        self._triggers.answer(None, self.step, stopping=True, error=str(error))
        self._exiting = True
        self.close()
        raise logged_exit(error, logger) from error.__cause__

    def _checkpoint(self, reason: str) -> None:
        triggers = self._triggers
        self._audit.saved(self._progress.position)  # the batch that follows is recorded
        if triggers.stop_reason is None and self._saves.in_background(
                reason, self._progress.position, self._meta, self._payload, self._member):
            return  # acknowledged once durable (a group's once every rank's part is)
        try:
            info = self._save(reason)
        except StorageError as e:
            self._storage_failed(e)
        self._saves.answer(info, self.step, stopping=triggers.stop_reason is not None)
        if triggers.stop_reason is not None:
            self._exit_after_stop()

    def _exit_after_stop(self) -> None:
        code = self._context.stop_exit_code
        logger.info("stopping after checkpoint at step %d (%s); run again to resume",
                    self.step, self._triggers.stop_reason)
        self._exiting = True
        self._audit.before_exit()  # the batch a resume must start with, for its audit
        self.close()
        raise SystemExit(code)

    def _open_audit(self) -> BatchAudit:
        """The first-batch audit (audit.py); procckpt check compares whole states instead."""
        return BatchAudit(
            self.dir, self.rank, OFF if isinstance(self._check, CheckHook) else audit_mode(),
            self._journal, self._refuse_resume,
            self._dist.any_rank if self._dist is not None else None)

    def _refuse_resume(self, message: str) -> NoReturn:
        """``--audit strict``: the resumed run would train on other data than the interrupted
        one; end it before it does, and tell the launcher (which does not restart it)."""
        if self._control is not None:
            with contextlib.suppress(OSError):
                self._control.report_failure(self.rank, f"{ctl.AUDIT_REFUSED}: {message}")
        self._exiting = True
        self.close()
        raise logged_exit(ResumeAuditError(message), logger)

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._dist is not None:
            self._dist.settle(self._member)  # collective: every rank ends here
        self._saves.wait()  # the checkpoint being written is the one to compare
        info = self._saves.last
        if self._saves.saved_at != self._progress.position or info is None:
            info = self.save("end")
        self._saves.mark_complete(self._progress.position, info)
        if self._triggers.request is not None or self._triggers.stop_reason is not None:
            self._triggers.answer(info, self.step, stopping=True)
