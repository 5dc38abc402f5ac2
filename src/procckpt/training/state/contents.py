"""What a value holds, as one CRC-32: the fingerprint the resume audit compares.

A batch can be any Python value: tensors in a tuple, a dict, a dataclass, an object of a graph
library whose attributes hold tensors, a set of strings, NumPy scalars, sparse or nested
tensors. Its fingerprint is taken over what it holds, not over its type: every tensor's dtype,
shape and bytes (a sparse tensor's indices and values, a nested tensor's components), every
plain value, the fields of dataclasses, attrs classes and named tuples, the attributes of
other objects (``__dict__``, ``__slots__``), an image's bytes (``tobytes()``).

Mappings and sets are fingerprinted independently of their iteration order (which for strings
follows the process's hash seed); sequences in their order. Where something cannot be looked
into (an object with no attributes and no bytes, a quantized tensor), :attr:`Contents.unseen`
names it, and a comparison of such a value proves nothing: the audit says ``unaudited``.

A tensor is read where it lies: one in host memory that fills its span (contiguous, or
permuted: a transpose, channels_last) as that span, any other (a slice with gaps, one on a GPU)
in pieces of at most :data:`PIECE` bytes copied through one host buffer, so that no copy of
the whole batch is ever made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import struct
import sys
import types
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...store.checksum import crc32

__all__ = ["Contents", "fingerprint", "plain_print", "PIECE"]

#: The largest piece of a strided or device tensor copied to the host at a time.
PIECE = 4 << 20
#: How deep into containers and attributes a fingerprint looks, and how many values it visits,
#: before it calls the rest unseen (a batch that holds its data set, say).
DEPTH, VALUES = 12, 100_000

_SPARSE = {torch.sparse_coo: "sparse", torch.sparse_csr: "sparse_csr",
           torch.sparse_csc: "sparse_csc", torch.sparse_bsr: "sparse_bsr",
           torch.sparse_bsc: "sparse_bsc"}


@dataclass(frozen=True)
class Contents:
    """A value's fingerprint: ``crc`` over what it holds, ``what`` in words ("2 tensors: 8x3
    float32, 8 int64"), and ``unseen``: what could not be looked into (None when nothing)."""

    crc: int
    what: str
    unseen: str | None = None


def fingerprint(value: Any) -> Contents:
    """The fingerprint of ``value``; never raises (a failure is reported as unseen)."""
    hasher = _Hasher()
    try:
        crc = hasher.value(value, 0, 0)
    except Exception as e:  # the audit must never fail the training it observes
        return Contents(0, "", f"its fingerprint failed ({type(e).__name__}: {e})")
    shapes = hasher.shapes
    shown = ", ".join(shapes[:3]) + (", ..." if len(shapes) > 3 else "")
    what = (f"{len(shapes)} tensor{'s' if len(shapes) != 1 else ''}: {shown}" if shapes
            else "no tensors")
    unseen = None
    if hasher.unseen:
        names = sorted(set(hasher.unseen))
        unseen = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return Contents(crc, what, unseen)


def plain_print(t: torch.Tensor) -> int:
    """``fingerprint(t).crc`` of one tensor, without the walk: where ``t`` is a plain
    contiguous tensor in host memory, straight from its bytes (a restore takes it while a copy
    is still in the cache: mapped.py)."""
    if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_nested
            or not t.is_contiguous() or t.is_conj() or t.is_neg()
            or callable(getattr(t, "to_local", None))):
        return fingerprint(t).crc
    return crc32(t.detach().reshape(-1).view(torch.uint8).numpy(), _header(t, 0))


def _header(t: torch.Tensor, crc: int) -> int:
    """What a dense tensor's fingerprint takes before its bytes: its dtype and shape."""
    return zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)


