"""The device path of a snapshot (training/save/device.py, arena.py, fence.py): page-locked
arena, side-stream copies, the step fence on every kind of optimizer a script hands over.

Each test runs twice: on the CPU twin (``PROCCKPT_DEVICE_TWIN=1``: CPU tensors take the GPU
path, a thread is the side stream, its copies start late so that a step that did not wait for
them would change what they copy), and on a CUDA device (marked ``cuda``: `make gpu-check`).
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from procckpt import Checkpointer
from procckpt.training.save.arena import HostArena
from procckpt.training.save.device import ENV_DEVICE_TWIN, device_ops
from procckpt.training.save.fence import StepFence, stepping_optimizer
from procckpt.training.save.writer import tensors_of

DEVICES = [pytest.param("twin", id="cpu-twin"),
           pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Where the state lives: "cpu" under the twin, "cuda" on a GPU."""
    monkeypatch.delenv("PROCCKPT_OVERLAP", raising=False)
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device; there is none")
        monkeypatch.delenv(ENV_DEVICE_TWIN, raising=False)
        yield "cuda"
        return
    monkeypatch.setenv(ENV_DEVICE_TWIN, "1")
    monkeypatch.setenv("PROCCKPT_DEVICE_TWIN_DELAY", "0.3")
    assert device_ops().twin
    yield "cpu"


def test_device_state_is_copied_into_page_locked_memory(device: str) -> None:
    state = {"w": torch.randn(1 << 20, device=device), "n": torch.arange(10)}
    arena = HostArena()
    snap = arena.capture(state)
    snap.wait_copied()
    assert arena.pinned
    if device == "cuda":
        assert snap.payload["w"].is_pinned()
    assert snap.payload["w"].data_ptr() != state["w"].data_ptr()
    assert torch.equal(snap.payload["w"], state["w"].cpu())
    state["w"].add_(1)  # after the copy landed
    assert not torch.equal(snap.payload["w"], state["w"].cpu())


def test_a_stop_checkpoint_of_device_state_goes_through_the_page_locked_arena(
        device: str, tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256).to(device)
    ckpt = Checkpointer(tmp_path, model=model, save_every=None, async_save=True)
    assert ckpt._background is not None
    with ckpt._background.staged(ckpt._payload()) as staged:  # what a stop writes
        weight = staged["statefuls"]["model"]["weight"]
        assert weight.device.type == "cpu"
        assert weight.data_ptr() != model.weight.data_ptr()  # the arena's copy
        assert torch.equal(weight, model.weight.detach().cpu())
    info = ckpt.save("stop")
    saved = torch.load(info.file("state.pt"), weights_only=True)
    assert torch.equal(saved["statefuls"]["model"]["weight"], model.weight.detach().cpu())
    assert ckpt._background.arena.pinned
    ckpt.close()


