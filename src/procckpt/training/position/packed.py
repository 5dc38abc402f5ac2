"""A shuffle buffer's samples packed into one ``bytes``, for a state sent at every batch.

torchdata's StatefulDataLoader asks each worker for its data set's state after every batch
and sends what changed since the last one to the main process with multiprocessing's
pickler, which moves every tensor into a shared-memory segment of its own and passes its file
descriptor over a socket. A buffer of 256 samples of three tensors each cost 63 ms a batch
that way (loading the batch took 6 ms of CPU).

Packed, the buffer is one ``bytes`` and a skeleton per sample (the sample with each tensor
replaced by its dtype, shape and place in the sample's bytes), pickled inline. Each sample is
packed once, as it enters the buffer; samples of one shape share one skeleton object, which
the pickler writes once. (A slot per sample, for torchdata to send only the refilled ones,
was measured too: its per-key work in both processes cost more than the bytes it saved, at
this size.) The state holds only bytes, lists, dicts, strings and numbers, so a checkpoint
holding it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Packed", "pack", "pack_all", "unpack_all", "is_packed"]

#: What a packed buffer says it is.
_KIND = "procckpt.packed-samples"
#: A skeleton's tensor: {_TENSOR: [dtype, shape, offset, bytes]}.
_TENSOR = "procckpt.packed-tensor"
#: One skeleton object for all samples of a shape (by its text).
_SHARED: dict[str, Any] = {}
_SHARED_MOST = 4096

Packed = tuple[Any, bytes]  # (skeleton, the sample's tensors' bytes)


def pack(sample: Any) -> Packed:
    """One sample as its skeleton and its tensors' bytes."""
    chunks: list[bytes] = []
    size = 0

    def walk(value: Any) -> Any:
        nonlocal size
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" \
                and value.layout == torch.strided and not value.is_quantized:
            flat = value.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes()
            chunks.append(raw)
            size += len(raw)
            return {_TENSOR: [str(value.dtype).removeprefix("torch."), list(value.shape),
                              size - len(raw), len(raw)]}
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if type(value) is list:
            return [walk(v) for v in value]
        if type(value) is tuple:
            return tuple(walk(v) for v in value)
        return value  # a number, a string, or a tensor kept as it is (sparse, on a device)

    skeleton = walk(sample)
    skeleton = _SHARED.setdefault(repr(skeleton), skeleton)
    if len(_SHARED) > _SHARED_MOST:  # samples of many shapes, or with their own strings
        _SHARED.clear()
    return skeleton, b"".join(chunks)


def pack_all(samples: list[Packed]) -> dict[str, Any]:
    """Packed samples as one state: their skeletons, byte counts and bytes."""
    return {"kind": _KIND, "skeletons": [s for s, _ in samples],
            "sizes": [len(d) for _, d in samples],
            # None, not b"": torch.save writes an empty bytes as a call that
            # torch.load(weights_only=True) refuses.
            "data": b"".join(d for _, d in samples) or None}


def is_packed(state: Any) -> bool:
    return isinstance(state, dict) and state.get("kind") == _KIND


def unpack_all(state: dict[str, Any]) -> list[tuple[Any, Packed]]:
    """The samples of :func:`pack_all`'s state, each with its packed form."""
    out, start = [], 0
    data: bytes = state["data"] or b""
    for skeleton, n in zip(state["skeletons"], state["sizes"]):
        own = data[start:start + n]
        start += n
        raw = torch.frombuffer(bytearray(own), dtype=torch.uint8) if n \
            else torch.empty(0, dtype=torch.uint8)
        out.append((_rebuilt(skeleton, raw), (skeleton, own)))
    return out


def _rebuilt(skeleton: Any, data: torch.Tensor) -> Any:
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton and len(skeleton) == 1:
            dtype, shape, offset, n = skeleton[_TENSOR]
            raw = data[offset:offset + n].clone()  # its own storage, aligned for the view
            return raw.view(getattr(torch, dtype)).reshape(shape)
        return {k: _rebuilt(v, data) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_rebuilt(v, data) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_rebuilt(v, data) for v in skeleton)
    return skeleton
