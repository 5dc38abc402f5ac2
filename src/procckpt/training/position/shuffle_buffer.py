"""A stream shuffled through a buffer that is part of its state, so that a resume is exact.

A streamed data set cannot be permuted as a whole; it is shuffled by holding ``size`` samples
and handing out one of them at random as each new one arrives (Hugging Face's
``IterableDataset.shuffle(buffer_size=...)``, webdataset's ``shuffle``). Their
``state_dict()`` keeps the stream's position but not the buffer, so a resumed run refills it
from later samples and trains on another order (and ``datasets`` 5.2 fails to load such a
state under ``StatefulDataLoader``). Here the buffer's samples and its random stream are in
``state_dict()``: a resumed run hands out the same samples in the same order, and reads only
from where the stream stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ...errors import ProcckptError
from .packed import Packed, is_packed, pack, pack_all, unpack_all

__all__ = ["ShuffleBuffer"]

#: What ``state_dict()`` says it is, so that another data set's state is not taken for it.
_KIND = "procckpt.ShuffleBuffer"


class ShuffleBuffer(IterableDataset):
    """Shuffle ``source`` through a buffer of ``size`` samples kept in the state::

        stream = load_dataset("json", data_files=files, split="train", streaming=True)
        data = procckpt.ShuffleBuffer(stream.map(tokenize), size=10_000, seed=0)
        loader = StatefulDataLoader(data, batch_size=32, num_workers=2)
        for epoch in ckpt.epochs(n):
            data.set_epoch(epoch)
            for batch in ckpt.batches(loader): ...

    ``source`` is an iterable data set with ``state_dict()``/``load_state_dict()`` (a Hugging
    Face streaming data set, a sharded reader of your own); ``set_epoch()`` is passed on to it.
    Each epoch, and each DataLoader worker, draws its own order from ``seed``. With worker
    processes, load it with torchdata's ``StatefulDataLoader``, which collects each worker's
    state. The buffer travels with every state the workers report (each batch, by default),
    packed into one ``bytes`` (packed.py): with a buffer of large samples (hundreds of MB a
    worker), raise ``snapshot_every_n_steps``.
    """

    def __init__(self, source: Iterable[Any], size: int, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"a shuffle buffer holds at least one sample, not {size}")
        self.source, self.size, self.seed = source, size, seed
        self.epoch = 0
        #: The buffer and random stream of the iteration in progress (what state_dict saves).
        self._buffer: list[Any] = []
        self._packed: list[Packed] = []  # the same samples, packed for the state
        self._generator: torch.Generator | None = None
        #: A loaded state, taken by the next iteration.
        self._restored: dict[str, Any] | None = None
        #: The loaded source state, until the source hands out its first sample since: a
        #: stream (Hugging Face's) takes a loaded state only when it begins reading.
        self._source_loaded: Any = None
        #: Whether the source ran out in this iteration: then the state holds no source
        #: state (None), the same however the run got there (a stream resumed at its end
        #: says it is at the end of its shard, one that read on says it is past it), and a
        #: resumed iteration only empties the buffer.
        self._source_ended = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        restored, self._restored = self._restored, None
        generator = torch.Generator()
        if restored is not None:
            held = restored["buffer"]
            if is_packed(held):
                pairs = unpack_all(held)
                self._buffer, self._packed = [s for s, _ in pairs], [p for _, p in pairs]
            else:  # a checkpoint of procckpt 0.x before the buffer was packed
                self._buffer, self._packed = list(held), [pack(s) for s in held]
            generator.set_state(_rng_tensor(restored["rng"]))
            self._source_loaded = restored["source"]
            self._source_ended = restored["source"] is None
        else:
            self._buffer, self._packed = [], []
            self._source_loaded = None
            self._source_ended = False
            generator.manual_seed(_seed(self.seed, self.epoch, _worker_id()))
        self._generator = generator
        return self._shuffled(self._buffer, self._packed, generator)

    def _shuffled(self, buffer: list[Any], packed: list[Packed],
                  generator: torch.Generator) -> Iterator[Any]:
        # The state is read between two samples handed out, when ``buffer`` holds what the
        # next ones are drawn from and the source is just past what went into it. ``packed``
        # holds the same samples packed (packed.py), each once, as it came in.
        for sample in () if self._source_ended else self.source:
            self._source_loaded = None
            if len(buffer) < self.size:
                buffer.append(sample)
                packed.append(pack(sample))
                continue
            i = int(torch.randint(self.size, (1,), generator=generator))
            out, buffer[i], packed[i] = buffer[i], sample, pack(sample)
            yield out
        self._source_ended = True
        while buffer:  # the stream ended: hand out the rest in a random order
            i = int(torch.randint(len(buffer), (1,), generator=generator))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            packed[i], packed[-1] = packed[-1], packed[i]
            packed.pop()
            yield buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        """The source's state, the samples in the buffer and the random stream, as they are
        after the last sample handed out."""
        if self._restored is not None:  # loaded, not yet iterated: still that state
            return self._restored
        save = getattr(self.source, "state_dict", None)
        if not callable(save):
            raise ProcckptError(
                f"ShuffleBuffer's source, a {type(self.source).__name__}, has no state_dict(): "
                "its position cannot be saved, so a resume reads it again from the start")
        generator = self._generator or torch.Generator().manual_seed(
            _seed(self.seed, self.epoch, _worker_id()))
        source = None if self._source_ended else \
            self._source_loaded if self._source_loaded is not None else save()
        return {"kind": _KIND, "size": self.size, "seed": self.seed, "epoch": self.epoch,
                "source": source, "buffer": pack_all(self._packed),
                "rng": generator.get_state().numpy().tobytes()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` at the next iteration."""
        if not isinstance(state, dict) or state.get("kind") != _KIND:
            raise ProcckptError("this state was not saved by a ShuffleBuffer: the data set "
                                "changed since the checkpoint; use the same one")
        if (state["size"], state["seed"]) != (self.size, self.seed):
            raise ProcckptError(
                f"the checkpoint's shuffle buffer held {state['size']} samples with seed "
                f"{state['seed']}, this one {self.size} with seed {self.seed}: an exact "
                "resume needs the same; change them in a new checkpoint dir")
        # The epoch first: a loader may be opened (its workers given a copy of this data set)
        # before the script's set_epoch() for that epoch (Lightning's is in a hook after).
        self.set_epoch(state["epoch"])
        if state["source"] is not None:
            self.source.load_state_dict(state["source"])  # type: ignore[attr-defined]
        self._restored = state


def _rng_tensor(saved: Any) -> torch.Tensor:
    """The generator state saved as bytes (a tensor in a checkpoint of procckpt 0.x)."""
    if isinstance(saved, torch.Tensor):
        return saved
    return torch.frombuffer(bytearray(saved), dtype=torch.uint8)


def _worker_id() -> int:
    info = get_worker_info()
    return info.id if info is not None else 0


def _seed(seed: int, epoch: int, worker: int) -> int:
    """A seed for each (seed, epoch, worker), the same in every process and Python."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
