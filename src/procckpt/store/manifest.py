"""What a checkpoint's manifest holds, and the checks a manifest read from disk must pass.

``MANIFEST.json`` is written last in a checkpoint: sizes and CRC-32 of every payload file,
the chunks it shares with other checkpoints (see chunks.py) and how many bytes writing it
took, and the engine's metadata (step, epoch, world size, DMTCP images).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chunks import ChunkStore, chunk_id_problem
from .files import plain_name

__all__ = ["CheckpointInfo", "manifest_problem", "FORMAT_VERSION", "CHUNKED_FORMAT",
           "READABLE_FORMATS", "MANIFEST", "FROZEN_SHARDS"]

FORMAT_VERSION = 1
#: The format of a checkpoint that lists chunks: an older procckpt refuses it (it would
#: load the placeholders that stand for the chunks' tensors) instead of misreading it.
CHUNKED_FORMAT = 2
READABLE_FORMATS = (FORMAT_VERSION, CHUNKED_FORMAT)
MANIFEST = "MANIFEST.json"
#: The manifest's map of the frozen sharded parameters' DCP files to the chunks that hold them
#: (training/sharded/frozen.py).
FROZEN_SHARDS = "frozen_shards"


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
        """The state's size: its files and the chunks it lists (written now or earlier)."""
        return (sum(int(f["bytes"]) for f in self.manifest.get("files", {}).values())
                + sum(self.chunks.values()))

    @property
    def chunks(self) -> dict[str, int]:
        """The chunks the checkpoint lists (see chunks.py), by id, with their sizes."""
        return dict(self.manifest.get("chunks") or {})

    @property
    def chunk_store(self) -> ChunkStore:
        """The chunk store of the dir the checkpoint is in (``DIR/checkpoints/ckpt-N``)."""
        return ChunkStore(self.path.parent.parent / "chunks")

    @property
    def frozen_shards(self) -> dict[str, str]:
        """The DCP files of the frozen sharded parameters, by name, with their chunk ids."""
        return dict(self.manifest.get(FROZEN_SHARDS) or {})

    @property
    def written(self) -> int:
        """Bytes that writing this checkpoint wrote (chunks already stored are not)."""
        value = self.manifest.get("written")
        return self.nbytes if value is None else int(value)

    @property
    def created(self) -> float:
        return float(self.manifest.get("time", 0.0))

    @property
    def metric(self) -> float | None:
        value = self.manifest.get("metric")
        return None if value is None else float(value)

    def file(self, name: str) -> Path:
        return self.path / name


def manifest_problem(manifest: Any) -> str | None:  # noqa: C901 (one independent check per field)
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
                isinstance(value := entry.get(k), int) and not isinstance(value, bool)
                and value >= 0 for k in ("bytes", "crc32")):
            return f"entry of {name!r} has no whole-number bytes and crc32"
    chunks = manifest.get("chunks")
    if chunks is not None:
        if not isinstance(chunks, dict):
            return "its chunks are not an object"
        for chunk_id, nbytes in chunks.items():
            problem = chunk_id_problem(chunk_id)
            if problem is not None:
                return problem
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                return f"chunk {chunk_id} has no whole-number size"
    frozen = manifest.get(FROZEN_SHARDS)
    if frozen is not None:
        if not isinstance(frozen, dict) or not frozen:
            return f"its {FROZEN_SHARDS} is not an object of files"
        for name, chunk_id in frozen.items():
            if not plain_name(name) or chunk_id not in (chunks or {}):
                return f"{FROZEN_SHARDS} entry {name!r} names no chunk the manifest lists"
    for key in ("step", "epoch", "batch", "seq", "world_size", "written"):
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
