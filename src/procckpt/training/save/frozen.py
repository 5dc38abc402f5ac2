"""Frozen weights written once: parameters that do not train go to the chunk store.

They are not written into every ``state.pt``.

A fine-tune of a frozen base (LoRA, adapters, a frozen encoder) has most of its bytes in
parameters with ``requires_grad=False``. Each of those (64 KiB or more) is stored as a chunk
named by its hash (store/chunks.py) and ``state.pt`` holds a small placeholder in its place::

    {"procckpt_chunk": "blake3:<hex>", "dtype": "bfloat16", "shape": [4096, 4096]}

A chunk the store has already is not written again, and reading the checkpoint
(:func:`resolve_chunks`) puts the tensors back, each checked against its hash.

**When a frozen tensor is not even copied or hashed.** The rule: a frozen parameter is taken
as unchanged since the checkpoint that stored it, and only referenced, when all of these hold:
this process stored it; its storage is the same memory (same address and size; procckpt holds
a reference to the parameter, so the address cannot pass to another tensor); and its version
counter (``param._version``) has not moved. PyTorch moves that counter on every in-place
operation on the tensor or on a view of it (``add_``, ``copy_``, ``load_state_dict``, an
optimizer step, under ``no_grad`` too), so such a change is never skipped. What the counter
cannot see: writes through ``param.data`` (a new counter), through memory shared with NumPy
or another library, or by a kernel given the raw pointer. For those, every
:data:`VERIFY_EVERY`-th checkpoint hashes every frozen tensor again: one found changed is
written, a warning names it, and it is hashed at every checkpoint from then on. The first
checkpoint of each process hashes everything (the store still writes only what it lacks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ...store.chunks import ChunkStore
from ...store.pending import PendingCheckpoint

__all__ = ["FrozenChunks", "ChunkPlan", "resolve_chunks", "bytes_of", "PLACEHOLDER",
           "MIN_BYTES", "VERIFY_EVERY"]

logger = logging.getLogger(__name__)

#: The key that marks a placeholder in ``state.pt``.
PLACEHOLDER = "procckpt_chunk"
#: Frozen tensors smaller than this stay in ``state.pt`` (a chunk file each would cost more).
MIN_BYTES = 64 << 10
#: Every this many checkpoints, frozen tensors are hashed again whatever their counters say.
VERIFY_EVERY = 8

Path_ = tuple[Any, ...]


@dataclass
class _Stored:
    """A frozen parameter this process stored, as it was then."""

    param: torch.Tensor  # held: its memory cannot be reused by another tensor meanwhile
    version: int
    chunk_id: str
    nbytes: int


@dataclass
class _Candidate:
    """A frozen tensor to hash (and write if new) in this checkpoint."""

    param: torch.Tensor
    version: int
    nbytes: int


@dataclass
class ChunkPlan:
    """What one checkpoint does with the frozen tensors of its state: made on the training
    thread at the checkpoint's moment; :meth:`write` then runs wherever the state is written
    (on a copy of it, the background writer's)."""

    payload: Any
    owner: FrozenChunks | None = None
    #: Tensors referenced without a copy, by the chunk that holds them.
    referenced: dict[str, int] = field(default_factory=dict)
    #: Tensors to hash and store, by their path in the payload.
    candidates: dict[Path_, _Candidate] = field(default_factory=dict)
    _written: dict[Path_, str] = field(default_factory=dict)

    def write(self, pending: PendingCheckpoint, payload: Any) -> Any:
        """Store this plan's chunks for ``pending``; return ``payload`` (the state as planned,
        or a copy of it) with placeholders in place of the chunked tensors."""
        for chunk_id, nbytes in self.referenced.items():
            if not pending.list_chunk(chunk_id, nbytes):
                raise FileNotFoundError(f"chunk {chunk_id} left the store while in use")
        replacements = {}
        for path, candidate in self.candidates.items():
            tensor = _at(payload, path)
            chunk_id = pending.put_chunk(bytes_of(tensor))
            self._written[path] = chunk_id
            replacements[path] = _placeholder(chunk_id, tensor)
        return _replaced(payload, replacements) if replacements else payload

    def durable(self) -> None:
        """The checkpoint committed: remember what it stored."""
        if self.owner is not None:
            self.owner.stored(self)

    def failed(self) -> None:
        """The checkpoint was not committed: trust nothing this process stored before."""
        if self.owner is not None:
            self.owner.forget()


class FrozenChunks:
    """The frozen parameters of a process's modules, and which of them it stored as chunks."""

    verify_every = VERIFY_EVERY  # a seam for tests

    def __init__(self, modules: Callable[[], list[torch.nn.Module]], chunks: ChunkStore) -> None:
        self._modules = modules
        self._chunks = chunks
        self._stored: dict[int, _Stored] = {}
        #: Storages found changed behind their version counter: hashed at every checkpoint.
        self._untrusted: set[int] = set()
        self._plans = 0

    def plan(self, payload: Any) -> ChunkPlan:
        """Decide, for the state of this checkpoint, which frozen tensors are referenced,
        which are hashed and stored, and which stay in ``state.pt``."""
        frozen = {p.untyped_storage().data_ptr(): p for m in self._modules()
                  for p in m.parameters()
                  if not p.requires_grad and type(p.data) is torch.Tensor}  # no DTensor
        if not frozen:
            return ChunkPlan(payload)
        self._plans += 1
        verify = self.verify_every > 0 and self._plans % self.verify_every == 0
        plan = ChunkPlan(payload, self)
        replacements = {}
        for path, tensor in _tensors_with_paths(payload):
            ptr = tensor.untyped_storage().data_ptr()
            param = frozen.get(ptr)
            if param is None or not _whole(tensor) or _nbytes(tensor) < MIN_BYTES:
                continue
            nbytes = _nbytes(tensor)
            stored = self._stored.get(ptr)
            if (stored is not None and not verify and ptr not in self._untrusted
                    and stored.param is param and stored.version == param._version
                    and stored.nbytes == nbytes
                    and param.untyped_storage().data_ptr() == ptr
                    and self._chunks.has(stored.chunk_id, nbytes)):
                plan.referenced[stored.chunk_id] = nbytes
                replacements[path] = _placeholder(stored.chunk_id, tensor)
            else:
                plan.candidates[path] = _Candidate(param, param._version, nbytes)
        if replacements:
            plan.payload = _replaced(payload, replacements)
        return plan

    def stored(self, plan: ChunkPlan) -> None:
        for path, chunk_id in plan._written.items():
            candidate = plan.candidates[path]
            ptr = candidate.param.untyped_storage().data_ptr()
            before = self._stored.get(ptr)
            if (before is not None and before.param is candidate.param
                    and before.version == candidate.version and before.chunk_id != chunk_id
                    and ptr not in self._untrusted):
                logger.warning(
                    "a frozen parameter (%s, %s) changed without its version counter moving "
                    "(a write through .data, or shared memory?); it is hashed at every "
                    "checkpoint from now on", path_name(path), tuple(candidate.param.shape))
                self._untrusted.add(ptr)
            self._stored[ptr] = _Stored(candidate.param, candidate.version, chunk_id,
                                        candidate.nbytes)

    def forget(self) -> None:
        self._stored.clear()


def path_name(path: Path_) -> str:
    return ".".join(str(p) for p in path[1:]) if path and path[0] == "statefuls" else \
        ".".join(map(str, path))


def resolve_chunks(payload: Any, chunks: ChunkStore, listed: dict[str, int]) -> Any:
    """``payload`` with each placeholder replaced by its tensor, read from ``chunks`` (in
    parallel) and checked against its hash; a chunk that two placeholders name is read once.

    Raises:
        ChunkDamaged: a chunk is missing, or its bytes do not match its name.
        CheckpointReadError: a chunk could not be read.
        ValueError: a placeholder names a chunk the manifest does not list.
    """
    places = list(_placeholders(payload))
    if not places:
        return payload
    wanted: dict[str, int] = {}
    for _, ph in places:
        chunk_id = ph[PLACEHOLDER]
        if chunk_id not in listed:
            raise ValueError(f"state.pt names chunk {chunk_id}, which its manifest does not list")
        wanted[chunk_id] = listed[chunk_id]
    buffers = {cid: torch.empty(n, dtype=torch.uint8) for cid, n in wanted.items()}
    with ThreadPoolExecutor(max_workers=min(8, len(buffers))) as pool:
        for future in [pool.submit(chunks.read_into, cid, buf.numpy().data)
                       for cid, buf in buffers.items()]:
            future.result()
    replacements = {}
    for path, ph in places:
        dtype = getattr(torch, str(ph["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a placeholder in state.pt has dtype {ph['dtype']!r}")
        raw = buffers[ph[PLACEHOLDER]]
        replacements[path] = raw.view(dtype).reshape([int(n) for n in ph["shape"]])
    return _replaced(payload, replacements)


# -- the payload's structure -----------------------------------------------------------------
def _tensors_with_paths(obj: Any, path: Path_ = ()) -> Iterator[tuple[Path_, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, value in obj.items():
            yield from _tensors_with_paths(value, (*path, k))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, value in enumerate(obj):
            yield from _tensors_with_paths(value, (*path, i))


def _placeholders(obj: Any, path: Path_ = ()) -> Iterator[tuple[Path_, dict[str, Any]]]:
    if isinstance(obj, dict):
        if isinstance(obj.get(PLACEHOLDER), str):
            yield path, obj
            return
        for k, value in obj.items():
            yield from _placeholders(value, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _placeholders(value, (*path, i))


def _at(obj: Any, path: Path_) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _replaced(obj: Any, replacements: dict[Path_, Any], path: Path_ = ()) -> Any:
    """``obj`` with the values at ``replacements``' paths replaced; containers on the way
    are new (the caller's are left as they were), the rest is shared."""
    if path in replacements:
        return replacements[path]
    depth = len(path)
    below = {p for p in replacements if len(p) > depth and p[:depth] == path}
    if not below:
        return obj
    if isinstance(obj, dict):
        new = obj.copy()  # keeps the type (an OrderedDict, with state_dict's _metadata)
        if hasattr(obj, "_metadata"):
            new._metadata = obj._metadata  # type: ignore[attr-defined]
        for k in {p[depth] for p in below}:
            new[k] = _replaced(obj[k], replacements, (*path, k))
        return new
    items = [_replaced(v, replacements, (*path, i)) for i, v in enumerate(obj)]
    return items if isinstance(obj, list) else tuple(items)


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is exactly its storage, contiguous (a chunk holds one storage)."""
    return (t.layout == torch.strided and t.is_contiguous() and t.storage_offset() == 0
            and _nbytes(t) == t.untyped_storage().nbytes())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.numpy().data


def _placeholder(chunk_id: str, t: torch.Tensor) -> dict[str, Any]:
    return {PLACEHOLDER: chunk_id, "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}
