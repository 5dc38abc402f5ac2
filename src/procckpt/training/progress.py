"""Where a run is (epoch, batch, step) and the random streams that go with it, saved and resumed exactly.

Every checkpoint holds two snapshots of the random streams: the state *now* and the state at
the *start of the current epoch*. Resuming mid-epoch replays the epoch's start: the
epoch-start state is restored, the data loader is iterated again (so the sampler shuffles, and
worker processes are seeded, exactly as before) and the batches already trained on are drawn
and dropped; then the "now" state is restored and training continues with the next batch.
Dropping batches costs reading them once more, and buys exactness for samplers, worker seeds
and random transforms without knowing anything about them.

A DataLoader built with its own ``generator=`` draws its order from that generator instead of
torch's global one; its state is saved beside the global streams and restored with them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from ..errors import ProcckptError, UsageError
from .rng import capture_rng, generator_states, restore_generators, restore_rng

__all__ = ["Progress", "loader_generators"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        #: Batches of the current epoch to replay before the first new one (after a resume).
        self._pending_skip: int | None = None

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.batch, self.step

    # -- saving and resuming ---------------------------------------------------------------
    def saved_state(self) -> dict[str, Any]:
        """The random streams a checkpoint holds (every rank saves its own)."""
        rng = capture_rng()
        rng["loader_generators"] = generator_states(self._loader_generators)
        return {"rng": rng, "epoch_rng": self._epoch_rng if self.batch else None}

    def resume(self, progress: dict[str, Any], rng: dict[str, Any],
               epoch_rng: dict[str, Any] | None) -> None:
        """Continue from a checkpoint's position and streams (applied as the loops start)."""
        self.epoch, self.batch, self.step = (int(progress["epoch"]), int(progress["batch"]),
                                             int(progress["step"]))
        self._resume_rng = rng
        if self.batch:
            self._epoch_rng = epoch_rng
            self._pending_skip = self.batch

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

    def end_epoch(self) -> None:
        self.epoch += 1
        self.batch = 0
        self._epoch_rng = None
        if not self._epoch_used_batches:  # an epoch without batches() counts as one step
            self.step += 1

    # -- the batches() loop ----------------------------------------------------------------
    def open_loader(self, loader: Iterable[T]) -> Iterator[T]:
        """An iterator over ``loader`` at the first batch not yet trained on.

        Raises:
            UsageError: the loader keeps state between epochs that no checkpoint reaches.
            ProcckptError: the loader has fewer batches than the checkpoint's position.
        """
        if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0):
            raise UsageError(
                "DataLoader(persistent_workers=True) keeps its workers and their random state "
                "from one epoch to the next, where no checkpoint can reach them, so a resumed run "
                "would differ from an uninterrupted one: pass persistent_workers=False (workers "
                "then start each epoch from the checkpointed random state)")
        generators = loader_generators(loader)
        skip = self._pending_skip or 0
        self._pending_skip = None
        if skip:
            assert self._epoch_rng is not None
            restore_generators(generators, self._epoch_rng.get("loader_generators", []))
        else:
            if self._resume_rng is not None:  # batches() without epochs(), resumed at its start
                self._restore_at_boundary()
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
            self._replay(iterator, skip, generators)
        self.batch = skip
        return iterator

    def batch_done(self) -> None:
        self.batch += 1
        self.step += 1

    def end_pass(self) -> None:
        """The loader is exhausted; without epochs() the single pass is over."""
        if not self.in_epochs:
            self.batch = 0
            self._epoch_rng = None

    def warn_left_early(self) -> None:
        """Say what leaving ``epochs()`` before its end (a ``break``) means for a rerun."""
        logger.warning(
            "the ckpt.epochs() loop was left before its end (epoch %d, step %d): no final "
            "checkpoint was saved and the run is not marked complete, so running the script "
            "again resumes from the last checkpoint; to end training early, call ckpt.finish() "
            "before break", self.epoch, self.step)

    # -- internals -------------------------------------------------------------------------
    def _replay(self, iterator: Iterator[Any], skip: int,
                generators: list[torch.Generator]) -> None:
        started = time.monotonic()
        for done in range(skip):
            try:
                next(iterator)
            except StopIteration:
                raise ProcckptError(
                    f"the data loader ran out after {done} batches, but the checkpoint "
                    f"was taken after batch {skip} of this epoch: did the data set or "
                    "batch size change? Use a new checkpoint dir to start over.") from None
        assert self._resume_rng is not None
        restore_rng(self._resume_rng)
        restore_generators(generators, self._resume_rng.get("loader_generators", []))
        self._resume_rng = None
        logger.info("skipped the %d batches of epoch %d trained before the restart (%.1fs)",
                    skip, self.epoch, time.monotonic() - started)

    def _restore_at_boundary(self) -> None:
        """Resume at the start of an epoch: every random stream continues from the checkpoint;
        the loader's generators are restored once :meth:`open_loader` sees the loader."""
        assert self._resume_rng is not None
        restore_rng(self._resume_rng)
        self._boundary_generators = list(self._resume_rng.get("loader_generators") or [])
        self._resume_rng = None


def loader_generators(loader: object) -> list[torch.Generator]:
    """Generators a DataLoader draws its order from besides torch's global one."""
    found: list[torch.Generator] = []
    for owner in (loader, getattr(loader, "sampler", None),
                  getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found
