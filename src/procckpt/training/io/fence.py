"""The step fence: a GPU state's copy runs beside the next forward and backward, and the optimizer step waits for it.

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
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ...protocol.switches import OVERLAP

__all__ = ["StepFence", "overlap_wanted", "ENV_OVERLAP"]

#: Environment switch: "0" makes the training stream wait for the whole copy at the safe point.
ENV_OVERLAP = OVERLAP.name


def overlap_wanted() -> bool:
    """Whether parameters and optimizer state may be copied beside the next forward/backward."""
    return OVERLAP.read()


class StepFence:
    """Makes each optimizer's next ``step()`` wait for the copies of a snapshot in flight.

    Args:
        optimizers: the optimizers whose parameters and state may be copied late.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self._pending: list[tuple[torch.device, Any]] = []
        self._lock = threading.Lock()
        self._hooked = False

    @classmethod
    def for_statefuls(cls, statefuls: dict[str, Any]) -> StepFence | None:
        """A fence over the optimizers among ``statefuls``; None when there is none or the
        overlap is switched off."""
        optimizers = [o for o in statefuls.values() if isinstance(o, torch.optim.Optimizer)]
        if not optimizers or not overlap_wanted():
            return None
        return cls(optimizers)

    def late_storages(self) -> set[int]:
        """Addresses of the GPU storages that change only in a fenced ``step()``: the
        optimizers' parameters and state. Hooks the optimizers the first time (so a run
        whose state never reaches a GPU never has them)."""
        if not self._hooked:
            for optimizer in self.optimizers:
                optimizer.register_step_pre_hook(self._before_step)
            self._hooked = True
        found: set[int] = set()
        for optimizer in self.optimizers:
            tensors = [p for group in optimizer.param_groups for p in group["params"]]
            tensors += [v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
            for t in tensors:
                if t.is_cuda:  # a DTensor (FSDP2) is copied as its local shard
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
            torch.cuda.current_stream(device).wait_event(event)
