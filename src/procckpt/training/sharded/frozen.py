"""Frozen sharded parameters written once: a DCP checkpoint of their own, whose files are chunks.

A fine-tune of a frozen base under FSDP2 (or any DTensor layout) has most of its sharded
state in parameters with ``requires_grad=False``. A group checkpoint saves those apart from the
rest. When they are new or changed, every rank writes its shards of them with
``torch.distributed.checkpoint`` into ``FROZEN_DIR`` of the checkpoint's temporary directory,
and rank 0 moves each of those files into the chunk store (store/chunks.py), named by its
hash. The manifest maps the files to their chunks (``"frozen_shards"``) and lists the chunks
among its own, so keep-N, collection, verification and object storage treat them like any
chunk. A later checkpoint lists the same chunks and writes nothing of them. Loading links the
chunks into a temporary directory under their DCP names and DCP reads the set from there,
resharded to another world size like the rest of the sharded state.

**When the set is listed instead of written** (the rule of save/frozen.py, per rank; if any
rank sees a change, every rank writes the set again): each frozen entry is one this process
wrote or loaded, its local shard is the same memory (held here, so it cannot be reused), and
the DTensor's version counter has not moved. In-place operations on a DTensor parameter move
the DTensor's counter, shared with the detached copies a state dict holds (not its local
tensor's). Every :data:`~procckpt.training.save.frozen.VERIFY_EVERY`-th checkpoint each rank
hashes its local shards again, which catches writes the counter cannot see (``.data``):
those are then hashed at every checkpoint, with a warning. That hash runs at the checkpoint's
safe point, so it adds to that checkpoint's pause what reading the rank's frozen shards costs
(from the GPU, a copy to the host first); so does the first checkpoint after a resume.

The write of the set itself is synchronous even under ``async_save`` (it happens once per
run, or after a change); the rest of the sharded state is copied and written as before.
Only procckpt's own ``Sharded`` state takes part (a framework's sharded checkpoint, such as
Lightning's ``ModelParallelStrategy``, is written whole), and only parameters whose name in
``model.named_parameters()`` is their key in the model's state dict.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ...protocol.switches import FROZEN_ONCE
from ...store import CheckpointInfo, PendingCheckpoint
from ...store.chunks import ChunkStore, digest_of
from ...store.manifest import FROZEN_SHARDS
from ..save.frozen import MIN_BYTES, VERIFY_EVERY, bytes_of
from .dcp import load_sharded
from .files import save_dcp

__all__ = ["FrozenShards", "FrozenPart", "FROZEN_DIR", "split_frozen", "linked_set",
           "load_sharded_state"]

logger = logging.getLogger(__name__)

#: Where the ranks write the set inside the checkpoint's temporary directory.
FROZEN_DIR = "frozen-shards.tmp"

Key = tuple[str, str]  # (the Sharded stateful's name, the parameter's name)


def split_frozen(sharded: Mapping[str, Any], state: dict[str, Any],
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``state`` without the frozen parameters of the ``Sharded`` statefuls' models, those
    parameters as ``{name: {"model": {fqn: tensor}}}``). The same on every rank: it goes by
    names and global sizes. Nothing is split off below MIN_BYTES in all, or when
    ``PROCCKPT_FROZEN_ONCE=0``."""
    if not FROZEN_ONCE.read():
        return state, {}
    rest, frozen, total = dict(state), {}, 0
    for name, obj in sharded.items():
        model = getattr(obj, "model", None)
        entries = state.get(name)
        if getattr(obj, "procckpt_framework", False) or not isinstance(model, torch.nn.Module) \
                or not isinstance(entries, dict) or not isinstance(entries.get("model"), dict):
            continue
        names = {n for n, p in model.named_parameters() if not p.requires_grad}
        picked = {fqn: t for fqn, t in entries["model"].items()
                  if fqn in names and isinstance(t, torch.Tensor)}
        if picked:
            frozen[name] = {"model": picked}
            rest[name] = {**entries, "model": {k: v for k, v in entries["model"].items()
                                               if k not in picked}}
            total += sum(t.numel() * t.element_size() for t in picked.values())
    if total < MIN_BYTES:
        return state, {}
    return rest, frozen


def _entries(frozen: dict[str, Any]) -> Iterator[tuple[Key, torch.Tensor]]:
    for name, part in frozen.items():
        for fqn, tensor in part["model"].items():
            yield (name, fqn), tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else t


@dataclass
class _Held:
    """A frozen entry as this process wrote or loaded it."""

    tensor: torch.Tensor  # held: its memory cannot pass to another tensor meanwhile
    ptr: int
    version: int | None  # None: loaded, not yet seen by a checkpoint
    digest: str


@dataclass
class FrozenPart:
    """What one group checkpoint does with the frozen sharded parameters."""

    write: bool  # every rank wrote the set into FROZEN_DIR (else the last one is listed)
    held: dict[Key, _Held]  # this rank's entries as they are now: remembered once committed
    files: dict[str, tuple[str, int]] = field(default_factory=dict)  # rank 0: file -> chunk


