"""training/unsaved.py: which stateful objects of the script no checkpoint holds, found in the
script's own frames, with what the registered ones cover left out."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from procckpt import Sharded
from procckpt.training.unsaved import describe_unsaved, unsaved_statefuls

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def test_what_the_registered_objects_cover_is_left_out_and_the_rest_is_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    wrapped = nn.Sequential(model)  # a wrapper of the registered model (DDP, compile): covered
    first = model[0]  # a submodule: covered
    loss = nn.CrossEntropyLoss()  # no parameters or buffers: nothing to lose
    loader = torch.utils.data.DataLoader(list(range(4)))  # the data position is procckpt's
    ema = torch.optim.swa_utils.AveragedModel(model)  # its own copy of the weights
    second = torch.optim.SGD(ema.parameters(), lr=0.1)  # an optimizer nobody registered
    found = unsaved_statefuls({"model": model, "optimizer": optimizer, "scheduler": scheduler},
                              sys._getframe())
    assert sorted(found) == ["ema", "second"]
    assert describe_unsaved({"ema": found["ema"]}) == (
        "ema (AveragedModel, in test_what_the_registered_objects_cover_is_left_out_and_the_rest_"
        "is_named())")
    del wrapped, first, loss, loader, second


def test_a_sharded_holder_covers_its_model_and_optimizers():
    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert unsaved_statefuls({"train": Sharded(model, optimizer)}, sys._getframe()) == {}


def test_tensors_training_changed_in_place_are_named_unless_extras_hold_them():
    model = nn.Linear(3, 2)
    data = torch.randn(8, 3)  # made once, never changed: not state
    ema = [p.detach().clone() for p in model.parameters()]  # the common EMA
    for average, p in zip(ema, model.parameters()):  # leaves `average` at one of ema's
        average.mul_(0.9).add_(p.detach(), alpha=0.1)
    running = {"loss": torch.zeros(())}
    running["loss"] += 1.0  # a running sum in a dict
    kept = [torch.zeros(2)]
    kept[0].add_(1)  # changed, but in ckpt.extras: in the checkpoint
    weights = list(model.parameters())  # the model's own: covered
    batch = data * 2  # a fresh result: never changed in place
    found = unsaved_statefuls({"model": model}, sys._getframe(), {"kept": kept})
    assert sorted(found) == ["ema", "running"]
    assert describe_unsaved({"ema": found["ema"]}).startswith("ema (a list of 2 tensors, in ")
    assert describe_unsaved({"running": found["running"]}).startswith(
        "running (a dict of 1 tensor, in ")
    assert set(found["ema"][0].state_dict()) == {"0", "1"}
    del weights, batch
