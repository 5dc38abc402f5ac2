"""The step fence: a GPU state is copied beside the next forward and backward; the step waits.

A checkpoint of state on a GPU copies it into the host arena on a side stream. Most of what a
checkpoint holds (parameters, optimizer moments) changes only inside ``optimizer.step()``, so
the training's stream need not wait for those copies before the next forward and backward,
only before the next step:

    side stream:     [copy what the forward may change] [copy parameters + optimizer state]
                                     | event "first"                    | event "last"
    training stream: (waits "first") forward, backward ... (waits "last") optimizer.step()

What the forward may change (BatchNorm's running statistics, any buffer, tensors of other
statefuls) is copied first, and the training stream waits for that part right away: the
snapshot is of the state at the safe point, never a mix. The wait before the step comes from a
step pre-hook on each optimizer given to the Checkpointer; tensors of other optimizers, or of
none, are copied in the first part. ``PROCCKPT_OVERLAP=0`` puts everything in the first part.

The hook goes on the optimizer that steps: a wrapper (Accelerate's ``AcceleratedOptimizer``,
Lightning's ``LightningOptimizer``) is looked through to the optimizer it holds. An optimizer
whose ``step()`` runs no pre-hooks (a subclass that never called ``Optimizer.__init__``) is
not fenced: its tensors are copied in the first part, and a line says so once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from ...protocol.switches import OVERLAP
from .device import CpuTwin, CudaOps, device_ops

__all__ = ["StepFence", "overlap_wanted", "stepping_optimizer", "ENV_OVERLAP"]

logger = logging.getLogger(__name__)

#: Environment switch: "0" makes the training stream wait for the whole copy at the safe point.
ENV_OVERLAP = OVERLAP.name
#: Where wrappers keep the optimizer they wrap: Accelerate's and the Trainer's
#: ``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``.
_WRAPPED = ("optimizer", "_optimizer")


def overlap_wanted() -> bool:
    """Whether parameters and optimizer state may be copied beside the next forward/backward."""
    return OVERLAP.read()


def stepping_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` changes the parameters: ``obj`` itself, or the one a
    wrapper holds (followed through any number of wrappers); None for anything else."""
    seen: set[int] = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        attributes = getattr(obj, "__dict__", {})
        inner = next((attributes[name] for name in _WRAPPED
                      if isinstance(attributes.get(name), torch.optim.Optimizer)), None)
        if inner is None:
            break
        obj = inner
    return obj if isinstance(obj, torch.optim.Optimizer) else None


def _runs_pre_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` calls the step pre-hooks registered on it: torch wraps a
    class's ``step`` in ``Optimizer.__init__`` and keeps the hooks in the instance."""
    step = getattr(type(optimizer), "step", None)
    return (getattr(step, "hooked", False)
            and isinstance(vars(optimizer).get("_optimizer_step_pre_hooks"), dict))


def _say_unfenced(optimizer: Any, why: str) -> None:
    logger.warning("the state of the %s optimizer is copied before the next forward instead of "
                   "beside it: %s", type(optimizer).__name__, why)


class StepFence:
    """Makes each optimizer's next ``step()`` wait for the copies of a snapshot in flight.

    Args:
        optimizers: the optimizers whose parameters and state may be copied late; each must
            run its step pre-hooks (see :meth:`for_statefuls`).
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self._pending: list[tuple[torch.device, Any]] = []
        self._lock = threading.Lock()
        self._hooked = False
        self._ops: CudaOps | CpuTwin = device_ops()

    @classmethod
    def for_statefuls(cls, statefuls: dict[str, Any]) -> StepFence | None:
        """A fence over the optimizers among ``statefuls`` (wrappers looked through) whose
        ``step()`` runs pre-hooks; None when there is none or the overlap is switched off."""
        if not overlap_wanted():
            return None
        optimizers: list[torch.optim.Optimizer] = []
        for obj in statefuls.values():
            optimizer = stepping_optimizer(obj)
            if optimizer is None or any(optimizer is o for o in optimizers):
                continue
            if _runs_pre_hooks(optimizer):
                optimizers.append(optimizer)
            else:
                _say_unfenced(optimizer, "its step() runs no step pre-hooks (did its class "
                              "call torch.optim.Optimizer.__init__?)")
        return cls(optimizers) if optimizers else None

    def late_storages(self, ops: CudaOps | CpuTwin | None = None) -> set[int]:
        """Addresses of the device storages that change only in a fenced ``step()``: the
        optimizers' parameters and state. Hooks the optimizers the first time (so a run
        whose state never reaches a GPU never has them); one that refuses the hook is left
        out of the fence, and its tensors are copied before the next forward."""
        self._ops = ops = ops or device_ops()
        if not self._hooked:
            hooked = []
            for optimizer in self.optimizers:
                try:
                    optimizer.register_step_pre_hook(self._before_step)
                except Exception as e:  # noqa: BLE001 - a checkpoint never ends the training
                    _say_unfenced(optimizer, f"its step pre-hook could not be placed ({e!r})")
                    continue
                hooked.append(optimizer)
            self.optimizers = hooked
            self._hooked = True
        found: set[int] = set()
        for optimizer in self.optimizers:
            tensors = [p for group in optimizer.param_groups for p in group["params"]]
            tensors += [v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
            for t in tensors:
                if ops.holds(t):  # a DTensor (FSDP2) is copied as its local shard
                    local = t.to_local() if hasattr(t, "to_local") else t
                    found.add(local.untyped_storage().data_ptr())
        return found

    def hold(self, events: list[tuple[torch.device, Any]]) -> None:
        """The next ``step()`` of any fenced optimizer waits for ``events`` (device, event)."""
        with self._lock:
            self._pending.extend(events)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for device, event in pending:
            # Queued on the training stream, so the step's kernels run after the copy; the
            # CPU does not wait.
            self._ops.current_stream(device).wait_event(event)
