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
from typing import Any

__all__ = ["SLOTS", "slot_files", "slot_pickle", "read_slot", "slots_newest_first"]

#: Slots per directory: the one being written and the newest complete one.
SLOTS = 2


def slot_files(root: Path, index: int) -> tuple[Path, Path, Path]:
    """Slot ``index``'s data, skeleton and manifest files in ``root``."""
    return (root / f"slot-{index}.data", root / f"slot-{index}.pt", root / f"slot-{index}.json")


def slot_pickle(root: Path, index: int) -> Path:
    """Slot ``index``'s ``data.pkl`` in ``root``."""
    return root / f"slot-{index}.pkl"


def read_slot(root: Path, index: int) -> dict[str, Any] | None:
    """Slot ``index``'s manifest if the slot is complete (its three files there, its records
    inside its data file), else None."""
    data, skeleton, manifest = slot_files(root, index)
    try:
        slot = json.loads(manifest.read_text())
        skeleton.stat()
        slot_pickle(root, index).stat()
        records = slot.get("records") if isinstance(slot, dict) else None
        size = data.stat().st_size if records else 0  # (a state without tensors has none)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(slot, dict) or not isinstance(slot.get("step"), int) \
            or not isinstance(slot.get("meta"), dict):
        return None
    if not isinstance(records, dict) or any(
            not isinstance(r, list) or len(r) != 2 or r[0] + r[1] > size
            for r in records.values()):
        return None
    return slot


def slots_newest_first(root: Path) -> list[tuple[int, dict[str, Any]]]:
    """The complete slots in ``root`` as (index, manifest), the newest step first."""
    found = [(i, slot) for i in range(SLOTS) if (slot := read_slot(root, i)) is not None]
    return sorted(found, key=lambda item: item[1]["step"], reverse=True)
