"""What the framework adapters share: the checkpoint a framework should load, and a
Checkpointer that resumed from that same one."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ProcckptError
from ..log import setup_logging
from ..protocol.control import ENV_TOKEN
from ..store import MARKER, CheckpointInfo, CheckpointStore
from ..training.checkpointer import Checkpointer
from ..training.link.context import dir_and_remote

__all__ = ["newest_verified", "checkpointer_resumed_from"]


def newest_verified(dir: str | os.PathLike[str] | None) -> CheckpointInfo | None:
    """The newest checkpoint in the checkpoint dir whose files match their manifest, or None.

    Read before the framework starts, so that it can be told where to resume from; nothing is
    moved aside here: the Checkpointer does that when it resumes, from the same checkpoint.
    """
    local, remote = dir_and_remote(dir)
    store = CheckpointStore(local, remote=remote)
    if store.remote is not None:  # a resume on another node: the newest is remote
        # Before the Checkpointer exists, which sets logging up: say what was fetched.
        setup_logging(label="train" if os.environ.get(ENV_TOKEN) else None)
        store.open().fetch_remote()
    if not (store.root / MARKER).is_file() or not store.ckpt_root.is_dir():
        return None
    return store.newest_intact()


def checkpointer_resumed_from(chosen: CheckpointInfo | None, **settings: Any) -> Checkpointer:
    """A Checkpointer (``settings`` are its arguments) that resumed from ``chosen``, the
    checkpoint the framework was told to load before it started.

    Raises:
        ProcckptError: the newest checkpoint is another one by now (someone else writes the
            dir, or ``chosen`` cannot be loaded after all).
    """
    ckpt = Checkpointer(**settings)
    resumed = ckpt.resumed_from
    if (resumed is None) != (chosen is None) or (
            resumed is not None and chosen is not None and resumed.path != chosen.path):
        ckpt.close()
        raise ProcckptError(
            f"the framework was told to resume from {chosen and chosen.path}, but procckpt "
            f"resumed from {resumed and resumed.path}: is another run writing to {ckpt.dir}?")
    return ckpt
