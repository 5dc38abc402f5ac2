"""The group checkpoint: the ranks agree, write their parts of one checkpoint, rank 0 commits it.

Under ``torchrun`` or ``srun`` every rank runs its own :class:`~procckpt.Checkpointer`. A
request (``control/request.json``, a SIGTERM, ``request_checkpoint()``) may reach one rank,
some or all of them, at different steps. Saving the moment a rank sees it would leave the
others blocked in the next gradient all-reduce, so the ranks *agree* first:

    every rank, at safe points                       the whole group
    ----------------------------------------------   ----------------------------------------
    polls control/ (every 0.2 s), notes signals  ->  at agreement steps: all_reduce(MAX) of
                                                     [stop, checkpoint, interval, best, epoch,
                                                      request seq, seconds per step,
                                                      writes in flight, the memory tier]
    <-  every rank gets the same answer, so all save at the same step (or none does)

The agreement's timing is in agreement.py.

One checkpoint, written by all ranks, committed by rank 0 (see store/ for the layout)::

    checkpoints/.tmp-ckpt-N-...      rank 0 creates it and broadcasts its path
      state.pt                       rank 0: replicated state (DDP model, optimizer, progress,
                                     rank 0's random streams)
      rank-00001.pt ...              rank r >= 1: its own random streams
      .metadata, __R_0.distcp        torch.distributed.checkpoint: each rank's shards of the
                                     state wrapped in :class:`Sharded` (FSDP2, DTensor)
      MANIFEST.json                  rank 0, after every rank reported success
    checkpoints/ckpt-N               the rename that commits all of it at once

Every rank waits for rank 0's commit before it goes on (or exits), so a launcher that tears the
group down when the first rank exits (torchrun does) cannot cut the commit short.

Loading: rank 0 picks the newest checkpoint whose files all match the manifest's checksums and
broadcasts its name; each rank loads the replicated state, its own random streams and its
shards. A checkpoint from a different world size is refused unless ``allow_reshard``: then
sharded state is resharded by DCP, replicated state loads as is, ranks without a saved stream
keep their seed, and the position within an epoch is scaled by the world-size ratio (exact only
at epoch boundaries; the log says so).
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ...errors import CheckpointCorruptError, ProcckptError, StorageError, UsageError
from ...store import (
    CheckpointInfo,
    CheckpointStore,
    PendingCheckpoint,
    fsync_dir,
    lasting_write_error,
)
from ..link.flags import Flags
from ..position.resplit import resplit_position
from ..save.background import staged
from ..save.frozen import ChunkPlan
from ..save.writer import save_payload
from ..sharded.dcp import dcp_errors, dcp_failure, dcp_failures, dcp_state, sharded_of
from ..sharded.files import Sums, save_dcp
from ..sharded.frozen import FrozenPart, FrozenShards, load_sharded_state, split_frozen
from .agreement import ENV_SYNC_EVERY, RankAgreement, device_for_group
from .backend_threads import let_go, settle_at_exit
from .sums import gather_sums

__all__ = ["DistributedCoordinator", "GroupMember", "WorldSizeMismatch", "coordinator_for",
           "write_synced", "rank_part", "RANK_FILE", "RANK_FILE_FORMAT"]

logger = logging.getLogger(__name__)

RANK_FILE = "rank-{rank:05d}.pt"
RANK_FILE_FORMAT = 1
_PATH_BYTES = 4096


class WorldSizeMismatch(ProcckptError):
    """A checkpoint written by another number of ranks, and resharding was not allowed."""

    exit_code = 1


class GroupMember(Protocol):
    """What the coordinator needs of one rank's Checkpointer, and nothing more: the state to
    save, where it goes, and what to record once the group committed it."""

    store: CheckpointStore
    payload_name: str  # the file the replicated state goes into (written by rank 0)

    @property
    def step(self) -> int: ...

    @property
    def frozen(self) -> Any:
        """Rank 0: what writes frozen parameters once (save/frozen.py); None elsewhere."""

    @property
    def statefuls(self) -> Mapping[str, Any]: ...

    def checkpoint_meta(self, reason: str) -> dict[str, Any]:
        """What the manifest says about this checkpoint (step, epoch, reason, ...)."""

    def replicated_payload(self, exclude: set[str]) -> dict[str, Any]:
        """The state every rank holds alike, without the ``exclude`` (sharded) statefuls."""

    def rank_payload(self) -> dict[str, Any]:
        """This rank's own state: its random streams."""

    def record_save(self, info: CheckpointInfo, reason: str, seconds: float) -> None:
        """Book-keeping once the group's checkpoint is committed."""

    def record_background(self, info: CheckpointInfo, request: Any, reason: str,
                          position: tuple[int, int, int], seconds: float, stall: float) -> None:
        """Book-keeping (and the launcher's answer) once a background group checkpoint of
        ``position`` is committed."""

    def record_failed(self, request: Any, position: tuple[int, int, int], reason: str,
                      error: str) -> None:
        """A background group checkpoint was not committed: answer and forget it."""

    def load_newest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """One process's verified load of the newest checkpoint (the rank-0 path)."""

    def read_payload(self, info: CheckpointInfo) -> dict[str, Any]:
        """The replicated payload of ``info``, read plainly (``weights_only``)."""


