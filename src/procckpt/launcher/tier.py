"""The memory tier the launcher holds: the training's newest state, kept where a crash of the
training cannot take it (issue 55).

The launcher makes a directory on a memory file system (``/dev/shm``, or
``$PROCCKPT_MEMORY_TIER_ROOT``) and hands its path to the command. The training
(training/save/tier.py) writes its state there every few steps, as checkpoints of a store of
their own: each is complete (its manifest, with sizes and CRCs, is written last and renamed
into place), so one torn by a kill is simply not there. The launcher never reads the state
while the training runs (its memory stays small). When a cycle ends, the newest slot that is
newer than the newest checkpoint of the run's store is copied into that store as a checkpoint
like any other, before any restart: the next cycle resumes from it through the usual path,
audit included. A lost launcher or node loses the tier; the store's checkpoints remain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ProcckptError
from ..protocol.control import ENV_TIER, TIER_RANK_DIR
from ..protocol.events import append_event
from ..protocol.leftovers import make_owned_dir, sweep_dead
from ..store import CheckpointInfo, CheckpointStore
from ..store.files import MEMORY_FS_TYPES, format_size, fs_type

__all__ = ["LauncherTier", "memory_tier", "ENV_TIER_ROOT", "DEFAULT_ROOT"]

logger = logging.getLogger(__name__)

#: Where the launcher makes its tier directory (a memory file system); a test seam too.
ENV_TIER_ROOT = "PROCCKPT_MEMORY_TIER_ROOT"
DEFAULT_ROOT = Path("/dev/shm")
_PREFIX = "procckpt-tier-"
#: A slot to keep: its meta, its files, when it was written.
_Slot = tuple[dict[str, Any], list[Path], Any]
#: Manifest keys the store writes itself; the rest is the checkpoint's meta.
_STORE_KEYS = frozenset({"format", "seq", "time", "host", "pid", "files", "bytes", "chunks",
                         "written"})


class LauncherTier:
    """One launcher's tier directory; :meth:`keep_newest` copies its newest slot to the store."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.store = CheckpointStore(path, keep=2)

    def env(self) -> dict[str, str]:
        return {ENV_TIER: str(self.path)}

    def keep_newest(self, store: CheckpointStore, cycle: int) -> CheckpointInfo | None:
        """Copy the tier's newest intact slot into ``store`` if it is newer than the newest
        checkpoint there (a group's: the newest step every rank holds intact); the checkpoint
        made, or None. Never raises for the tier's sake: a failure here leaves the store as
        it was, and the run goes on from it."""
        try:
            held = store.checkpoints()
            newest = held[0].step if held else None
            slot = self._newest_slot(newest)
            if slot is None:
                return None
            meta, files, saved_at = slot
            started = time.monotonic()
            with store.begin(meta) as pending:
                for path in files:
                    pending.adopt_file(path, copy=True)
                info = pending.commit()
            seconds = time.monotonic() - started
        except (OSError, ProcckptError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            logger.warning("could not keep the memory tier's newest state in %s (%s); a "
                           "restart resumes from the newest checkpoint there", store.root, why)
            return None
        logger.info("kept step %s from the memory tier as checkpoint %s (%s in %.2fs)",
                    info.step, info.name, format_size(info.nbytes), seconds)
        append_event(store.events_path, "tier-kept", checkpoint=info.name, step=info.step,
                     epoch=info.epoch, batch=meta.get("batch"), bytes=info.nbytes,
                     seconds=round(seconds, 4), before=newest, cycle=cycle,
                     saved_at=saved_at)
        store.prune()
        return info

    def _newest_slot(self, newer_than: int | None) -> _Slot | None:
        """The newest intact slot past ``newer_than``: its meta, its files, when it was
        written. A torn slot is passed over (its CRCs are read)."""
        first = self.path / TIER_RANK_DIR.format(rank=0)
        if first.is_dir():
            return _newest_group_slot(self.path, newer_than)
        slots = self.store.checkpoints()
        if not slots or slots[0].step is None or not _newer(slots[0].step, newer_than):
            return None
        slot = self.store.newest_intact()
        if slot is None or slot.step is None or not _newer(slot.step, newer_than):
            return None
        return _meta_of(slot), [slot.path / name for name in slot.manifest["files"]], \
            slot.manifest.get("time")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _newest_group_slot(root: Path, newer_than: int | None) -> _Slot | None:
    """A group's newest step past ``newer_than`` that every rank holds intact, as one
    checkpoint: rank 0's state and meta, every other rank's rank file."""
    first = CheckpointStore(root / TIER_RANK_DIR.format(rank=0))
    for slot in first.checkpoints():  # newest first
        if slot.step is None or not _newer(slot.step, newer_than):
            return None
        if first.verify(slot.path) is not None:
            continue
        world = int(slot.manifest.get("world_size") or 1)
        files = [slot.path / name for name in slot.manifest["files"]]
        for rank in range(1, world):
            rank_store = CheckpointStore(root / TIER_RANK_DIR.format(rank=rank))
            part = _intact_at(rank_store, slot.step)
            if part is None:
                break
            files.extend(part.path / name for name in part.manifest["files"])
        else:
            return _meta_of(slot), files, slot.manifest.get("time")
    return None


def _intact_at(store: CheckpointStore, step: int) -> CheckpointInfo | None:
    if not store.root.is_dir():
        return None
    for slot in store.checkpoints():
        if slot.step == step and store.verify(slot.path) is None:
            return slot
    return None


def _newer(step: int, than: int | None) -> bool:
    return than is None or step > than


def _meta_of(slot: CheckpointInfo) -> dict[str, Any]:
    return {k: v for k, v in slot.manifest.items() if k not in _STORE_KEYS}


@contextlib.contextmanager
def memory_tier(enabled: bool, engine: str) -> Iterator[LauncherTier | None]:
    """The run's tier while the run lasts (None where there is none: said once why)."""
    if not enabled:
        yield None
        return
    if engine != "hooks":
        logger.info("memory tier: not with the %s engine (it images the whole process)", engine)
        yield None
        return
    root = Path(os.environ.get(ENV_TIER_ROOT) or DEFAULT_ROOT)
    if not root.is_dir() or fs_type(root) not in MEMORY_FS_TYPES:
        logger.warning("memory tier: off, %s is not a memory file system (tmpfs); a crash "
                       "resumes from the newest checkpoint (set %s to a tmpfs directory, or "
                       "pass --no-memory-tier to say so)", root, ENV_TIER_ROOT)
        yield None
        return
    sweep_dead(root, _PREFIX)
    try:
        path = make_owned_dir(root, _PREFIX)
    except OSError as e:
        logger.warning("memory tier: off, cannot make a directory in %s (%s)", root,
                       e.strerror or e)
        yield None
        return
    tier = LauncherTier(path)
    try:
        yield tier
    finally:
        tier.remove()
