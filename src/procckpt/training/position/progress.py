"""Where a run is (epoch, batch, step) and its random streams, saved and resumed exactly.

Every checkpoint holds two snapshots of the random streams: the state *now* and the state at
the *start of the current epoch*. Resuming mid-epoch restores the epoch-start state and starts
the data loader again, so that the sampler shuffles (and worker processes are seeded) exactly
as before; the batches already trained on are then passed over, and the "now" state is
restored before the next batch. How they are passed over depends on the loader:

- a loader with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``, a
  stateful iterator of the script's own) is put back where it was: nothing is read again;
- a map-style ``DataLoader`` (with or without worker processes) advances its sampler alone,
  without loading those batches (see :mod:`.loaders` for why that is exact);
- anything else (an ``IterableDataset``, a plain iterator, a data set whose samples are not a
  function of their index and the random streams) is *replayed*: the batches are produced
  again and dropped. The log and the journal say how many and what it cost.

A DataLoader built with its own ``generator=`` draws its order from that generator instead of
torch's global one; its state is saved beside the global streams and restored with them.
"""

from __future__ import annotations

import dis
import inspect
import itertools
import logging
import random
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import torch

from ...protocol.events import append_event
from .loaders import (
    REPLAY_HINT,
    SeededFetches,
    align_epoch,
    check_loader,
    fetches_in_process,
    loader_generators,
    open_at,
    replayed_on_resume,
    stateful_source,
    swapped,
    wraps_a_loader,
)
from .resplit import BEFORE, remainder_batches
from .rng import capture_rng, generator_states, restore_generators, restore_rng
from .shape import loader_shape, map_position