class DistributedCoordinator:
    """The collective side of one rank's Checkpointer."""

    def __init__(self, sync_every: int | None = None, allow_reshard: bool = False,
                 group: Any = None) -> None:
        if sync_every is None and os.environ.get(ENV_SYNC_EVERY):
            try:
                sync_every = int(os.environ[ENV_SYNC_EVERY])
            except ValueError:
                raise UsageError(f"bad {ENV_SYNC_EVERY}={os.environ[ENV_SYNC_EVERY]!r}: expected "
                                 "a whole number of steps") from None
        settle_at_exit()  # the script's own collectives, too
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device_for_group(group)
        self.agreement = RankAgreement(self.device, sync_every, group)
        self.allow_reshard = allow_reshard
        #: The background side of this rank's group checkpoints (writes.GroupWrites),
        #: when checkpoints are written in the background.
        self.writes: Any = None
        #: This rank's side of the memory tier (tier.GroupTier), when the launcher made one.
        self.tier: Any = None
        self.frozen_shards = FrozenShards()

    # small collectives ---------------------------------------------------------------------
    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's ``text`` on every rank."""
        buf = torch.zeros(_PATH_BYTES, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            data = (text or "").encode()[:_PATH_BYTES - 1]
            if data:
                buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        dist.broadcast(buf, src=self._src(), group=self.group)
        let_go(buf)
        raw = bytes(buf.cpu().tolist())
        return raw.split(b"\0", 1)[0].decode()

    def _src(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def any_rank(self, flag: bool) -> list[int]:
        """Every rank learns which ranks raised ``flag``."""
        t = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        t[self.rank] = int(flag)
        dist.all_reduce(t, group=self.group)
        let_go(t)
        return [r for r, v in enumerate(t.tolist()) if v]

    # agreement ------------------------------------------------------------------------------
    def agree(self, ck: GroupMember, local: Flags | None, epoch_end: bool) -> Flags | None:
        """The group's decision at this safe point, or None when it is not an agreement step.
        A background checkpoint in flight is committed here once every rank wrote its part."""
        if not self.agreement.due(ck.step, epoch_end):
            return None
        local = local or Flags()
        if self.writes is not None:
            self.writes.mark(local)
        if self.tier is not None:
            self.tier.mark(local)
        agreed = self.agreement.reduce(local, ck.step)
        if self.writes is not None:
            self.writes.settle(ck, agreed)
        return agreed

    def settle(self, ck: GroupMember) -> None:
        """Collective: wait for the background checkpoint in flight, if any, and commit it."""
        if self.writes is not None:
            self.writes.settle(ck, None)

    # save ------------------------------------------------------------------------------------
    def save(self, ck: GroupMember, reason: str) -> CheckpointInfo | None:  # noqa: C901, PLR0915 (collectives every rank reaches in one order)
        self.settle(ck)  # the one in flight first
        started = time.monotonic()
        sharded = sharded_of(ck.statefuls)
        pending, tmp = self.begin_group(ck, reason, sorted(sharded))

        error: str | None = None
        lasting: StorageError | None = None  # this rank's failure, if it would repeat
        local_sums: Sums | None = None
        plan: ChunkPlan | None = None
        frozen: FrozenPart | None = None
        if sharded:
            try:
                # Collective; DCP itself reports a failure on every rank.
                state, frozen_state = split_frozen(sharded, dcp_state(sharded))
                frozen = self.frozen_shards.prepare(frozen_state, tmp, self.any_rank,
                                                    self.group,
                                                    ck.store.chunks if self.rank == 0 else None)
                local_sums = save_dcp(state, tmp, self.group)
            except dcp_errors() as e:
                error, lasting = f"sharded state: {dcp_failure(e)}", _lasting(e, ck.store.root)
        if error is None:
            try:
                if self.rank == 0:
                    assert pending is not None
                    payload = ck.replicated_payload(exclude=set(sharded))
                    saver = self.writes.background if self.writes else None
                    plan = ck.frozen.plan(payload) if ck.frozen is not None else None
                    # The one writer of every checkpoint:
                    with staged(saver, payload if plan is None else plan.payload) as state:
                        save_payload(pending, ck.payload_name, state, plan)
                else:
                    write_synced(tmp / RANK_FILE.format(rank=self.rank),
                                 rank_part(ck, self.rank, self.world_size))
            except Exception as e:
                error, lasting = str(e), _lasting(e, ck.store.root)
        failed = self.any_rank(error is not None)
        if failed:
            repeating = self.any_rank(lasting is not None)  # every rank is here: collective
            if pending is not None:
                pending.abort()
            if plan is not None:
                plan.failed()
            if error:
                logger.error("rank %d could not write its part of the checkpoint: %s",
                             self.rank, error)
            ranks = ", ".join(map(str, failed))
            if lasting is not None:  # no space, no permission: a restart would fail again
                raise StorageError(f"the checkpoint failed on rank(s) {ranks}: {lasting}")
            if repeating:
                raise StorageError(
                    f"the checkpoint failed on rank(s) {ranks}, for a reason that would repeat "
                    "(no space or no permission: see their logs); the previous checkpoint is "
                    "intact")
            raise ProcckptError(
                f"the checkpoint failed on rank(s) {ranks} (see their logs); the previous "
                "checkpoint stays the one to resume from")

        sums = gather_sums(local_sums, self.group, self.device) if local_sums is not None else {}
        result = ""
        info_out: CheckpointInfo | None = None
        if self.rank == 0:
            assert pending is not None
            try:
                info_out = self.commit_group(ck, pending, tmp, sums, frozen)
                result = info_out.path.name
            except Exception as e:
                pending.abort()
                result = f"!{e}"
            if plan is not None:
                plan.durable() if info_out is not None else plan.failed()
        # Everyone waits for the commit: no rank runs (or exits) ahead of a half-made checkpoint.
        committed = self.broadcast_text(result)
        if committed.startswith("!"):
            self.frozen_shards.failed()
            raise ProcckptError(f"rank 0 could not commit the checkpoint: {committed[1:]}")
        self.frozen_shards.durable(frozen)
        if info_out is None:  # not rank 0: the manifest is rank 0's business
            info_out = CheckpointInfo(ck.store.ckpt_root / committed,
                                      int(committed.split("-")[1]), {})
        ck.record_save(info_out, reason, time.monotonic() - started)
        return info_out

    def begin_group(self, ck: GroupMember, reason: str,
                    sharded: list[str]) -> tuple[PendingCheckpoint | None, Path]:
        """Collective: rank 0 opens the checkpoint's temporary directory; every rank learns
        its path (rank 0 also gets the pending checkpoint to commit).

        Raises:
            ProcckptError: rank 0 could not (on every rank alike).
        """
        pending: PendingCheckpoint | None = None
        message = ""
        if self.rank == 0:
            meta = ck.checkpoint_meta(reason)
            meta.update(world_size=self.world_size, sharded=sharded)
            try:
                pending = ck.store.begin(meta)
                message = str(pending.path)
            except Exception as e:  # broadcast the failure instead of leaving ranks waiting
                message = f"!{e}"
        text = self.broadcast_text(message)
        if text.startswith("!"):
            raise ProcckptError(f"rank 0 could not start a checkpoint: {text[1:]}")
        return pending, Path(text)

    def commit_group(self, ck: GroupMember, pending: PendingCheckpoint, tmp: Path,
                     sums: Sums | None = None,
                     frozen: FrozenPart | None = None) -> CheckpointInfo:
        """Rank 0: add the other ranks' files (and DCP's shards) to ``pending`` and commit
        it. ``sums``: DCP's files as summed while written (dcp_files.py); any other file is
        read back. ``frozen``: the frozen sharded parameters' set (frozen_shards.py). The
        caller aborts ``pending`` if this raises."""
        sums = sums or {}
        if frozen is not None:
            self.frozen_shards.commit(pending, tmp, frozen)
        for name in sorted(os.listdir(tmp)):
            if name not in pending.files and name != "MANIFEST.json" \
                    and not name.startswith(".tmp-") and not name.endswith(".tmp"):
                summed = sums.get(name)
                if summed is not None and os.stat(tmp / name).st_size == summed[0]:
                    pending.record_file(name, *summed)  # written and fsynced by DCP
                else:
                    pending.add_file(name)  # other ranks' files; DCP's when not summed
        return pending.commit()  # the caller prunes once the others know

    # load -------------------------------------------------------------------------------------
    def load_latest(self, ck: GroupMember) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """Collective: every rank loads the checkpoint rank 0 picked (verified)."""
        choice = ""
        payload: dict[str, Any] | None = None
        info: CheckpointInfo | None = None
        if self.rank == 0:
            try:
                loaded = ck.load_newest()
            except ProcckptError as e:
                choice = f"!{e}"
            else:
                if loaded is not None:
                    info, payload = loaded
                    choice = info.path.name
        choice = self.broadcast_text(choice)
        if choice.startswith("!"):
            raise CheckpointCorruptError(choice[1:])
        if not choice:
            return None
        path = ck.store.ckpt_root / choice
        if info is None:
            manifest = ck.store._read_manifest(path)
            if manifest is None:
                raise CheckpointCorruptError(
                    f"rank {self.rank} cannot read {path}/MANIFEST.json that rank 0 read: is "
                    f"{ck.store.root} on a file system that every node shares?")
            info = CheckpointInfo(path, int(choice.split("-")[1]), manifest)
        error: Exception | None = None
        try:
            if payload is None:
                payload = ck.read_payload(info)
            payload = self._adapt(ck, info, payload)
        except Exception as e:
            error = e
        failed = self.any_rank(error is not None)
        if isinstance(error, ProcckptError):
            raise error
        if error is not None:
            raise ProcckptError(f"rank {self.rank} could not load {info.path}: {error}") from error
        if failed:
            raise ProcckptError(f"rank(s) {', '.join(map(str, failed))} could not load {choice} "
                                "(see their logs)")
        assert payload is not None
        frozen = load_sharded_state(ck.statefuls, info, use_group=True)
        if frozen:
            self.frozen_shards.loaded(info, frozen)
        return info, payload

    def _adapt(self, ck: GroupMember, info: CheckpointInfo,
               payload: dict[str, Any]) -> dict[str, Any]:
        """This rank's view of a checkpoint: its random streams; positions if resharding."""
        saved_world = int(info.manifest.get("world_size", 1) or 1)
        if saved_world != self.world_size:
            check_world_size(info, saved_world, self.world_size, self.allow_reshard,
                             log=self.rank == 0)
            payload = resplit_position(payload, saved_world, self.world_size,
                                       log=self.rank == 0)
        if self.rank == 0 or self.rank >= saved_world:
            if self.rank >= saved_world:
                logger.warning("rank %d has no saved random streams (the checkpoint has %d "
                               "ranks); it keeps the ones the script seeded", self.rank,
                               saved_world)
                # Its streams as the script seeded them, standing in for "now" and for the
                # epoch's start (a mid-epoch resume replays the epoch from the latter).
                from ..position.rng import capture_rng

                payload = {**payload, "rng": capture_rng(), "epoch_rng": capture_rng()}
            return payload
        rank_path = info.path / RANK_FILE.format(rank=self.rank)
        try:
            mine = torch.load(rank_path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ProcckptError(f"rank {self.rank} cannot load {rank_path}: {e}") from e
        if not isinstance(mine, dict) or mine.get("format") != RANK_FILE_FORMAT:
            raise ProcckptError(f"{rank_path} is not a procckpt rank file")
        return {**payload, "rng": mine["rng"], "epoch_rng": mine["epoch_rng"]}


def check_world_size(info: CheckpointInfo, saved: int, now: int, allow_reshard: bool,
                     log: bool = True) -> None:
    """Refuse a checkpoint of ``saved`` ranks in a run of ``now`` ranks unless resharding."""
    if saved == now:
        return
    if not allow_reshard:
        raise WorldSizeMismatch(
            f"checkpoint {info.name} was written by {saved} ranks, this run has {now}: run "
            f"with {saved} ranks to resume exactly, or pass allow_reshard=True to the "
            "Checkpointer to load it into the new world size (sharded state is resharded; "
            "data order and random streams will then differ from an uninterrupted run)")
    if log:
        logger.warning("resharding checkpoint %s from %d to %d ranks: the model and optimizer "
                       "are restored, the data order and random streams are not those of an "
                       "uninterrupted run", info.name, saved, now)




def _lasting(error: BaseException, root: Path) -> StorageError | None:
    """The one-line error when ``error`` (or a rank's error inside DCP's) would repeat."""
    for cause in dcp_failures(error).values() or [error]:
        lasting = lasting_write_error(cause, root)
        if lasting is not None:
            return lasting
    return None


def rank_part(ck: GroupMember, rank: int, world_size: int) -> dict[str, Any]:
    """What rank ``rank`` > 0 writes into its rank file: its own random streams."""
    return {"format": RANK_FILE_FORMAT, "rank": rank, "world_size": world_size,
            "step": ck.step, **ck.rank_payload()}


def write_synced(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


def coordinator_for(sync_every: int | None, allow_reshard: bool) -> DistributedCoordinator | None:
    """A coordinator when a process group is up; an error when ranks run without one."""
    if dist.is_available() and dist.is_initialized():
        return DistributedCoordinator(sync_every, allow_reshard)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise UsageError(
            f"WORLD_SIZE is {world} but torch.distributed is not initialised: create the "
            "Checkpointer after torch.distributed.init_process_group() (or "
            "procckpt.init_distributed()), so that the ranks can agree on checkpoints")
    return None
