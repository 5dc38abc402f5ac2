"""Process groups: joining one, the rank agreement, sharded state and the group checkpoint."""

from ..link.flags import Flags
from ..sharded.dcp import Sharded, load_sharded, sharded_of
from ..sharded.frozen import load_sharded_state
from .agreement import ENV_SYNC_EVERY, RankAgreement
from .coordinator import (
    DistributedCoordinator,
    GroupMember,
    WorldSizeMismatch,
    check_world_size,
    coordinator_for,
)
from .setup import ENV_POLL_RANKS, first_host, init_distributed, polls_control
from .writes import GroupWrites

__all__ = ["Sharded", "Flags", "RankAgreement", "DistributedCoordinator", "GroupMember",
           "init_distributed", "polls_control", "first_host", "coordinator_for",
           "check_world_size", "load_sharded", "load_sharded_state",
           "ENV_POLL_RANKS", "ENV_SYNC_EVERY", "WorldSizeMismatch", "GroupWrites", "sharded_of"]
