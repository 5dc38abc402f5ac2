"""One process's checkpoints: written now or in the background, and recorded once durable.

A checkpoint written in the background counts (is acknowledged to the launcher, journalled,
pruned against) only from the moment it is durable; until then the previous one is the one to
resume from. The events journal gets one ``checkpoint`` line per durable checkpoint, with its
size and how long it took (and how long training paused, for a background one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..protocol.events import append_event
from ..protocol.switches import FROZEN_ONCE
from ..store import CheckpointInfo, CheckpointStore
from .group import DistributedCoordinator, GroupWrites, sharded_of
from .group.shard_writes import ShardWrites
from .group.tier import GroupTier
from .link.triggers import SaveTriggers
from .save.arena import NotSnapshottable
from .save.background import BackgroundSaver, WriteResult, async_wanted, staged
from .save.fence import StepFence
from .save.frozen import FrozenChunks
from .save.tier import TierWriter
from .save.writer import write_checkpoint
from .state.payload import PAYLOAD

__all__ = ["Saves", "background_savers", "frozen_chunks", "memory_tier"]

logger = logging.getLogger(__name__)

Position = tuple[int, int, int]


def background_savers(store: CheckpointStore, group: DistributedCoordinator | None,
                      is_writer: bool, statefuls: dict[str, Any], async_save: bool | None,
                      ) -> tuple[BackgroundSaver | None, GroupWrites | None]:
    """What writes this process's checkpoints in the background, if anything does: a saver
    for the one process that writes, or a saver and the group's side for every rank of a
    group (collective then: a group with ``Sharded`` state makes a process group for DCP)."""
    if not async_wanted(async_save):
        return None, None
    fence = StepFence.for_statefuls(statefuls)
    if group is None:
        return (BackgroundSaver(store, PAYLOAD, fence) if is_writer else None), None
    sharded = sharded_of(statefuls)
    background = BackgroundSaver(store, PAYLOAD, fence)
    group.writes = GroupWrites(group, background, ShardWrites(sharded) if sharded else None)
    return background, group.writes


def memory_tier(journal: Path | None, group: DistributedCoordinator | None, is_writer: bool,
                statefuls: dict[str, Any]) -> TierWriter | GroupTier | None:
    """This process's side of the launcher's memory tier, if the launcher made one: alone,
    or as one rank of a group (its coordinator then brings it to every agreement)."""
    if group is None:
        return TierWriter.from_environment(journal) if is_writer else None
    tier = GroupTier.from_environment(journal, group.rank, group.world_size,
                                      bool(sharded_of(statefuls)))
    group.tier = tier
    return tier


def frozen_chunks(store: CheckpointStore, statefuls: dict[str, Any],
                  is_writer: bool) -> FrozenChunks | None:
    """What stores the frozen parameters of ``statefuls``' modules once (save/frozen.py), in
    the process that writes ``state.pt`` (rank 0 of a group); None with
    ``PROCCKPT_FROZEN_ONCE=0``."""
    if not is_writer or not FROZEN_ONCE.read():
        return None
    if not any(isinstance(obj, torch.nn.Module) or hasattr(obj, "procckpt_modules")
               for obj in statefuls.values()):
        return None

    def modules() -> list[torch.nn.Module]:  # a framework's model may come later
        found = [obj for obj in statefuls.values() if isinstance(obj, torch.nn.Module)]
        for obj in statefuls.values():
            if hasattr(obj, "procckpt_modules"):
                found += obj.procckpt_modules()
        return found

    return FrozenChunks(modules, store.chunks)


class Saves:
    """Writes the checkpoints of the process that writes them (rank 0, or the only one).

    Args:
        background: the background saver, or None to write every checkpoint synchronously.
        triggers: told when a checkpoint was taken, and which request it answers.
        frozen: the frozen parameters written once (save/frozen.py), or None to write all
            of the state into every checkpoint.
    """

    def __init__(self, store: CheckpointStore, background: BackgroundSaver | None,
                 triggers: SaveTriggers, *, is_writer: bool,
                 group: GroupWrites | None = None, frozen: FrozenChunks | None = None) -> None:
        self.store = store
        self.frozen = frozen
        self.background = background
        self.group = group
        self.triggers = triggers
        self.is_writer = is_writer
        #: The newest durable checkpoint.
        self.last: CheckpointInfo | None = None
        #: The position of the newest checkpoint taken (or being written).
        self.saved_at: Position | None = None
        #: The longest stretch between two safe points so far (the Checkpointer's liveness
        #: measures it, under a launcher): journalled with each checkpoint, so that the
        #: deadline's lead learns it also across launches (a requeued job) and from a
        #: stretch a stop's request met.
        self.longest_gap: Callable[[], float] = lambda: 0.0

    def write(self, meta: dict[str, Any], payload: dict[str, Any], reason: str,
              position: Position) -> CheckpointInfo:
        """Write a checkpoint now; durable and pruned against on return.

        Raises:
            StorageError: no space or no permission (the previous checkpoint is intact).
        """
        if self.background is not None:
            # A failed background write was logged; this checkpoint supersedes it.
            self.background.wait(raise_failure=False)
        started = time.monotonic()
        plan = self.frozen.plan(payload) if self.frozen is not None else None
        with staged(self.background, payload if plan is None else plan.payload) as state:
            info = write_checkpoint(self.store, meta, state, PAYLOAD, plan)
        self.taken(info, reason, position, meta.get("restart", 0), time.monotonic() - started)
        return info

    def answer(self, info: CheckpointInfo | None, step: int, *, stopping: bool) -> None:
        """Tell the launcher a checkpoint was taken (synchronously), then prune: deleting
        the old checkpoints (~0.5 s per GiB here) is not part of the time to a durable one."""
        self.triggers.answer(info, step, stopping=stopping)
        self.pruned(info)

    def pruned(self, info: CheckpointInfo | None) -> CheckpointInfo | None:
        """Delete checkpoints older than the ones kept (the writer's job); return ``info``."""
        if self.is_writer and info is not None:
            self.store.prune()
        return info

    def taken(self, info: CheckpointInfo, reason: str, position: Position, restart: int,
              seconds: float) -> None:
        """Book-keeping after a synchronous checkpoint (a group's too)."""
        self.triggers.last_save = time.monotonic()
        self.saved_at = position
        self.record(info, reason, position, restart, seconds)

    def write_in_background(self, meta: dict[str, Any], payload: Callable[[], dict[str, Any]],
                            reason: str, position: Position) -> bool:
        """Copy the state and write it on the writer thread; False if it must be written
        synchronously instead. The request is acknowledged once the checkpoint is durable."""
        assert self.background is not None
        started = time.monotonic()
        triggers = self.triggers
        self.background.wait(raise_failure=False)  # the plan needs what it stored
        state = payload()
        plan = self.frozen.plan(state) if self.frozen is not None else None
        try:
            snapshot = self.background.capture(state if plan is None else plan.payload)
        except NotSnapshottable as e:
            logger.info("writing this checkpoint synchronously: the state holds %s", e)
            return False
        stall = time.monotonic() - started
        request = triggers.take_request()
        restart = meta.get("restart", 0)

        def durable(result: WriteResult) -> None:  # runs on the writer thread
            self.durable(result.info, request, reason, position, restart,
                         time.monotonic() - started, stall)
            self.store.prune()  # after the ack: the launcher need not wait for deletions

        def failed(error: BaseException) -> None:  # runs on the writer thread
            self.failed(request, position, reason, str(error))

        triggers.last_save = time.monotonic()
        self.saved_at = position  # before the thread starts: failed() may reset it
        self.background.start(snapshot, meta, durable, failed, plan)
        logger.debug("state copied for checkpoint in %.3fs (%.1f MB, %d tensors)", stall,
                     snapshot.nbytes / 1e6, snapshot.tensors)
        return True

    def reserve_ahead(self, payload: Callable[[], dict[str, Any]], member: Any) -> None:
        """Once: make the host arena for this process's part, in the background (see
        :meth:`BackgroundSaver.reserve`). Called after the first step, when the state has its
        final shapes (optimizers make theirs lazily)."""
        if self.background is not None and self.background.unreserved:
            self.background.reserve(self.group.payload(member) if self.group else payload())

    def in_background(self, reason: str, position: Position,
                      meta: Callable[[str], dict[str, Any]],
                      payload: Callable[[], dict[str, Any]], member: Any) -> bool:
        """Write this checkpoint in the background where this process does that (collective
        in a group); False: write it synchronously instead."""
        if self.group is not None:
            return self.write_group_part(self.group, member, reason, position)
        if self.background is None:
            return False
        return self.write_in_background(meta(reason), payload, reason, position)

    def write_group_part(self, group: GroupWrites, member: Any, reason: str,
                         position: Position) -> bool:
        """Collective: this rank's part of a group checkpoint, written in the background;
        False (on every rank) when it must be written synchronously instead."""
        request = self.triggers.request
        if not group.start(member, reason, position, request):
            return False
        self.triggers.take_request()  # answered when the group commits
        self.triggers.last_save = time.monotonic()
        self.saved_at = position
        return True

    def durable(self, info: CheckpointInfo, request: Any, reason: str, position: Position,
                restart: int, seconds: float, stall: float) -> None:
        """A checkpoint of ``position`` written in the background is durable (committed, in a
        group): journal it and answer the request it was taken for."""
        self.record(info, reason, position, restart, seconds, stall=stall)
        self.triggers.acknowledge(request, info, position[2], stopping=False)

    def failed(self, request: Any, position: Position, reason: str, error: str) -> None:
        """A checkpoint of ``position`` written in the background was not committed."""
        if self.saved_at == position:
            self.saved_at = None  # so that the end of training saves again
        if self.is_writer:
            append_event(self.store.events_path, "checkpoint-failed", step=position[2],
                         reason=reason, error=error)
        self.triggers.acknowledge(request, None, position[2], stopping=False, error=error)

    def record(self, info: CheckpointInfo, reason: str, position: Position, restart: int,
               seconds: float, stall: float | None = None) -> None:
        """A checkpoint is durable: journal and log it (on the writer thread for async ones)."""
        self.last = info
        if not self.is_writer:
            return
        epoch, batch, step = position
        background = {} if stall is None else {"stall": round(stall, 4), "background": True}
        gap = self.longest_gap()
        append_event(self.store.events_path, "checkpoint", checkpoint=info.name, step=step,
                     epoch=epoch, batch=batch, bytes=info.nbytes, written=info.written,
                     seconds=round(seconds, 4), reason=reason, restart=restart,
                     **background, **({"gap": round(gap, 3)} if gap > 0 else {}))
        fresh = "" if info.written == info.nbytes else f" ({info.written / 1e6:.1f} MB new)"
        logger.info("checkpoint %s saved: step %d, epoch %d, %.1f MB%s in %.2fs%s (%s)",
                    info.name, step, epoch, info.nbytes / 1e6, fresh, seconds,
                    "" if stall is None else f", training paused {stall:.3f}s", reason)

    def mark_complete(self, position: Position, info: CheckpointInfo | None) -> None:
        """Training ended with checkpoint ``info``: a rerun has nothing left to do."""
        if not self.is_writer:
            return
        epoch, _, step = position
        control = self.triggers.control
        self.store.mark_complete(step=step, epoch=epoch, checkpoint=info.name if info else None,
                                 token=control.token if control else None)
        append_event(self.store.events_path, "complete", step=step, epoch=epoch)

    def wait(self) -> None:
        """Wait for a background write in flight; its failure was logged already."""
        if self.background is not None:
            self.background.wait(raise_failure=False)
