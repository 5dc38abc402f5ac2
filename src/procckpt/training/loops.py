"""The Checkpointer's loops: ``epochs()``, ``batches()`` and ``steps()``, with a safe point after
each batch or step and at each epoch's end. The Checkpointer's methods return these; ``ck`` is
that Checkpointer (typed Any: this module is below it).

A checkpoint wanted at the last batch of an epoch (or the last step of ``steps()``) is taken
at the next safe point instead, the epoch's end, after the code that closes the epoch (or at
the end of training): a run resumed from it must never start inside a loop with nothing left
to run, where the closing code would miss what the last batch left it (``loss``, a metric).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from ..errors import ProcckptError, UsageError, logged_exit
from .accumulation import window_ended
from .position.rng import capture_rng

__all__ = ["epochs", "batches", "steps", "last_batch"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def epochs(ck: Any, num_epochs: int) -> Iterator[int]:
    progress = ck._progress
    if ck._finished:
        return
    ck._progress.check_streams(ck._journal)
    if progress.epoch >= num_epochs:
        if ck.resumed_from is not None:
            logger.info("training already finished (epoch %d of %d); nothing to do",
                        progress.epoch, num_epochs)
        progress.nothing_left()
        ck._finish()
        return
    first = progress.in_epochs = True
    while progress.epoch < num_epochs:
        progress.start_epoch(first)
        first = False
        try:
            yield progress.epoch
        except GeneratorExit:  # a break, an exception, or our own stop: only a break warns
            if not (ck._finished or ck._exiting):
                progress.warn_left_early("epochs", sys._getframe(1))
            raise
        progress.end_epoch()
        if ck._window is None or ck._window():  # (an accumulation across epochs: no)
            # After the last epoch the end of training takes the checkpoint, after the code
            # that follows the loop began (a resume must never start in an empty loop).
            ck._safe_point(epoch_end=True, defer=progress.epoch >= num_epochs)
    progress.in_epochs = False
    ck._finish()


def batches(ck: Any, loader: Iterable[T]) -> Iterator[T]:
    progress = ck._progress
    if ck._finished:
        return
    _one_pass_an_epoch(ck)
    ck._progress.check_streams(ck._journal)
    try:
        iterator = progress.open_loader(loader, ck._journal)
    except ProcckptError as e:
        ck._exiting = True
        raise logged_exit(e, logger) from None
    iterator = ck._audit.wrap(iterator, progress)
    ck._window = window = window_ended()
    last = last_batch(progress)
    for item in iterator:
        ck._in_batch = True
        yield item
        ck._in_batch = False
        progress.batch_done()
        if window is None or window():
            ck._safe_point(defer=progress.batch == last or _handed_out_its_last(loader))
        else:  # inside a gradient accumulation: its summed gradients are in no checkpoint
            ck._check.at_safe_point(ck, False, saves=False)  # under procckpt check only
    progress.end_pass()
    ck._pass_ended = (progress.in_epochs, progress.epoch if progress.in_epochs else None,
                      progress.batch if progress.in_epochs else None)


def _one_pass_an_epoch(ck: Any) -> None:
    """Refuse a second ``batches()`` pass in one epoch (or a second one outside ``epochs()``),
    before it trains: a checkpoint taken in it holds a position (epoch, batch) that a resume
    reads as one of the first pass, whose batches it would train again.

    Raises:
        UsageError: ending the process (exit 2) with what to write instead.
    """
    ended = getattr(ck, "_pass_ended", None)
    progress = ck._progress
    if ended is None or ended[0] != progress.in_epochs:
        return
    if progress.in_epochs and ended[1] == progress.epoch:
        message = (
            f"ckpt.batches() was opened a second time in epoch {progress.epoch}, after a pass of "
            f"{ended[2]} batches: a resume could not tell a checkpoint taken in this pass from "
            "one in the first, and would train the first loader's batches again. Use one "
            "ckpt.batches() an epoch: draw both passes from one loader (a ConcatDataset, or a "
            "loader that yields each task's batches in turn), or give each pass an epoch of "
            "its own (for epoch in ckpt.epochs(2 * n): alternate the loaders)")
    elif not progress.in_epochs:
        message = (
            "ckpt.batches() was opened again after its pass over the loader ended, outside "
            "ckpt.epochs(): a resume could not tell which pass it stopped in, and would train "
            "the first pass's batches again. Let procckpt count the epochs: for epoch in "
            "ckpt.epochs(n): for batch in ckpt.batches(loader): ...")
    else:
        return
    ck._exiting = True
    raise logged_exit(UsageError(message), logger) from None


def last_batch(progress: Any) -> int | None:
    """The number of an epoch's last batch, where ``epochs()`` follows with the epoch's
    closing code and its own safe point; None where it cannot be known ahead (a loader
    without a length, a pass resharded for another world size: then only a loader that
    fetches ahead tells, see _handed_out_its_last) or no epoch closes."""
    shape = progress.loader_shape or {}
    if not progress.in_epochs or progress.samples_before or shape.get("batches") is None:
        return None
    return int(shape["batches"])


def _handed_out_its_last(loader: Any) -> bool:
    """Whether a loader without a length knows the batch it handed out was its pass's last:
    Accelerate's, which fetches a batch ahead, does (``end_of_dataloader``)."""
    return getattr(loader, "end_of_dataloader", False) is True


def step_inputs(ck: Any, streams: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a step of ``steps()`` starts from, beside its number: the random streams it draws
    its data with (Python's and torch's CPU one: NumPy's and CUDA's exist in one process and
    not in another, as the script imports or starts them; ``streams``: as captured at this
    safe point already) and what the script keeps in ``ckpt.extras`` (a batch fetched
    ahead)."""
    if streams is None:
        streams = capture_rng()
    return {"python": streams["python"], "torch": streams["torch"], "extras": ck.extras}


def steps(ck: Any, total: int) -> Iterator[int]:
    progress = ck._progress
    if ck._finished:
        return
    ck._progress.check_streams(ck._journal)
    numbers = progress.open_range(total)
    alone = not progress.in_epochs
    # audit.py: what a step starts from stands for the batch the script fetches itself
    ck._audit.steps_open(lambda streams: step_inputs(ck, streams), alone)
    if alone and progress.step >= total:
        if ck.resumed_from is not None:
            logger.info("training already finished (step %d of %d); nothing to do",
                        progress.step, total)
        ck._finish()
        return
    for number in numbers:
        # (the frame that runs the loop: its iterators, if it draws its data from one)
        ck._audit.step_starts(progress.position, sys._getframe(1))
        ck._in_batch = True
        try:
            yield number
        except GeneratorExit:
            if alone and not (ck._finished or ck._exiting):
                progress.warn_left_early("steps", sys._getframe(1))
            raise
        ck._in_batch = False
        progress.batch_done()
        # The last step's checkpoint waits for what closes the loop: the epoch's end, or
        # (alone) the end of training, whose checkpoint is the one a stop gets.
        ck._safe_point(defer=number == total - 1)
    if alone:
        ck._finish()
