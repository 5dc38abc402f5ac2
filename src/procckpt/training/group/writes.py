"""Group checkpoints written in the background, committed by rank 0 once every part is durable.

Each rank copies its part at the agreed step and writes it while training goes on.

    at the agreed step (every rank)            later agreements (the usual all-reduce)
    ---------------------------------------    ------------------------------------------
    rank 0 opens checkpoints/.tmp-ckpt-N,  ->  each rank adds "my part is still being
    broadcasts its path; each rank copies      written" and "my part failed" to the flags;
    its part into its host arena (the stall)   when no rank is writing any more: rank 0
    and its writer thread writes it there      commits (manifest, rename) and tells the
                                               others, or aborts if any part failed

Until the commit the previous checkpoint stays the one to resume from. A second checkpoint,
a stop, ``save()`` and the end of training first settle the one in flight, waiting for it.
State wrapped in ``Sharded`` is copied at the agreed step too, each rank its own shards, and
written in DCP's format by the writer threads (see shard_copies.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ProcckptError
from ...protocol import control as ctl
from ...store import CheckpointInfo, PendingCheckpoint
from ..link.flags import Flags
from ..save.arena import NotSnapshottable
from ..save.background import BackgroundSaver
from ..save.frozen import ChunkPlan
from ..save.writer import save_payload
from ..sharded.dcp import dcp_errors, dcp_failure
from ..sharded.files import Sums
from ..sharded.frozen import FrozenPart, split_frozen
from . import coordinator as files  # write_synced looked up when used: tests replace it
from .coordinator import RANK_FILE, DistributedCoordinator, GroupMember, rank_part
from .shard_writes import ShardWrites

__all__ = ["GroupWrites"]

logger = logging.getLogger(__name__)

Position = tuple[int, int, int]


@dataclass
class _Part:
    """This rank's part of the group checkpoint in flight."""

    tmp: Path
    reason: str
    position: Position
    started: float
    stall: float
    request: ctl.Request | None
    pending: PendingCheckpoint | None  # rank 0 only
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    sums: Sums = field(default_factory=dict)  # DCP's files, summed as they were written
    plan: ChunkPlan | None = None  # rank 0: its frozen parameters (save/frozen.py)
    frozen: FrozenPart | None = None  # the frozen sharded parameters (frozen_shards.py)


