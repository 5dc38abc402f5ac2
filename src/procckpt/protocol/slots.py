"""The memory tier's slots, as the training writes them (training/save/tier.py) and the launcher
reads them (launcher/tier.py): two per directory (a group's ranks: one directory each),
written in turn, so that one is complete while the other is written.

Slot ``N`` is four files:

    slot-N.data   the state's tensor bytes: the training's host arena itself, a file of the
                  memory file system that the training maps, so the copy at a safe point is
                  the whole write
    slot-N.pt     ``torch.save``'s file of a state of the same layout with every storage's
                  bytes left out (``torch.serialization.skip_data``: holes), a few KB;
                  written again only when the layout changes
    slot-N.pkl    this slot's ``data.pkl``, as ``torch.save`` would write it
    slot-N.json   the manifest, renamed into place last: the step, the checkpoint's meta, and
                  for each storage record (``data/<key>``) where its bytes are in slot-N.data

The training removes slot-N.json before it copies into slot-N.data: a slot that a kill tore has
no manifest and is passed over. The launcher makes a checkpoint of the newest one by writing
slot-N.pt again with slot-N.pkl as its ``data.pkl`` and each storage record's bytes taken from
slot-N.data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["SLOTS", "SlotFiles", "slot_files", "read_slot", "slots_newest_first"]

#: Slots per directory: the one being written and the newest complete one.
SLOTS = 2


class SlotFiles(NamedTuple):
    """A slot's four files (see the module)."""

    data: Path
    skeleton: Path
    pickle: Path
    manifest: Path


def slot_files(root: Path, index: int) -> SlotFiles:
    """Slot ``index``'s files in ``root``."""
    stem = root / f"slot-{index}"
    return SlotFiles(*(stem.with_suffix(suffix) for suffix in (".data", ".pt", ".pkl", ".json")))


def read_slot(root: Path, index: int) -> dict[str, Any] | None:
    """Slot ``index``'s manifest if the slot is complete (its files there, its records inside
    its data file), else None."""
    files = slot_files(root, index)
    try:
        slot = json.loads(files.manifest.read_text())
        files.skeleton.stat()
        files.pickle.stat()
    except (OSError, ValueError):
        return None
    if not isinstance(slot, dict) or not isinstance(slot.get("step"), int) \
            or not isinstance(slot.get("meta"), dict) \
            or not isinstance(records := slot.get("records"), dict):
        return None
    try:
        size = files.data.stat().st_size
    except FileNotFoundError:  # (a state of no tensor bytes has no data file)
        size = 0
    except OSError:
        return None
    if any(not isinstance(r, list) or len(r) != 2 or r[0] + r[1] > size
           for r in records.values()):
        return None
    return slot


def slots_newest_first(root: Path) -> list[tuple[int, dict[str, Any]]]:
    """The complete slots in ``root`` as (index, manifest), the newest step first."""
    found = [(i, slot) for i in range(SLOTS) if (slot := read_slot(root, i)) is not None]
    return sorted(found, key=lambda item: item[1]["step"], reverse=True)
