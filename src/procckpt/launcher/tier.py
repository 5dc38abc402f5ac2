"""The memory tier the launcher holds: the training's newest state, kept where a crash of the
training cannot take it (issue 55).

The launcher makes a directory on a memory file system (``/dev/shm``, or
``$PROCCKPT_MEMORY_TIER_ROOT``) and hands its path to the command. The training
(training/save/tier.py) keeps its state there every few steps in two slots, in turn
(protocol/slots.py): each slot's data file is the training's own host copy of the state, so a
slot is complete as soon as its copy is; one torn by a kill has no manifest and is passed over.
The launcher never maps the state while the training runs (its memory stays small). When a
cycle ends, the newest slot that is newer than the newest checkpoint of the run's store is
written into that store as a checkpoint like any other (its ``torch.save`` file made again
from the slot's skeleton and data), before any restart: the next cycle resumes from it
through the usual path, audit included. A lost launcher or node loses the tier; the store's
checkpoints remain.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import struct
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ProcckptError
from ..protocol.control import ENV_TIER, TIER_RANK_DIR
from ..protocol.events import append_event
from ..protocol.leftovers import make_owned_dir, sweep_dead
from ..protocol.slots import slot_files, slots_newest_first
from ..store import CheckpointInfo, CheckpointStore
from ..store.files import MEMORY_FS_TYPES, format_size, fs_type
from ..store.pending import PendingCheckpoint

__all__ = ["LauncherTier", "memory_tier", "ENV_TIER_ROOT", "DEFAULT_ROOT", "write_slot_file"]

logger = logging.getLogger(__name__)

#: Where the launcher makes its tier directory (a memory file system); a test seam too.
ENV_TIER_ROOT = "PROCCKPT_MEMORY_TIER_ROOT"
DEFAULT_ROOT = Path("/dev/shm")
_PREFIX = "procckpt-tier-"
#: A slot to keep, in each rank's directory: (directory, slot index, manifest).
_Part = tuple[Path, int, dict[str, Any]]
#: Records' bytes start at multiples of this in a file ``torch.save`` writes.
_ALIGN = 64
#: The extra field torch's zip writer pads its headers with (``FB``).
_PAD_FIELD = 0x4246


class LauncherTier:
    """One launcher's tier directory; :meth:`keep_newest` writes its newest slot to the
    store."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def env(self) -> dict[str, str]:
        return {ENV_TIER: str(self.path)}

    def keep_newest(self, store: CheckpointStore, cycle: int) -> CheckpointInfo | None:
        """Write the tier's newest complete slot into ``store`` if it is newer than the newest
        checkpoint there (a group's: the newest step every rank holds complete); the
        checkpoint made, or None. Never raises for the tier's sake: a failure here leaves
        the store as it was, and the run goes on from it."""
        try:
            held = store.checkpoints()
            newest = held[0].step if held else None
            parts = self._newest_slot(newest)
            if parts is None:
                return None
            meta = dict(parts[0][2]["meta"])
            started = time.monotonic()
            with store.begin(meta) as pending:
                for folder, index, slot in parts:
                    write_slot_file(pending, folder, index, slot)
                info = pending.commit()
            seconds = time.monotonic() - started
        except (OSError, ProcckptError, ValueError, KeyError, zipfile.BadZipFile) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            logger.warning("could not keep the memory tier's newest state in %s (%s); a "
                           "restart resumes from the newest checkpoint there", store.root, why)
            return None
        logger.info("kept step %s from the memory tier as checkpoint %s (%s in %.2fs)",
                    info.step, info.name, format_size(info.nbytes), seconds)
        append_event(store.events_path, "tier-kept", checkpoint=info.name, step=info.step,
                     epoch=info.epoch, batch=meta.get("batch"), bytes=info.nbytes,
                     seconds=round(seconds, 4), before=newest, cycle=cycle,
                     saved_at=parts[0][2].get("time"))
        store.prune()
        return info

    def _newest_slot(self, newer_than: int | None) -> list[_Part] | None:
        """The newest complete slot past ``newer_than``, in each rank's directory."""
        first = self.path / TIER_RANK_DIR.format(rank=0)
        if not first.is_dir():
            slots = slots_newest_first(self.path)
            if not slots or not _newer(slots[0][1]["step"], newer_than):
                return None
            index, slot = slots[0]
            return [(self.path, index, slot)]
        for index, slot in slots_newest_first(first):
            if not _newer(slot["step"], newer_than):
                return None
            parts = [(first, index, slot)]
            world = int(slot["meta"].get("world_size") or 1)
            for rank in range(1, world):
                folder = self.path / TIER_RANK_DIR.format(rank=rank)
                same = [(i, s) for i, s in slots_newest_first(folder)
                        if s["step"] == slot["step"]]
                if not same:
                    break
                parts.append((folder, *same[0]))
            else:
                return parts
        return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def write_slot_file(pending: PendingCheckpoint, folder: Path, index: int,
                    slot: dict[str, Any]) -> None:
    """Write slot ``index`` of ``folder`` into ``pending`` as the file ``torch.save`` would
    have written of its state: the skeleton's records in their order, the slot's
    ``data.pkl``, each storage's bytes from the slot's data file, at the alignment torch's
    own files have."""
    files = slot_files(folder, index)
    data_pkl = files.pickle.read_bytes()
    name = slot["name"]
    records: dict[str, list[int]] = slot["records"]
    with zipfile.ZipFile(files.skeleton) as source:
        entries = [(info, info.filename.split("/", 1)[-1]) for info in source.infolist()]
        if {record for _, record in entries if record.startswith("data/")} != set(records):
            raise ValueError(f"slot {index} in {folder}: its skeleton's storages are not its "
                             "records")
        mapped = _mapped(files.data)
        try:
            with open(pending.path / name, "xb") as target, \
                    zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
                for info, record in entries:
                    place = records.get(record)
                    body: bytes | memoryview
                    if record == "data.pkl":
                        body = data_pkl
                    elif place is None:
                        body = source.read(info)
                    elif mapped is None:  # (no data file: empty storages only)
                        body = b""
                    else:
                        body = memoryview(mapped)[place[0]:place[0] + place[1]]
                    _write_aligned(out, f"archive/{record}", body)
                    if isinstance(body, memoryview):
                        body.release()
        finally:
            if mapped is not None:
                with contextlib.suppress(BufferError):  # (a view an error left: GC closes it)
                    mapped.close()
    pending.add_file(name)


def _mapped(path: Path) -> mmap.mmap | None:
    """``path`` mapped read-only, None where it is empty or not there (a state of no tensor
    bytes has no data file)."""
    if not path.exists():
        return None
    with open(path, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        return mmap.mmap(raw.fileno(), size, prot=mmap.PROT_READ) if size else None


def _write_aligned(out: zipfile.ZipFile, name: str, body: Any) -> None:
    """One stored record whose bytes start at a multiple of :data:`_ALIGN` in the file."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = len(body)
    zip64 = info.file_size * 1.05 > zipfile.ZIP64_LIMIT  # (as zipfile decides it)
    assert out.fp is not None
    header = 30 + len(name.encode()) + (20 if zip64 else 0) + 4
    pad = -(out.fp.tell() + header) % _ALIGN
    info.extra = struct.pack("<HH", _PAD_FIELD, pad) + bytes(pad)
    with out.open(info, "w") as f:
        f.write(body)


def _newer(step: int, than: int | None) -> bool:
    return than is None or step > than


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