class _Bare(torch.optim.Optimizer):
    """SGD written by hand, whose __init__ never calls Optimizer.__init__ (seen in the wild):
    torch never wraps its step(), so a step pre-hook would never run."""

    def __init__(self, params: Any, lr: float) -> None:  # noqa: D107 - no super().__init__
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state: dict[Any, Any] = collections.defaultdict(dict)
        self.defaults = {"lr": lr}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def _wrapped(kind: str, optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer`` as a framework hands it to the script."""
    if kind == "accelerate":
        accelerate = pytest.importorskip("accelerate", reason="the accelerate extra")
        return accelerate.Accelerator(cpu=not torch.cuda.is_available()).prepare(optimizer)
    if kind == "lightning":
        core = pytest.importorskip("lightning.pytorch.core.optimizer",
                                   reason="the lightning extra")
        return core.LightningOptimizer(optimizer)
    return optimizer


def _bn_training(device: str, bare: bool = False) -> tuple[torch.nn.Module, Any, torch.Tensor]:
    torch.manual_seed(0)
    # Large enough on a GPU that the copy takes milliseconds: a step that did not wait for it
    # would change parameters it had not copied yet (the twin's copies start late instead).
    width = 4096 if device == "cuda" else 256
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, width)).to(device)
    optimizer = (_Bare(model.parameters(), lr=0.1) if bare
                 else torch.optim.Adam(model.parameters(), lr=0.1))
    return model, optimizer, torch.randn(64, width, device=device)


def _train(model: torch.nn.Module, optimizer: Any, x: torch.Tensor, steps: int) -> None:
    # Lightning's strategy steps the optimizer a LightningOptimizer wraps (through its
    # precision plugin), never the wrapper's own step() outside a Trainer.
    step = optimizer._optimizer.step if hasattr(optimizer, "_strategy") else optimizer.step
    for _ in range(steps):  # forward (BatchNorm's statistics change), backward, step
        model(x).square().mean().backward()
        step()
        model.zero_grad()  # a bare optimizer's inherited zero_grad() breaks its step()


@pytest.mark.parametrize("kind", ["plain", "accelerate", "lightning", "bare"])
def test_a_snapshot_copied_beside_the_next_step_is_the_state_at_the_safe_point(
        device: str, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    model, inner, x = _bn_training(device, bare=kind == "bare")
    optimizer = _wrapped(kind, inner)
    _train(model, optimizer, x, 1)
    fence = StepFence.for_statefuls({"model": model, "optimizer": optimizer})
    if kind == "bare":  # no hook can be placed: no fence, and one line says so
        assert fence is None
        assert "copied before the next forward" in caplog.text
    else:
        assert fence is not None and fence.optimizers == [inner]  # the one that steps
        assert stepping_optimizer(optimizer) is inner
    state = {"model": model.state_dict()}
    if kind != "bare":
        state["optimizer"] = optimizer.state_dict()
    expected = [t.clone() for t in tensors_of(state)]  # queued before the copy: the safe point
    with caplog.at_level(logging.WARNING):
        snapshot = HostArena().capture(state, fence)
    if fence is not None:
        assert fence._pending  # the parameters' copy is still allowed to run
        assert fence.late_storages()  # hooked, and its tensors are the late part
    _train(model, optimizer, x, 3)
    snapshot.wait_copied()
    copied = list(tensors_of(snapshot.payload))
    assert len(copied) == len(expected)
    for got, want in zip(copied, expected):
        assert torch.equal(got, want.cpu())
    now = [t.cpu() for t in tensors_of({"model": model.state_dict()})]
    assert not all(torch.equal(a, b) for a, b in zip(now, copied))  # training went on


def test_a_checkpointer_over_a_wrapped_optimizer_checkpoints_in_the_background(
        device: str, tmp_path: Path) -> None:
    """The crash an Accelerate user met at the first periodic checkpoint on a GPU."""
    model, inner, x = _bn_training(device)
    optimizer = _wrapped("accelerate", inner)
    ckpt = Checkpointer(tmp_path, model=model, optimizer=optimizer, save_every=None,
                        async_save=True)
    loop = ckpt.batches(iter(int, 1))
    next(loop)
    _train(model, optimizer, x, 1)
    ckpt.request_checkpoint()
    next(loop)  # the safe point: captured, copied beside the next step
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    _train(model, optimizer, x, 2)
    ckpt.flush()
    newest = ckpt.store.checkpoints()[-1]
    saved = torch.load(newest.file("state.pt"), weights_only=True)["statefuls"]["model"]
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    ckpt.close()


def test_a_twin_side_streams_thread_ends_with_its_stream(monkeypatch: pytest.MonkeyPatch):
    """A twin stream's thread runs what was queued on it, and ends once nothing holds the
    stream: a process that made many checkpointers keeps no thread for each."""
    monkeypatch.setenv(ENV_DEVICE_TWIN, "1")
    ops = device_ops()
    before = set(threading.enumerate())
    stream = ops.new_stream(torch.device("cpu"))
    (thread,) = set(threading.enumerate()) - before
    ran: list[int] = []
    ops.copy(stream, lambda non_blocking: ran.append(1))
    ops.record(stream).synchronize()
    assert ran == [1] and thread.is_alive()
    del stream
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
