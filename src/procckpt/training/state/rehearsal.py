"""A restore rehearsed in miniature by a warm restart's spare interpreter while it waits.

A process's first restore pays for more than its bytes: the first ``torch.load`` with
``weights_only`` sets up its unpickler, the first ``load_state_dict`` of a module and of an
optimizer and the resume audit's first fingerprint run code nothing ran before, and MKL
settles its vector math (vml.py). At 64 MB that was about a tenth of a restore here
(BENCHMARKS.md). A spare (launcher/warm.py) pays it before the restart comes:
:func:`rehearse` writes a checkpoint of a few bytes to a temporary directory and restores it
through the same functions a resume calls (resume.py), in this thread.

It changes nothing a script can see: no random stream is drawn (its tensors are made by
``zeros`` and ``full``), no thread is left running (the checksum's is joined), nothing is left
on disk, no journal is written, and the modules it imports are among those
``procckpt.Checkpointer`` imports anyway.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from ...store import CheckpointStore
from ..save.writer import write_checkpoint
from . import reserve
from .first_step import restored_state
from .payload import build_payload, checkpoint_meta, load_statefuls
from .resume import load_newest_verified
from .vml import settle_vector_math

__all__ = ["rehearse"]

logger = logging.getLogger(__name__)


def rehearse(folder: str | None = None) -> bool:
    """Write and restore a tiny model and optimizer as a resume does (in a directory made in
    ``folder``, by default the system's temporary one), before the memory for the restore is
    touched (reserve.py); True if it ran. Never raises: a spare that could not rehearse
    restores as a cold start would."""
    try:
        _rehearse(folder)
    except Exception as e:  # a read-only /tmp, an odd torch: the restore pays, nothing more
        logger.debug("no restore rehearsed: %s: %s", type(e).__name__, e)
        return False
    return True


def _rehearse(folder: str | None) -> None:
    if reserve.held():  # its restore would carve from the region and give the rest back
        raise RuntimeError("the memory touched for the restore is ready already; rehearse "
                           "before it is")
    settle_vector_math()
    weight = torch.nn.Parameter(torch.zeros(4))
    module = torch.nn.Module()
    module.register_parameter("weight", weight)
    optimizer = torch.optim.Adam([weight], lr=0.5)
    weight.grad = torch.full((4,), 0.5)
    optimizer.step()
    statefuls: dict[str, Any] = {"model": module, "optimizer": optimizer}
    position = (0, 1, 1)
    progress = {"epoch": 0, "batch": 1, "step": 1, "best_metric": None}
    with tempfile.TemporaryDirectory(prefix="procckpt-rehearsal-", dir=folder) as root:
        store = CheckpointStore(Path(root), keep=1).open()
        write_checkpoint(store, checkpoint_meta(position, "rehearsal", 0, None, "max"),
                         build_payload(statefuls, progress, {}, {}))

        def apply(info: Any, payload: dict[str, Any]) -> dict[str, Any]:
            prints: dict[int, tuple[int, int]] = {}
            load_statefuls(info, payload, statefuls, prints)
            restored_state(statefuls, payload, prints)
            return payload

        if load_newest_verified(store, apply) is None:
            raise RuntimeError("the rehearsal's checkpoint was not found")