__all__ = ["Progress", "STREAMS_MOVED"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: What a resume says when the script drew random numbers before its loop began.
STREAMS_MOVED = (
    "the script drew random numbers after procckpt.Checkpointer() resumed and before its loop "
    "began; on a resume they come from the fresh seed, not from where the uninterrupted run "
    "was. If they make something one step carries to the next (a batch fetched ahead, like "
    "nanoGPT's get_batch), this run will differ from an uninterrupted one: fetch inside the "
    "loop, or keep it in ckpt.extras (X, Y = ckpt.extras['batch'] if 'batch' in ckpt.extras "
    "else get_batch(), and ckpt.extras['batch'] = (X, Y) after each fetch). Draws that are the "
    "same on every start (making data) can move before the Checkpointer to silence this")


class Progress:
    """The run's position and random streams, kept in step with the ``epochs()`` and
    ``batches()`` loops.

    ``epoch`` is the epoch in progress (or next to run), ``batch`` the number of batches of it
    already trained on, ``step`` the batches (or epochs) done in all.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.batch = 0
        self.step = 0
        self.in_epochs = False
        #: The random streams at the start of the epoch in progress (None between epochs).
        self._epoch_rng: dict[str, Any] | None = None
        self._epoch_used_batches = False
        self._loader_generators: list[torch.Generator] = []
        #: The streams a resume restores once the loops reach the saved position.
        self._resume_rng: dict[str, Any] | None = None
        #: Saved states of the loader's generators, for the first batches() after a resume
        #: at an epoch boundary.
        self._boundary_generators: list[torch.Tensor] | None = None
        #: Batches of the current epoch to pass over before the first new one (after a resume).
        self._pending_skip: int | None = None
        #: The state of a stateful loader (``state_dict()``) at the checkpoint resumed from.
        self._resume_loader_state: Any = None
        #: The shape of the loader a checkpoint was taken in (batch size, batches, samples),
        #: and of the one in use now: a resume compares them (loaders.map_position).
        self._resume_shape: dict[str, Any] | None = None
        self.loader_shape: dict[str, Any] | None = None
        #: A loader with its own state, as iterated: its state after the batches trained on.
        self._state_trail: _StateTrail | None = None
        #: The global random streams right after a resume, until the first loop checks them.
        self.streams_at_resume: tuple[Any, ...] | None = None
        #: ``steps()`` without ``epochs()``: an iteration-based loop, counted by step only.
        self.in_steps = False
        #: Samples of the epoch in progress trained before a resume with another number of
        #: ranks (resplit.py); the rest of the epoch is dealt out without them.
        self.samples_before = 0
        self._replay_said = False  # whether the first loader's replay on a resume was told
        #: Whether the pass opened last deals the data out otherwise than the checkpoint's run
        #: did (another world size or batch size): its batches are not the same ones.
        self.remapped = False

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.batch, self.step

    # -- saving and resuming ---------------------------------------------------------------
    def saved_state(self) -> dict[str, Any]:
        """The random streams a checkpoint holds (every rank saves its own)."""
        rng = capture_rng()
        rng["loader_generators"] = generator_states(self._loader_generators)
        state: dict[str, Any] = {"rng": rng, "epoch_rng": self._epoch_rng if self.batch else None}
        if self._state_trail is not None:  # a loader's own position, and its epoch count
            state["loader_state"] = self._state_trail.state_after(self.batch)
        return state

    def resume(self, progress: dict[str, Any], rng: dict[str, Any],
               epoch_rng: dict[str, Any] | None, loader_state: Any = None) -> None:
        """Continue from a checkpoint's position and streams (applied as the loops start)."""
        self.epoch, self.batch, self.step = (int(progress["epoch"]), int(progress["batch"]),
                                             int(progress["step"]))
        self._resume_rng = rng
        if self.batch:
            self._epoch_rng = epoch_rng
            self._pending_skip = self.batch
        self._resume_loader_state = loader_state
        self._resume_shape = progress.get("loader")
        self.samples_before = int(progress.get(BEFORE, 0) or 0)
        self.streams_at_resume = global_streams()

    def check_streams(self, journal: Path | None) -> None:
        """On a resume, say (and journal) when the script drew random numbers before its
        first loop began."""
        if not self.streams_moved_since_resume():
            return
        logger.warning("%s", STREAMS_MOVED)
        if journal is not None:
            append_event(journal, "warning", step=self.step,
                         message="random numbers drawn between the resume and the loop")

    def streams_moved_since_resume(self) -> bool:
        """Whether the script drew from the global random streams between the resume and the
        first loop, where the checkpoint's streams are restored: those draws came from the
        fresh seed, not from where the uninterrupted run was."""
        before = self.streams_at_resume
        if before is None:
            return False
        self.streams_at_resume = None
        return global_streams() != before

    # -- the epochs() loop -----------------------------------------------------------------
    def start_epoch(self, first: bool) -> None:
        """An epoch begins: the first after a resume continues the saved streams; any other
        notes the streams as they are, for a checkpoint taken within it."""
        if first and self._resume_rng is not None:
            if self._pending_skip:  # mid-epoch: replay the epoch from its start
                assert self._epoch_rng is not None
                restore_rng(self._epoch_rng)
            else:
                self._restore_at_boundary()
        else:
            self._epoch_rng = capture_rng()
        self._epoch_used_batches = False

    def enter_epoch(self, epoch: int, first: bool) -> None:
        """A framework opens its loader for epoch ``epoch`` (see driven.py): the epochs before
        it are over, and this one starts (or, after a resume, continues)."""
        if first and self._pending_skip and self.epoch < epoch:
            # Resumed after the last batch of an epoch, and the framework went on to the next
            # one: the streams continue from the saved step, as at an epoch boundary, and
            # the new epoch starts from them (open_loader notes them).
            self._pending_skip = None
            self._epoch_rng = None
        while self.epoch < epoch:
            self.epoch += 1
            self.batch = 0
        self.in_epochs = True
        self.start_epoch(first)

    def end_epoch(self) -> None:
        self.epoch += 1
        self.batch = 0
        self.samples_before = 0
        self._epoch_rng = None
        if not self._epoch_used_batches:  # an epoch without batches() counts as one step
            self.step += 1

    # -- the batches() loop ----------------------------------------------------------------
    def open_loader(self, loader: Iterable[T], journal: Path | None = None,  # noqa: C901, PLR0915 (the ways a loader resumes, in order)
                    isolate_loads: bool = False) -> Iterator[T]:
        """An iterator over ``loader`` at the first batch not yet trained on; how the batches
        before it were passed over, and what that cost, goes into ``journal``. With
        ``isolate_loads``, samples loaded in this process draw from streams of their own
        (for a caller that fetches batches ahead: see loaders.open_at).

        Raises:
            UsageError: the loader keeps state between epochs that no checkpoint reaches.
            ProcckptError: the loader has fewer batches than the checkpoint's position.
        """
        check_loader(loader)
        # The epoch's streams as they stand before anything draws: the same on a resume.
        epoch_seed = zlib.crc32(torch.get_rng_state().numpy().tobytes(), self.epoch)
        self.remapped = bool(self.samples_before)
        if self.in_epochs:
            align_epoch(loader, self.epoch)
        generators = loader_generators(loader)
        skip = self._pending_skip or 0
        self._pending_skip = None
        boundary: list[torch.Tensor] | None = None
        if skip:
            assert self._epoch_rng is not None
            restore_generators(generators, self._epoch_rng.get("loader_generators", []))
        else:
            if self._resume_rng is not None:  # batches() without epochs(), resumed at its start
                self._restore_at_boundary()
            if self._boundary_generators is not None:
                # Resumed at an epoch boundary: the loader's own generators continue from the
                # saved state too, as they did in the uninterrupted run.
                boundary = self._boundary_generators
                restore_generators(generators, boundary)
                self._boundary_generators = None
            if self._epoch_rng is None:  # batches() used without epochs()
                self._epoch_rng = capture_rng()
            self._epoch_rng["loader_generators"] = generator_states(generators)
        self._loader_generators = generators
        self._epoch_used_batches = True
        stateful = stateful_source(loader)
        shape, saved_shape, self._resume_shape = loader_shape(loader), self._resume_shape, None
        self.loader_shape = shape
        started = time.monotonic()
        # A loader's state saved after its pass ran out (one that fetches ahead knows at its
        # last batch) opens no pass of its own: a fresh one follows, as in the uninterrupted
        # run, its workers' seed drawn from the streams (torchdata would keep the old one) and
        # its data set copied as it is now (an iterator opened before the loop, as
        # Accelerate's prepare() opens one, holds the copy of epoch 0): the state is dropped.
        finished = stateful is not None and _pass_finished(self._resume_loader_state)
        if finished:
            stateful.load_state_dict({})
            if boundary is not None:
                # The look at its state above (stateful_source: a fresh StatefulDataLoader's
                # state_dict() opens an iterator) drew from its generator, which the
                # uninterrupted run, at its epoch's end, did not: start from the saved state.
                restore_generators(generators, boundary)
        iterator: Iterator[Any]
        if finished and skip:  # resumed after the pass's last batch: the epoch has no more
            iterator, how = iter(()), "the saved position was the end of the loader's pass"
        elif stateful is not None and self._resume_loader_state is not None and not finished:
            stateful.load_state_dict(self._resume_loader_state)
            iterator = iter(loader)
            if wraps_a_loader(loader) and inspect.isgenerator(iterator):
                # A wrapper (Accelerate's DataLoaderShard) opens the DataLoader it holds,
                # drawing its workers' seed from the streams, only when its first batch is
                # asked for: here, from the epoch's streams, as in the uninterrupted run. (A
                # script's own stateful iterator is left lazy: it may load its samples, and
                # draw for them, when each batch is asked for, as it did before the stop.)
                iterator = itertools.chain([next(iterator)], iterator)
            if skip and self._resume_rng is not None:
                # A pass opened from its state draws from the loader's generators otherwise
                # than the pass it continues did (torchdata's StatefulDataLoader sets its
                # sampler's generator back to the saved state and draws the permutation
                # again): they go on from where that pass had left them at the checkpoint, or
                # the next epoch is shuffled otherwise than in the uninterrupted run.
                restore_generators(generators, self._resume_rng.get("loader_generators", []))
            how = ("restored the loader's own state (nothing read again)" if stateful is loader
                   else "restored the data set's own state (nothing read again)")
        else:
            if not skip and not self._replay_said and stateful is None:
                self._replay_said = True
                self._say_replay(loader, shape, journal)
            skip, changed = map_position(saved_shape, shape, skip)
            if changed:
                self.remapped = True
                logger.warning("%s", changed)
                if journal is not None:
                    append_event(journal, "warning", step=self.step, message=changed)
            swaps = ({"batch_sampler": remainder_batches(loader, self.samples_before)}
                     if self.samples_before else {})
            with swapped(loader, swaps):  # type: ignore[arg-type]
                iterator, how = open_at(loader, skip, isolate_loads)
        self._resume_loader_state = None
        if skip:
            assert self._resume_rng is not None
            restore_rng(self._resume_rng)
            # The loader's own generators are not put back to the saved step: only the
            # sampler draws from them, at the start of the pass and at its end (a
            # RandomSampler draws once more when it runs out), and a loader that looks ahead
            # (Accelerate's shards) may have reached that end before the saved step. Opened
            # from the epoch's start state, they draw as the uninterrupted pass did.
            self._resume_rng = None
            seconds = time.monotonic() - started
            if journal is not None:
                append_event(journal, "resume-skip", epoch=self.epoch, batches=skip,
                             seconds=round(seconds, 4), how=how)
            logger.info("resumed at batch %d of epoch %d: %s (%.2fs)", skip, self.epoch, how,
                        seconds)
        self.batch = skip
        self._state_trail = None
        if isolate_loads and fetches_in_process(loader):
            iterator = SeededFetches(iterator, epoch_seed, skip)
        if stateful is not None:
            iterator = self._state_trail = _StateTrail(iterator, stateful, skip, self)
        return iterator

    def _say_replay(self, loader: Any, shape: dict[str, Any], journal: Path | None) -> None:
        """At the first loader of the run, say once if a resume will read it again, and
        what that costs late in an epoch: the training can still be changed."""
        why = replayed_on_resume(loader)
        if why is None:
            return
        whole = (f"all {shape['batches']} batches of an epoch" if shape.get("batches")
                 else "up to a whole epoch of the stream")
        message = (f"a resume inside an epoch will read this loader's batches before its "
                   f"position again ({why}): late in an epoch that is {whole}, before the "
                   f"first step trains; {REPLAY_HINT} (docs/resume.md)")
        logger.warning("%s", message)
        if journal is not None:
            append_event(journal, "warning", step=self.step, message=message)

    def open_range(self, total: int) -> range:
        """The step numbers ``steps(total)`` yields: from the saved position, with the saved
        streams in place. Inside ``epochs()`` they count batches of the epoch; alone, steps."""
        self._epoch_used_batches = True
        if not self.in_epochs:
            self.in_steps = True
            if self._resume_rng is not None:
                restore_rng(self._resume_rng)  # the streams as they were after the saved step
                self._resume_rng = None
            return range(self.step, total)
        skip = self._pending_skip or 0
        self._pending_skip = None
        if skip:  # no loader to pass over: the streams continue from the saved step
            assert self._resume_rng is not None
            restore_rng(self._resume_rng)
            self._resume_rng = None
        else:
            if self._resume_rng is not None:
                self._restore_at_boundary()
            if self._epoch_rng is None:
                self._epoch_rng = capture_rng()
        self.batch = skip
        return range(skip, total)

    def batch_done(self) -> None:
        if not self.in_steps:  # an iteration-based loop counts steps only
            self.batch += 1
        self.step += 1

    def end_pass(self) -> None:
        """The loader is exhausted; without epochs() the single pass is over."""
        if not self.in_epochs:
            self.batch = 0
            self._epoch_rng = None

    def warn_left_early(self, loop: str = "epochs", where: FrameType | None = None) -> None:
        """Say what leaving ``epochs()`` (or ``steps()``) before its end means for a rerun:
        only when the loop in frame ``where`` was left by ``break`` (or ``return``), not by an
        exception (its traceback says enough) or Ctrl-C."""
        if where is not None and not _left_by_break(where):
            return
        logger.warning(
            "the ckpt.%s() loop was left before its end (epoch %d, step %d): no final "
            "checkpoint was saved and the run is not marked complete, so running the script "
            "again resumes from the last checkpoint; to end training early, call ckpt.finish() "
            "before break", loop, self.epoch, self.step)

    # -- internals -------------------------------------------------------------------------
    def nothing_left(self) -> None:
        """Resumed at the end of the last epoch: no epoch starts, but the script goes on after
        the loop (an evaluation, a sample) from the saved streams, as it would have."""
        if self._resume_rng is not None and not self._pending_skip:
            self._restore_at_boundary()

    def _restore_at_boundary(self) -> None:
        """Resume at the start of an epoch: every random stream continues from the checkpoint;
        the loader's generators are restored once :meth:`open_loader` sees the loader."""
        assert self._resume_rng is not None
        restore_rng(self._resume_rng)
        self._boundary_generators = list(self._resume_rng.get("loader_generators") or [])
        self._resume_rng = None


def global_streams() -> tuple[Any, ...]:
    """The global random streams' states, comparable with ``==`` (torch's as bytes)."""
    np: Any = None
    try:
        import numpy as np
    except ImportError:
        pass
    numpy_state = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = (kind, keys.tobytes(), pos, has_gauss, cached)
    return (bytes(torch.get_rng_state().numpy()), random.getstate(), numpy_state)


def _left_by_break(frame: FrameType) -> bool:
    """Whether ``frame`` closes a loop's generator by leaving the loop (``break``,
    ``return``: the iterator is popped off its stack) rather than by an exception unwinding
    it (then it stands at the instruction that raised)."""
    try:
        return dis.opname[frame.f_code.co_code[frame.f_lasti]] == "POP_TOP"
    except (IndexError, ValueError):
        return True  # cannot tell: say it


class _StateTrail:
    """An iterator over a loader with its own state that keeps the state after each batch
    handed out but not yet trained on. A framework that fetches a batch ahead (Lightning)
    has the loader past the batch it trains when a checkpoint is taken; the checkpoint
    must hold the state after the batches trained on, or a resume skips the one fetched."""

    def __init__(self, inner: Iterator[Any], stateful: Any, handed_out: int,
                 progress: Progress) -> None:
        self._inner, self._stateful, self._progress = inner, stateful, progress
        self._handed_out = handed_out
        self._after: dict[int, Any] = {}  # batches handed out -> the state then

    def __iter__(self) -> _StateTrail:
        return self

    def __next__(self) -> Any:
        trained = self._progress.batch
        if trained < self._handed_out:  # the last batch is not trained yet: keep its state
            self._after[self._handed_out] = self._stateful.state_dict()
        for older in [n for n in self._after if n < trained]:
            del self._after[older]
        batch = next(self._inner)
        self._handed_out += 1
        return batch

    def state_after(self, trained: int) -> Any:
        """The loader's state after the first ``trained`` batches of the epoch."""
        if trained in self._after:
            return self._after[trained]
        return self._stateful.state_dict()


def _pass_finished(state: Any) -> bool:
    """Whether a loader's saved state (torchdata's, Accelerate's) says its pass ran out."""
    return isinstance(state, dict) and state.get("_iterator_finished") is True