class _Hasher:
    def __init__(self) -> None:
        self.shapes: list[str] = []
        self.unseen: list[str] = []
        self._visited = 0
        self._open: set[int] = set()  # containers being fingerprinted: a cycle comes back
        self._buffer: torch.Tensor | None = None

    def value(self, value: Any, crc: int, depth: int) -> int:
        self._visited += 1
        if isinstance(value, torch.Tensor):
            return self.tensor(value, crc)
        if isinstance(value, (bytes, bytearray)):  # (an encoded image: its bytes, no repr)
            return crc32(value, zlib.crc32(f"bytes{len(value)}".encode(), crc))
        if value is None or isinstance(value, (str, bool, int, float, complex)):
            return zlib.crc32(repr(value).encode(), crc)
        if isinstance(value, enum.Enum):
            return zlib.crc32(f"{type(value).__qualname__}.{value.name}".encode(), crc)
        np = sys.modules.get("numpy")
        if np is not None and isinstance(value, (np.ndarray, np.generic)):
            return self.array(np, value, crc)
        if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType,
                              types.MethodType, types.ModuleType)):
            name = getattr(value, "__qualname__", None) or getattr(value, "__name__", "")
            return zlib.crc32(f"{type(value).__name__}:{name}".encode(), crc)
        if depth >= DEPTH or self._visited > VALUES:
            self.unseen.append(f"{type(value).__qualname__} (nested too deep)")
            return zlib.crc32(b"<deep>", crc)
        if id(value) in self._open:
            return zlib.crc32(b"<cycle>", crc)
        self._open.add(id(value))
        try:
            return self.container(value, crc, depth + 1)
        finally:
            self._open.discard(id(value))

    def container(self, value: Any, crc: int, depth: int) -> int:
        if isinstance(value, Mapping):  # a dict, a BatchEncoding
            return self.unordered([(k, value[k]) for k in value], crc, depth, b"map")
        if isinstance(value, (list, tuple)):
            for item in value:
                crc = self.value(item, crc, depth)
            return zlib.crc32(str(len(value)).encode(), crc)
        if isinstance(value, (set, frozenset)):
            return self.unordered([(item, None) for item in value], crc, depth, b"set")
        kind = zlib.crc32(type(value).__qualname__.encode(), crc)
        if dataclasses.is_dataclass(value):
            fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
            return self.unordered(fields, kind, depth, b"fields")
        attrs = getattr(type(value), "__attrs_attrs__", None)
        if attrs is not None:
            return self.unordered([(a.name, getattr(value, a.name)) for a in attrs], kind,
                                  depth, b"fields")
        tobytes = getattr(value, "tobytes", None)
        if callable(tobytes):  # an image, an array of another library
            with contextlib.suppress(Exception):  # then another way to look
                data = tobytes()
                if isinstance(data, (bytes, bytearray, memoryview)):
                    return crc32(data, zlib.crc32(_describe(value).encode(), kind))
        held = _attributes(value)
        if held:
            return self.unordered(list(held.items()), kind, depth, b"fields")
        if hasattr(value, "__iter__") and hasattr(value, "__len__"):  # a sequence of its own
            with contextlib.suppress(Exception):  # then another way to look
                return self.value(list(value), kind, depth)
        self.unseen.append(type(value).__qualname__)
        return kind

    def unordered(self, pairs: list[tuple[Any, Any]], crc: int, depth: int, tag: bytes) -> int:
        """Pairs (a key and its value) fingerprinted each on its own, then folded in the order
        of their fingerprints: the same whatever order they were iterated in."""
        each = sorted((self.value(k, 0, depth), self.value(v, 0, depth)) for k, v in pairs)
        packed = b"".join(struct.pack("<II", k, v) for k, v in each)
        return zlib.crc32(packed, zlib.crc32(tag, crc))

    def tensor(self, t: torch.Tensor, crc: int) -> int:
        local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
        t = (local() if callable(local) else t).detach()
        if t.is_nested:
            parts = t.unbind()
            self.shapes.append(f"nested {len(parts)} {_dtype(t)}")
            crc = zlib.crc32(f"nested{len(parts)}".encode(), crc)
            shapes, self.shapes = self.shapes, []
            for part in parts:
                crc = self.tensor(part, crc)
            self.shapes = shapes
            return crc
        sparse = _SPARSE.get(t.layout)
        if sparse is not None:
            self.shapes.append(f"{_shape(t)} {_dtype(t)} {sparse}")
            crc = zlib.crc32(f"{sparse}{t.dtype}{tuple(t.shape)}".encode(), crc)
            shapes, self.shapes = self.shapes, []
            for part in _sparse_parts(t):
                crc = self.tensor(part, crc)
            self.shapes = shapes
            return crc
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            self.unseen.append(f"a {t.layout} {t.dtype} tensor")
            return zlib.crc32(f"{t.layout}{t.dtype}{tuple(t.shape)}".encode(), crc)
        self.shapes.append(f"{_shape(t)} {_dtype(t)}")
        crc = _header(t, crc)
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if t.device.type == "cpu" and not t.is_contiguous() and _fills_its_span(t):
            # A permuted layout (a transpose, channels_last) fills its span of memory: that
            # span is read as it lies, with the strides that order it. The same code lays a
            # batch out the same way in the interrupted run and in the resumed one.
            crc = zlib.crc32(str(t.stride()).encode(), crc)
            t = t.as_strided((t.numel(),), (1,))
        for piece in _pieces(t, PIECE // max(1, t.element_size())):
            crc = crc32(self.host_bytes(piece), crc)
        return crc

    def host_bytes(self, t: torch.Tensor) -> Any:
        """The bytes of ``t`` in its logical order: its own buffer where it is contiguous in
        host memory, else a copy into this fingerprint's one host buffer."""
        if t.device.type == "cpu" and t.is_contiguous():
            return t.reshape(-1).view(torch.uint8).numpy()
        nbytes = t.numel() * t.element_size()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        view = self._buffer[:nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        return self._buffer[:nbytes].numpy()

    def array(self, np: Any, value: Any, crc: int) -> int:
        array = np.asarray(value)
        if array.dtype.hasobject:  # an array of Python objects: their values
            self.shapes.append(f"{_shape(array)} object")
            return self.value(array.tolist(), zlib.crc32(b"objects", crc), 1)
        if isinstance(value, np.ndarray):
            self.shapes.append(f"{_shape(array)} {array.dtype}")
        crc = zlib.crc32(f"{array.dtype}{array.shape}".encode(), crc)
        data = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return crc32(data.reshape(-1).view(np.uint8), crc)


def _pieces(t: torch.Tensor, elements: int) -> list[torch.Tensor]:
    """``t`` as views along its leading dimensions, each of at most ``elements`` elements (or
    one element's row where a row is larger), in order."""
    if t.device.type == "cpu" and t.is_contiguous():
        return [t]
    if t.dim() == 0 or t.numel() <= elements:
        return [t]
    per_row = t.numel() // t.shape[0]
    if per_row > elements:
        return [piece for i in range(t.shape[0]) for piece in _pieces(t[i], elements)]
    rows = elements // per_row
    return [t[i:i + rows] for i in range(0, t.shape[0], rows)]


def _fills_its_span(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory with no gap and no overlap (a
    permutation of a contiguous tensor's dimensions)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def _attributes(value: Any) -> dict[str, Any]:
    """An object's own attributes: its ``__dict__`` and its ``__slots__``."""
    held: dict[str, Any] = {}
    for name, item in (getattr(value, "__dict__", None) or {}).items():
        held[name] = item
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                held[name] = getattr(value, name)
    return held


def _describe(value: Any) -> str:
    return f"{getattr(value, 'mode', '')}{getattr(value, 'size', '')}{getattr(value, 'shape', '')}"


def _shape(t: Any) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