class GroupWrites:
    """The background side of one rank's group checkpoints."""

    def __init__(self, coordinator: DistributedCoordinator, background: BackgroundSaver,
                 shards: ShardWrites | None = None) -> None:
        self.coordinator = coordinator
        self.background = background
        #: The sharded state's side, when there is ``Sharded`` state.
        self.shards = shards
        self._part: _Part | None = None

    @property
    def in_flight(self) -> bool:
        return self._part is not None

    def mark(self, flags: Flags) -> None:
        """Add this rank's writing state to the flags it brings to the agreement."""
        part = self._part
        flags.writing = part is not None and not part.done.is_set()
        flags.failed = part is not None and part.error is not None

    def payload(self, ck: GroupMember) -> dict[str, Any]:
        """What this rank copies at the agreed step (see :meth:`inputs`)."""
        return self.inputs(ck)[0]

    def inputs(self, ck: GroupMember,
               ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """(what this rank copies, the live sharded state DCP plans from, the frozen sharded
        parameters). The copy holds its part (rank 0 the replicated state, other ranks their
        own random streams) and, with sharded state, its local shards: ``{"part": ...,
        "shards": ...}``. The frozen parameters are split off the live state and not copied
        (frozen_shards.py)."""
        coordinator = self.coordinator
        sharded = set(self.shards.sharded) if self.shards is not None else set()
        if coordinator.rank == 0:
            part = ck.replicated_payload(exclude=sharded)
        else:
            part = rank_part(ck, coordinator.rank, coordinator.world_size)
        if self.shards is None:
            return part, None, {}
        live, frozen = split_frozen(self.shards.sharded, self.shards.live())
        return {"part": part, "shards": self.shards.locals_of(live)}, live, frozen

    def start(self, ck: GroupMember, reason: str, position: Position,
              request: ctl.Request | None) -> bool:
        """Collective: copy this rank's part and write it in the background. False (on every
        rank alike) when some rank's state cannot be copied: save synchronously instead."""
        self.settle(ck, None)
        coordinator = self.coordinator
        try:
            pending, tmp = coordinator.begin_group(
                ck, reason, sharded=sorted(self.shards.sharded) if self.shards else [])
        except ProcckptError as e:
            logger.error("%s", e)
            return False
        started = time.monotonic()
        payload, live, frozen_state = self.inputs(ck)
        frozen: FrozenPart | None = None
        if live is not None:
            try:  # collective; a set to write is written now, synchronously
                frozen = coordinator.frozen_shards.prepare(
                    frozen_state, tmp, coordinator.any_rank, coordinator.group,
                    ck.store.chunks if coordinator.rank == 0 else None)
            except dcp_errors() as e:
                logger.error("frozen sharded parameters: %s", dcp_failure(e))
                if pending is not None:
                    pending.abort()
                return False
        plan = ck.frozen.plan(payload if live is None else payload["part"]) \
            if ck.frozen is not None else None
        if plan is not None:
            payload = plan.payload if live is None else {**payload, "part": plan.payload}
        snapshot = None
        try:
            snapshot = self.background.capture(payload)
        except NotSnapshottable as e:
            logger.info("writing this checkpoint synchronously: the state holds %s", e)
        if coordinator.any_rank(snapshot is None):
            if pending is not None:
                pending.abort()
            return False
        assert snapshot is not None
        part = _Part(tmp, reason, position, started, time.monotonic() - started, request, pending,
                     plan=plan, frozen=frozen)

        def write(copy: Any) -> None:  # on the writer thread
            if live is not None:  # first: collective with the other ranks' writer threads
                assert self.shards is not None
                part.sums = self.shards.write(live, copy["shards"], str(tmp))
                copy = copy["part"]
            if pending is not None:
                save_payload(pending, ck.payload_name, copy, plan)
            else:
                files.write_synced(tmp / RANK_FILE.format(rank=coordinator.rank), copy)

        def failed(error: BaseException) -> None:
            part.error = str(error)
            part.done.set()

        self._part = part
        self.background.start_task(snapshot, write, part.done.set, failed)
        return True

    def settle(self, ck: GroupMember, agreed: Flags | None) -> CheckpointInfo | None:
        """Collective: commit (or abort) the checkpoint in flight once every part is written.

        With ``agreed`` (the flags of an agreement step) it acts only when no rank is still
        writing; without, it waits for this rank's part first. Returns the committed
        checkpoint, if this call committed one.
        """
        part = self._part
        if part is None or (agreed is not None and agreed.writing):
            return None
        coordinator = self.coordinator
        if agreed is None:
            part.done.wait()
            failed = bool(coordinator.any_rank(part.error is not None))
        else:
            failed = agreed.failed
        self._part = None
        result = ""
        info: CheckpointInfo | None = None
        if failed:
            result = "!a rank could not write its part (see its log)"
            if part.error:
                logger.error("rank %d could not write its part of the checkpoint: %s",
                             coordinator.rank, part.error)
        if part.pending is not None:  # rank 0
            if failed:
                part.pending.abort()
            else:
                try:
                    info = coordinator.commit_group(ck, part.pending, part.tmp, part.sums,
                                                    part.frozen)
                    result = info.path.name
                except Exception as e:
                    part.pending.abort()
                    result = f"!{e}"
            if part.plan is not None:
                part.plan.durable() if info is not None else part.plan.failed()
        committed = coordinator.broadcast_text(result)
        if committed.startswith("!"):
            coordinator.frozen_shards.failed()
            logger.error("the checkpoint of step %d was not committed (%s); the previous "
                         "checkpoint stays the one to resume from", part.position[2],
                         committed[1:])
            ck.record_failed(part.request, part.position, part.reason, committed[1:])
            return None
        coordinator.frozen_shards.durable(part.frozen)
        if info is None:
            info = CheckpointInfo(ck.store.ckpt_root / committed, int(committed.split("-")[1]),
                                  {})
        ck.record_background(info, part.request, part.reason, part.position,
                             time.monotonic() - part.started, part.stall)
        if part.pending is not None:
            ck.store.prune()  # after the others go on: they need not wait for deletions
        return info
