"""What one rank wants at a safe point, and after the group's all-reduce what the group does:
the trigger decision a single process makes alone, and a group agrees on
(training/group/agreement.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Flags"]


@dataclass
class Flags:
    """What one rank wants at a safe point; after the all-reduce, what the group does."""

    stop: bool = False
    checkpoint: bool = False
    interval: bool = False
    best: bool = False
    epoch: bool = False
    seq: int = 0  # the newest launcher request this rank has seen
    writing: bool = False  # its part of a background group checkpoint is still being written
    failed: bool = False  # writing its part failed
    # The memory tier (group/tier.py): rank 0's slot is due; a rank's slot is still being
    # written; a rank's tier is off (then every rank's is).
    tier_due: bool = False
    tier_busy: bool = False
    tier_off: bool = False

    def reason(self) -> str | None:
        for name in ("stop", "checkpoint", "interval", "best", "epoch"):
            if getattr(self, name):
                return name
        return None
