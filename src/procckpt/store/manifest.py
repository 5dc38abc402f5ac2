"""What a checkpoint's manifest holds, and the checks a manifest read from disk must pass.

``MANIFEST.json`` is written last in a checkpoint: sizes and CRC-32 of every payload file,
and the engine's metadata (step, epoch, world size, DMTCP images).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import plain_name

__all__ = ["CheckpointInfo", "manifest_problem", "FORMAT_VERSION", "MANIFEST"]

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as its manifest describes it."""

    path: Path
    seq: int
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def step(self) -> int | None:
        return self.manifest.get("step")

    @property
    def epoch(self) -> int | None:
        return self.manifest.get("epoch")

    @property
    def nbytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.manifest.get("files", {}).values())

    @property
    def created(self) -> float:
        return float(self.manifest.get("time", 0.0))

    @property
    def metric(self) -> float | None:
        value = self.manifest.get("metric")
        return None if value is None else float(value)

    def file(self, name: str) -> Path:
        return self.path / name


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with the shape of a parsed manifest, or None: every field procckpt reads
    must have the type it expects, and every file must be a plain name in the checkpoint."""
    if not isinstance(manifest, dict):
        return "not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no files"
    for name, entry in files.items():
        if not plain_name(name) or name == MANIFEST:
            return f"file name {name!r} is not a plain name inside the checkpoint"
        if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
                and entry.get(k) >= 0 for k in ("bytes", "crc32")):
            return f"entry of {name!r} has no whole-number bytes and crc32"
    for key in ("step", "epoch", "batch", "seq", "world_size"):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{key} is {value!r}, not a whole number"
    dmtcp = manifest.get("dmtcp")
    if dmtcp is not None:
        images = dmtcp.get("images") if isinstance(dmtcp, dict) else None
        if not isinstance(images, list) or not all(n in files for n in images):
            return "its DMTCP images are not files of the checkpoint"
    for key in ("time", "metric", "write_seconds"):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"{key} is {value!r}, not a number"
    return None
