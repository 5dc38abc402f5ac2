"""The rank agreement: one all-reduce at steps every rank computes alike decides if the group saves.

Agreement steps are the same on every rank: each epoch end, and every ``k`` steps, where
``k`` is fixed (``sync_every`` / ``PROCCKPT_SYNC_EVERY``) or, by default, recomputed at each
agreement from the reduced (hence identical) seconds per step so that the group agrees about
every :data:`AGREE_SECONDS`. docs/distributed.md has the measured cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..link.flags import Flags
from .backend_threads import let_go

__all__ = ["RankAgreement", "device_for_group", "ENV_SYNC_EVERY",
           "AGREE_SECONDS"]

#: Agree every N steps instead of the adaptive default.
ENV_SYNC_EVERY = "PROCCKPT_SYNC_EVERY"
#: Adaptive agreement aims at one all-reduce this often (the control dir is polled as often).
AGREE_SECONDS = 0.2
MAX_SYNC_EVERY = 10_000


class RankAgreement:
    """Decides, identically on every rank, at which safe points the group all-reduces.

    ``every``: a fixed number of steps between agreements, or None for adaptive (about every
    :data:`AGREE_SECONDS`, from the slowest rank's seconds per step).
    """

    def __init__(self, device: torch.device, every: int | None = None,
                 group: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        if every is not None and every < 1:
            raise UsageError(f"sync_every must be at least 1, got {every}")
        self.device = device
        self.every = every
        self.group = group
        self._clock = clock
        self._next_step = 0
        self._last: tuple[int, float] | None = None
        self._per_step = 0.0
        self.agreements = 0

    def due(self, step: int, epoch_end: bool) -> bool:
        return epoch_end or step >= self._next_step

    def reduce(self, flags: Flags, step: int) -> Flags:
        """All-reduce ``flags`` (a collective: every rank must call it at the same step)."""
        now = self._clock()
        if self._last is not None and step > self._last[0]:
            # Only steps taken count: an epoch end right after a batch's agreement (same step)
            # would otherwise look like a step of a few microseconds.
            last_step, last_time = self._last
            self._per_step = (now - last_time) / (step - last_step)
        per_step = self._per_step
        t = torch.tensor([flags.stop, flags.checkpoint, flags.interval, flags.best, flags.epoch,
                          flags.seq, per_step, flags.writing, flags.failed, flags.tier_due,
                          flags.tier_busy, flags.tier_off],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        let_go(t)
        v = t.tolist()
        self.agreements += 1
        if self.every is not None:
            k = self.every
        elif v[6] > 0:
            k = max(1, min(MAX_SYNC_EVERY, int(AGREE_SECONDS / v[6])))
        else:
            k = 1
        self._next_step = step + k
        if self._last is None or step > self._last[0]:
            self._last = (step, self._clock())
        return Flags(stop=v[0] > 0, checkpoint=v[1] > 0, interval=v[2] > 0, best=v[3] > 0,
                     epoch=v[4] > 0, seq=int(v[5]), writing=v[7] > 0, failed=v[8] > 0,
                     tier_due=v[9] > 0, tier_busy=v[10] > 0, tier_off=v[11] > 0)


def device_for_group(group: Any = None) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
