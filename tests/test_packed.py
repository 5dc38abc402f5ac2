"""procckpt's packed samples (training/position/packed.py): a shuffle buffer's samples as one
bytes and their skeletons, the state a worker sends after every batch."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from procckpt import ShuffleBuffer
from procckpt.training.position.packed import pack, pack_all, unpack_all

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def samples() -> list:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 6, generator=g)
    return [
        {"tokens": torch.randint(100, (12,), generator=g), "label": torch.tensor(1),
         "id": torch.tensor(7)},
        {"x": wide[:, ::2], "mask": torch.tensor([True, False, True]),  # not contiguous
         "half": torch.randn(3, generator=g).to(torch.bfloat16),
         "c": torch.randn(2, dtype=torch.complex64, generator=g),
         "empty": torch.zeros(0, 5), "text": "a line", "n": 3, "f": 0.5, "none": None,
         "nested": [torch.arange(3, dtype=torch.int16), (torch.ones(2, dtype=torch.float64),
                                                          "t")]},
        torch.tensor(2.5),
        42,
        {"sparse": torch.eye(3).to_sparse(), "u8": torch.arange(5, dtype=torch.uint8)},
    ]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b and type(a) is type(b)


def test_samples_come_back_equal_from_a_checkpoint_loaded_weights_only():
    state = pack_all([pack(s) for s in samples()])
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as a checkpoint holds it
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    back = [sample for sample, _ in unpack_all(loaded)]
    assert all(same(a, b) for a, b in zip(samples(), back, strict=True))
    # Each sample's tensors are its own: changing one changes nothing else.
    back[0]["tokens"][0] = -1
    assert back[0]["tokens"][0] == -1 and back[1]["nested"][0][0] == 0


def test_a_buffer_of_one_shape_is_sent_as_bytes_and_one_skeleton():
    """What a worker sends after each batch: no tensor (each would be a shared-memory segment
    and a file descriptor passed), and the skeleton written once."""
    shaped = [{"tokens": torch.arange(12) + i, "label": torch.tensor(i % 2)} for i in range(256)]
    state = pack_all([pack(s) for s in shaped])
    assert isinstance(state["data"], bytes) and len(state["data"]) == 256 * 13 * 8
    assert len({id(s) for s in state["skeletons"]}) == 1
    assert len(pickle.dumps(state)) < len(state["data"]) + 2000
    assert pack_all([pack(3)])["data"] is None  # no tensors: no b"" for weights_only to refuse


class Listed(list):
    """Samples in a list, with the count to skip as its state."""

    start = 0

    def __iter__(self):
        yield from list.__iter__(self[self.start:])

    def state_dict(self) -> dict[str, int]:
        return {"start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["start"]


def test_a_buffer_saved_before_packing_still_resumes():
    """A checkpoint written before the buffer was packed holds its samples as a list and the
    random stream as a tensor: a resume from it goes on as from a new one."""
    def fresh() -> ShuffleBuffer:
        return ShuffleBuffer(Listed({"v": torch.tensor(i)} for i in range(40)), size=8, seed=2)

    whole = [int(s["v"]) for s in fresh()]
    data = fresh()
    it = iter(data)
    first = [int(next(it)["v"]) for _ in range(10)]
    new = {**data.state_dict(), "source": {"start": 18}}  # 8 in the buffer, 10 handed out
    old = {**new, "buffer": [s for s, _ in unpack_all(new["buffer"])],
           "rng": torch.frombuffer(bytearray(new["rng"]), dtype=torch.uint8)}
    for state in (new, old):
        resumed = fresh()
        resumed.load_state_dict(state)
        assert first + [int(s["v"]) for s in resumed] == whole