class FrozenShards:
    """One rank's frozen sharded parameters, and the set that holds them."""

    verify_every = VERIFY_EVERY  # a seam for tests

    def __init__(self) -> None:
        self._held: dict[Key, _Held] | None = None
        #: Rank 0: the set's files (name -> (chunk id, bytes)) of the last checkpoint.
        self._files: dict[str, tuple[str, int]] | None = None
        self._untrusted = False  # found changed behind the counters: hashed every time
        self._plans = 0

    def prepare(self, frozen: dict[str, Any], tmp: Path, any_rank: Callable[[bool], list[int]],
                group: Any, chunks: ChunkStore | None) -> FrozenPart | None:
        """Collective: where any rank's ``frozen`` parameters (split off by
        :func:`split_frozen`) changed, write them as a set into ``tmp/FROZEN_DIR``. Returns
        the part to :meth:`commit` (rank 0) and then :meth:`durable` or :meth:`failed`
        (every rank); None when nothing is frozen. ``chunks``: rank 0's chunk store (None
        elsewhere)."""
        if not frozen:
            return None
        self._plans += 1
        verify = self.verify_every > 0 and self._plans % self.verify_every == 0
        changed, held = self._look(frozen, verify)
        if chunks is not None and (self._files is None or not all(
                chunks.has(cid, n) for cid, n in self._files.values())):
            changed = True  # rank 0 has no set to list
        part = FrozenPart(bool(any_rank(changed)), held)
        if part.write:
            save_dcp(frozen, tmp / FROZEN_DIR, group)
        return part

    def _look(self, frozen: dict[str, Any], verify: bool) -> tuple[bool, dict[Key, _Held]]:
        """(whether this rank's frozen entries changed since the set, their state now)."""
        before = self._held or {}
        now: dict[Key, _Held] = {}
        changed = set(before) != {key for key, _ in _entries(frozen)}
        for key, tensor in _entries(frozen):
            local = _local(tensor)
            ptr = local.data_ptr() if local.numel() else 0
            old = before.get(key)
            if (old is not None and not verify and not self._untrusted
                    and old.version == tensor._version and old.ptr == ptr):
                now[key] = old
                continue
            digest = digest_of(bytes_of(local))
            now[key] = _Held(tensor, ptr, tensor._version, digest)
            if old is None or old.digest != digest:
                changed = True
                if (old is not None and old.version == tensor._version and old.ptr == ptr
                        and not self._untrusted):
                    logger.warning(
                        "a frozen sharded parameter (%s) changed without its version counter "
                        "moving (a write through .data?); frozen parameters are hashed at "
                        "every checkpoint from now on", ".".join(key))
                    self._untrusted = True
        return changed, now

    def commit(self, pending: PendingCheckpoint, tmp: Path, part: FrozenPart) -> None:
        """Rank 0, before the commit: move the set just written into the chunk store, or
        list the chunks of the last one; either way the manifest maps the files."""
        if part.write:
            directory = tmp / FROZEN_DIR
            for path in sorted(directory.iterdir()):
                part.files[path.name] = pending.put_chunk_file(path)
            directory.rmdir()
        else:
            assert self._files is not None
            for chunk_id, nbytes in self._files.values():
                if not pending.list_chunk(chunk_id, nbytes):
                    raise FileNotFoundError(f"chunk {chunk_id} of the frozen sharded "
                                            "parameters left the store while in use")
            part.files = dict(self._files)
        pending.meta[FROZEN_SHARDS] = {name: cid for name, (cid, _) in part.files.items()}

    def durable(self, part: FrozenPart | None) -> None:
        """The checkpoint committed (on every rank): its set is the one to list next."""
        if part is not None:
            self._held = part.held
            self._files = part.files or self._files

    def failed(self) -> None:
        """The checkpoint was not committed: the next one writes the set again."""
        self._held, self._files = None, None

    def loaded(self, info: CheckpointInfo, frozen: dict[str, Any]) -> None:
        """The set of ``info`` was just loaded into ``frozen``'s tensors: remember it, so
        that the next checkpoint lists it if nothing changed (hashed then, once)."""
        self._held = {key: _Held(tensor, -1, None, digest_of(bytes_of(_local(tensor))))
                      for key, tensor in _entries(frozen)}
        self._files = {name: (cid, info.chunks[cid]) for name, cid in info.frozen_shards.items()}


@contextlib.contextmanager
def linked_set(info: CheckpointInfo, scratch: Path) -> Iterator[Path]:
    """The frozen set of ``info`` as a DCP checkpoint directory: links to its chunks (checked
    when the checkpoint was verified) under their file names, in a temporary directory under
    ``scratch``, removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix=".tmp-frozen-", dir=scratch))
    try:
        store = info.chunk_store
        for name, chunk_id in info.frozen_shards.items():
            os.symlink(store.path(chunk_id), directory / name)
        yield directory
    finally:
        for p in directory.iterdir():
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()


def load_sharded_state(statefuls: Mapping[str, Any], info: CheckpointInfo,
                       use_group: bool) -> dict[str, Any] | None:
    """Load the sharded state of ``info`` (:func:`~.sharded.load_sharded`), its frozen set
    too if it has one; return the frozen parameters as loaded, or None."""
    names = list(info.manifest.get("sharded") or [])
    if not info.frozen_shards:
        return load_sharded(statefuls, info.path, names, use_group)
    with linked_set(info, info.path.parent.parent) as directory:  # the checkpoint dir
        return load_sharded(statefuls, info.path, names, use_group, frozen_set=directory)
