"""The Checkpointer's loops driven by a framework's hooks instead of the script's ``for`` loops.

Lightning and the Hugging Face Trainer run the loop themselves: they open the training data
loader at the start of each epoch and call back after each batch. :class:`DrivenLoop` turns
those calls into what ``epochs()`` and ``batches()`` do: the same positions, random streams,
safe points and resumes, so a framework's run is as exact as a hand-written loop.

Two differences from the ``for`` loops shape it:

- the framework may fetch a batch ahead of the one it trains on (Lightning's fetcher does), so
  a sample loaded in this process draws from streams of its own, seeded by the epoch and its
  index, and the training's streams never see a load (see loaders.py);
- the epoch a loader is opened for comes from the framework, which also decides how a run
  that stopped after an epoch's last batch goes on: if the framework opens the next epoch
  first, the saved position was that epoch's end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils.data import DataLoader, IterableDataset

from ..errors import ProcckptError, logged_exit
from .position.loaders import SeededSamples, streams_kept, swapped

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

__all__ = ["DrivenLoop", "positioned", "kept_apart"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DrivenLoop:
    """The loops of ``ckpt``, opened and advanced by a framework's hooks."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self.ckpt = ckpt
        # The framework saves its own model and optimizers, which procckpt is not given: no
        # object of the script is taken for one a checkpoint misses.
        ckpt._check.driven = True
        self._opened = False
        #: Set while the loader is opened through procckpt, so that its own ``__iter__``
        #: (see :func:`positioned`) hands out the plain iterator.
        self.opening = False

    def open(self, loader: Iterable[T], epoch: int) -> Iterator[T]:
        """An iterator over ``loader`` for epoch ``epoch`` (the framework's count): on a
        resume in the middle of that epoch, at the first batch not yet trained on."""
        ckpt = self.ckpt
        progress = ckpt._progress
        first, self._opened = not self._opened, True
        if ckpt.finished:
            return iter(())
        if first and progress.batch and progress.batch == _batches(loader):
            # Resumed after the last batch of epoch e, the framework opens its loader once
            # more before it counts e as done: for the batches of e + 1 (a loader with a
            # state, put back at e's end, would start e + 1 here too).
            epoch = max(epoch, progress.epoch + 1)
        progress.enter_epoch(epoch, first)
        _tell_samplers(loader, progress.epoch)
        self.opening = True
        try:
            iterator = progress.open_loader(loader, ckpt._journal, isolate_loads=True)
            return ckpt._audit.wrap(iterator, progress)
        except ProcckptError as e:
            ckpt._exiting = True
            raise logged_exit(e, logger) from None
        finally:
            self.opening = False

    def batch_done(self, can_save: bool = True) -> None:
        """A batch was trained on: a safe point (may save, and may end the process) where
        ``can_save``.

        The framework says where not: after an epoch's last batch it still runs its epoch's
        end (validation, epoch-end hooks, epoch-wise schedulers), and a checkpoint taken
        before that is one a framework resumes less faithfully (Lightning then skips the
        next epoch's ``on_train_epoch_start``); inside a gradient accumulation the gradients
        summed so far are in no checkpoint. A checkpoint wanted there waits for the next
        safe point (after the next optimizer step, or the end of training).
        """
        ckpt = self.ckpt
        if ckpt.finished:
            return
        ckpt._progress.batch_done()
        if can_save:
            ckpt._safe_point()
        else:
            ckpt._check.at_safe_point(ckpt, False, saves=False)  # under procckpt check only

    def finish(self) -> None:
        """Training ended: a final checkpoint, and the run is marked complete."""
        ckpt = self.ckpt
        if not ckpt.finished:
            ckpt._finish()


def _tell_samplers(loader: object, epoch: int) -> None:
    """Give the loader's samplers, and a stream it reads, the epoch (a ``DistributedSampler``
    and a ``ShuffleBuffer`` shuffle by it). The framework does so too, but on a resume only
    after it opened the loader, or with its own count (the Trainer starts a stream's count
    again at 0 in a resumed process)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    dataset = getattr(loader, "dataset", None)
    stream = dataset if isinstance(dataset, IterableDataset) else None
    for sampler in (getattr(loader, "sampler", None), batch_sampler,
                    getattr(batch_sampler, "sampler", None), stream):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def _batches(loader: object) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def positioned(loader: DataLoader, loop: DrivenLoop, epoch: Any) -> DataLoader:
    """Make ``loader`` (in place: frameworks hold on to the object) open through ``loop``:
    its ``__iter__`` starts each epoch where procckpt says. ``epoch()`` gives the framework's
    epoch number when the loader is opened."""
    if getattr(loader, "_procckpt_loop", None) is not None:
        loader._procckpt_loop = loop
        return loader
    base = type(loader)
    namespace: dict[str, Any] = {"__iter__": _positioned_iter, "__module__": base.__module__}
    if not callable(getattr(base, "state_dict", None)):
        # Resumable to the frameworks that ask (Lightning warns about a loader without these
        # at a mid-epoch resume): procckpt keeps the position, so there is nothing to hold.
        namespace["state_dict"] = lambda self: {}
        namespace["load_state_dict"] = lambda self, state: None
        namespace["_procckpt_positioned"] = True
    object.__setattr__(loader, "__class__", type(base.__name__, (base,), namespace))
    object.__setattr__(loader, "_procckpt_loop", loop)
    object.__setattr__(loader, "_procckpt_epoch", epoch)
    return loader


def kept_apart(loader: DataLoader) -> DataLoader:
    """Make ``loader`` (in place) draw nothing from the training's random streams: for a
    loader the framework reads between training batches (validation). Its order and its
    workers' seed are drawn, and its samples loaded, from streams put back afterwards; a
    sample's randomness comes from its index. Without this, a validation pass after an
    epoch's last batch moves the streams that the next epoch starts from, and a run resumed
    from a checkpoint taken before that pass (which the framework does not repeat) differs."""
    if getattr(loader, "_procckpt_apart", False):
        return loader
    base = type(loader)
    object.__setattr__(loader, "__class__", type(base.__name__, (base,), {
        "__iter__": _apart_iter, "__module__": base.__module__, "_procckpt_apart": True}))
    return loader


def _apart_iter(self: Any) -> Iterator[Any]:
    parent = super(type(self), self).__iter__
    with streams_kept():
        swaps = {} if self.num_workers else {"dataset": SeededSamples(self.dataset, 0)}
        with swapped(self, swaps):
            iterator = parent()
    return _KeptApart(iterator)


class _KeptApart:
    """An iterator whose ``next()`` leaves the random streams as they were."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner = inner

    def __iter__(self) -> _KeptApart:
        return self

    def __next__(self) -> Any:
        with streams_kept():
            return next(self._inner)

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


def _positioned_iter(self: Any) -> Iterator[Any]:
    loop: DrivenLoop = self._procckpt_loop
    parent = super(type(self), self).__iter__
    if loop.opening:
        return parent()
    return loop.open(self, self._procckpt_epoch())
