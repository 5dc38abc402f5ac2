"""The memory tier in a group of ranks: every rank keeps its part at the same agreed steps.

Each rank writes its own slots into ``rank-NNNNN/`` of the launcher's tier directory: rank 0
the replicated state (as a checkpoint's ``state.pt``), every other rank its rank file. The
ranks decide together, in the agreement's all-reduce, at which step a slot is written:

    at an agreement step (every rank)         the all-reduce (MAX)
    -------------------------------------     -----------------------------------------------
    rank 0: "a slot is due" (its cadence,  -> tier_due: every rank copies its part here
    planned from its own copy, the         -> tier_busy: a rank's last slot is still being
    largest); each rank: "my last slot is        written: nobody writes one now
    still being written", "my tier is off" -> tier_off: every rank's tier goes off

So every rank holds slots of the same steps, and after a crash the launcher copies the newest
step that every rank holds intact into the store as one group checkpoint (launcher/tier.py).
Sharded state (FSDP, DTensor: DCP's collective files) is not kept in the tier yet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...protocol.control import ENV_TIER, TIER_RANK_DIR
from ..link.flags import Flags
from ..save.tier import TierWriter
from .coordinator import RANK_FILE, GroupMember, rank_part

__all__ = ["GroupTier"]

logger = logging.getLogger(__name__)


class GroupTier:
    """One rank's side of the group's memory tier (see the module)."""

    def __init__(self, writer: TierWriter, rank: int, world_size: int) -> None:
        writer.says = rank == 0
        self.writer = writer
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def from_environment(cls, journal: Path | None, rank: int, world_size: int,
                         sharded: bool) -> GroupTier | None:
        """This rank's part of the tier the launcher made, if any. A rank on a node
        without the launcher's directory (a group across nodes) is off, and so, at the
        first agreement, is every rank."""
        path = os.environ.get(ENV_TIER)
        if not path:
            return None
        if sharded:
            if rank == 0:
                logger.info("memory tier: not used with sharded state (Sharded, FSDP) yet; a "
                            "crash resumes from the newest checkpoint")
            return None
        root = Path(path)
        name = "state.pt" if rank == 0 else RANK_FILE.format(rank=rank)
        mine = root / TIER_RANK_DIR.format(rank=rank)
        if not root.is_dir():  # (never made here: the launcher makes it)
            writer = TierWriter(mine, journal, name)
            # (said here: rank 0's line at the agreement points to this rank's log)
            writer.turn_off(f"rank {rank}'s node has no {root} (the ranks span nodes)")
            return cls(writer, rank, world_size)
        return cls(TierWriter.opened(mine, journal, name), rank, world_size)

    def mark(self, flags: Flags) -> None:
        """Add this rank's tier state to the flags it brings to the agreement."""
        writer = self.writer
        flags.tier_due = self.rank == 0 and writer.due()
        flags.tier_busy = writer.busy()
        flags.tier_off = writer.off is not None

    def at_safe_point(self, now: float, agreed: Flags | None, write: bool, ck: GroupMember,
                      meta: Callable[[], dict[str, Any]],
                      before: Callable[[dict[str, Any]], None]) -> None:
        """Count a safe point; at an agreement step (``agreed``) where the group wants a slot
        and ``write`` (no checkpoint was taken here, alike on every rank), write this rank's
        part of it."""
        writer = self.writer
        writer.count(now, True)
        if agreed is None:
            return
        if agreed.tier_off:
            if writer.off is None:
                writer.turn_off("another rank cannot keep its part", say=False)
                if self.rank == 0:
                    logger.warning("memory tier: off, a rank cannot keep its part (see its "
                                   "log); a crash resumes from the newest checkpoint")
            return
        if agreed.tier_due and not agreed.tier_busy and write:
            writer.write_slot(lambda: {**meta(), "world_size": self.world_size, "sharded": []},
                              lambda: self.payload(ck), before)

    def payload(self, ck: GroupMember) -> dict[str, Any]:
        return ck.replicated_payload(exclude=set()) if self.rank == 0 \
            else rank_part(ck, self.rank, self.world_size)

    def close(self) -> None:
        self.writer.close()
