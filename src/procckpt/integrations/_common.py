"""What the framework adapters share: finding the checkpoint a framework should load."""

from __future__ import annotations

import os

from ..store import MARKER, CheckpointInfo, CheckpointStore
from ..training.context import default_dir

__all__ = ["newest_verified"]


def newest_verified(dir: str | os.PathLike[str] | None) -> CheckpointInfo | None:
    """The newest checkpoint in the checkpoint dir whose files match their manifest, or None.

    Read before the framework starts, so that it can be told where to resume from; nothing is
    moved aside here: the Checkpointer does that when it resumes, from the same checkpoint.
    """
    store = CheckpointStore(default_dir(dir))
    if not (store.root / MARKER).is_file() or not store.ckpt_root.is_dir():
        return None
    return store.newest_intact()
