"""The rest of an interrupted epoch, split over another number of ranks.

A ``DistributedSampler`` draws one permutation of the data set per epoch (from ``seed + epoch``,
whatever the world size) and gives rank r of W the items ``perm[r::W]``. After k batches of B
on every rank, the samples trained on are therefore exactly the prefix ``perm[:k*B*W]``. A run
resumed with W' ranks trains the rest, ``perm[k*B*W:]``, split the same way over W' ranks
(padded, as DistributedSampler pads, to a whole number for each rank): every sample of the
epoch once, though not in the order, nor with the random streams, of an uninterrupted run.
The samples trained before the current split are kept in the checkpoint's progress
(``epoch_samples_before``), so that a second change inside the same epoch adds up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from ...errors import UsageError

__all__ = ["BEFORE", "RemainderSampler", "resplit_position", "remainder_batches"]

logger = logging.getLogger(__name__)

#: The progress key: samples of the epoch in progress trained before the current split.
BEFORE = "epoch_samples_before"


def resplit_position(payload: dict[str, Any], saved: int, now: int,
                     log: bool = True) -> dict[str, Any]:
    """The position of a checkpoint of ``saved`` ranks for a run of ``now``: the interrupted
    epoch goes on from its start with the samples trained marked as done (batch 0, and
    :data:`BEFORE` counting them); :func:`remainder_batches` then deals the rest out."""
    progress = dict(payload["progress"])
    batch = int(progress.get("batch", 0))
    batch_size = (progress.get("loader") or {}).get("batch_size")
    if not batch:
        return payload
    if not isinstance(batch_size, int):
        raise UsageError(
            f"the checkpoint was taken in the middle of epoch {progress.get('epoch')} with "
            f"{saved} ranks and this run has {now}, but its data loader did not say its batch "
            "size, so the samples already trained on cannot be dealt out again: resume with "
            f"{saved} ranks, or from a checkpoint at an epoch's end")
    done = int(progress.get(BEFORE, 0)) + batch * batch_size * saved
    if log:
        logger.warning(
            "resuming epoch %s with %d ranks from a checkpoint of %d: the samples of it not "
            "yet trained on (after the first %d of its order) are dealt out over the %d ranks, "
            "each once; the data is exact, but the run is not bit-identical to an "
            "uninterrupted one (another world size)", progress.get("epoch"), now, saved, done,
            now)
    progress["batch"] = 0
    progress[BEFORE] = done
    return {**payload, "progress": progress}


class RemainderSampler(Sampler[int]):
    """A ``DistributedSampler``'s epoch without the first ``before`` items of its order, dealt
    out over its own ranks as it deals the whole."""

    def __init__(self, base: DistributedSampler, before: int) -> None:
        self.base, self.before = base, before

    def _indices(self) -> list[int]:
        base = self.base
        n = len(base.dataset)  # type: ignore[arg-type]
        if base.shuffle:
            g = torch.Generator()
            g.manual_seed(base.seed + base.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        rest = order[self.before:]
        ranks = base.num_replicas
        if base.drop_last:
            rest = rest[:len(rest) - len(rest) % ranks]
        elif rest and len(rest) % ranks:
            pad = ranks - len(rest) % ranks
            rest += (rest * (pad // len(rest) + 1))[:pad]
        return rest[base.rank::ranks]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        rest = max(0, len(self.base.dataset) - self.before)  # type: ignore[arg-type]
        ranks = self.base.num_replicas
        return rest // ranks if self.base.drop_last else -(-rest // ranks)


def remainder_batches(loader: Any, before: int) -> BatchSampler:
    """The batch sampler for the rest of the epoch of ``loader``, whose first ``before``
    samples (of every rank together) were trained on.

    Raises:
        UsageError: the loader deals its samples out some other way.
    """
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(loader, DataLoader) or not isinstance(sampler, DistributedSampler) \
            or type(batch_sampler) is not BatchSampler:
        raise UsageError(
            "this epoch was interrupted with another number of ranks, and the data loader "
            "does not take its samples from a DistributedSampler, so procckpt cannot tell "
            "which samples are left: resume with the number of ranks the checkpoint was taken "
            "with, or give the DataLoader sampler=DistributedSampler(...)")
    return BatchSampler(RemainderSampler(sampler, before), batch_sampler.batch_size,
                        batch_sampler.drop_last)
