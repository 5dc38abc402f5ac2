"""A value's fingerprint (training/state/contents.py): taken over what it holds, whatever holds
it, the same in any iteration order, read in place, and honest about what it cannot see."""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np
import pytest
import torch

from procckpt.training.state import contents
from procckpt.training.state.contents import fingerprint

pytestmark = pytest.mark.unit


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    index: torch.Tensor
    note: str


class GraphBatch:
    """A graph library's batch: tensors in its attributes, one of them in a store."""

    def __init__(self, x: torch.Tensor, edges: torch.Tensor) -> None:
        self.x = x
        self._store = {"edge_index": edges}


class Slotted:
    __slots__ = ("x",)

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


Pair = collections.namedtuple("Pair", "x y")


def crc(value) -> int:
    seen = fingerprint(value)
    assert seen.unseen is None, seen.unseen
    return seen.crc


X = torch.arange(12.0).reshape(3, 4)


@pytest.mark.parametrize("make", [
    lambda x: Batch(x, torch.tensor([0, 1, 2]), "three"),
    lambda x: GraphBatch(x, torch.tensor([[0, 1], [1, 2]])),
    lambda x: Slotted(x),
    lambda x: Pair(x, 1),
    lambda x: {"x": x, "tags": {"a", "b"}},
    lambda x: (x.to_sparse(), 1),
    lambda x: torch.nested.nested_tensor(list(x.unbind())),
    lambda x: [x.numpy(), np.float32(x.sum().item())],
], ids=["dataclass", "attributes", "slots", "namedtuple", "set", "sparse", "nested", "numpy"])
def test_what_any_container_holds_is_seen(make):
    assert crc(make(X)) == crc(make(X.clone()))
    assert crc(make(X)) != crc(make(X + 1))  # a value inside changed: the fingerprint too


def test_mappings_and_sets_in_any_order_are_the_same():
    keys = ["x", "index", "twice", "label"]
    a = {k: torch.tensor([i]) for i, k in enumerate(keys)}
    b = {k: a[k] for k in reversed(keys)}
    assert crc(a) == crc(b)
    assert crc({"b", "a", "c"}) == crc({"c", "a", "b"})
    assert crc([1, 2]) != crc([2, 1])  # sequences keep their order


def test_what_cannot_be_looked_into_is_named_and_a_failure_never_raises():
    seen = fingerprint((X, threading.Lock()))
    assert seen.unseen == "lock" and seen.what == "1 tensor: 3x4 float32"

    class Broken:
        def __getattribute__(self, name):
            raise RuntimeError("no")

    failed = fingerprint({"b": Broken()})
    assert failed.unseen is not None and "failed" in failed.unseen


def test_a_tensor_is_read_in_place_or_in_bounded_pieces(monkeypatch):
    monkeypatch.setattr(contents, "PIECE", 64)  # so that the pieces below are many
    big = torch.randn(40, 30)
    sliced = big[:, ::2]  # gaps: read in pieces through one host buffer (as a GPU tensor is)
    assert crc(sliced) == crc(sliced.contiguous())
    permuted = big.t()  # fills its span: read as it lies, with its strides
    assert crc(permuted) == crc(big.t())
    assert crc(permuted) != crc(big)
    copies = []
    real_empty = torch.empty

    def counted_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        copies.append(out.numel())
        return out

    monkeypatch.setattr(torch, "empty", counted_empty)
    fingerprint(torch.randn(400, 30)[:, ::2])
    assert copies and max(copies) <= 64  # never the whole tensor


def test_the_state_a_first_step_starts_from_is_compared_tensor_by_tensor():
    """state/first_step.py: weights changed after the restore are named; a model cast to
    another dtype after it (model.half() after the Checkpointer) is no difference; a
    framework's step counter is compared by value."""
    from procckpt.training.state.first_step import StateExpectation, live_state, restored_state

    model = torch.nn.Linear(3, 2)
    statefuls = {"model": model, "scheduler": object()}
    prints, counters, advice = restored_state(statefuls, {})
    expectation = StateExpectation(prints, lambda: live_state(statefuls), "do this", counters)
    assert expectation.problem("ckpt-00000001", 4) is None
    with torch.no_grad():
        model.bias.add_(1)
    problem = expectation.problem("ckpt-00000001", 4)
    assert problem is not None and problem.startswith("the state step 5 starts from is not the "
                                                      "one it resumed from: 1 of 2 tensors")
    assert "(model.bias)" in problem and problem.endswith("Do this")
    model.half()  # cast: the fingerprints cannot be compared, and say nothing
    assert expectation.problem("ckpt-00000001", 4) is None
    steps = {"global_step": 0}
    counter = StateExpectation({"global_step": (7, "counter")}, lambda: steps, "pass it",
                               frozenset({"global_step"}))
    assert "global_step is 0, not 7" in (counter.problem("ckpt-00000001", 7) or "")
    steps["global_step"] = 7
    assert counter.problem("ckpt-00000001", 7) is None


def test_a_plain_tensors_print_is_its_fingerprint():
    """contents.plain_print, which a restore takes as it copies (state/mapped.py), is what
    the fingerprint of the same tensor is, and falls back to it for any other layout."""
    tensors = [torch.randn(3, 4), torch.tensor(2.5), torch.ones(5, dtype=torch.bool),
               torch.randn(7).to(torch.bfloat16), torch.arange(6).view(2, 3),
               torch.randn(4, 3).t(), torch.randn(8)[::2],
               torch.randn(3, dtype=torch.cfloat).conj(), torch.zeros(0, 3)]
    for t in tensors:
        assert contents.plain_print(t) == fingerprint(t).crc, t
