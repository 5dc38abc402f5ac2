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
