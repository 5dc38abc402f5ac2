"""Where a gradient accumulation ends: no checkpoint inside one.

With ``Accelerator(gradient_accumulation_steps=N)`` and ``with accelerator.accumulate(model)``
the gradients of N micro-batches are summed before the optimizer steps, and Accelerate counts
the micro-batches itself (``Accelerator.step``, in no ``state_dict()``). A checkpoint between
two of them would lose the summed gradients, and a resume would count the window from zero
at the wrong micro-batch. So the loops take a checkpoint only after a micro-batch that ended
a window (Accelerate's ``GradientState.sync_gradients``: the optimizer stepped, the gradients
were cleared); a checkpoint asked for inside one waits at most N-1 micro-batches. Resumed at
a window's end, Accelerate's fresh count of zero is the right one. The end of the loader
always ends a window (Accelerate syncs there), unless the script turned that off.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["window_ended"]


def window_ended() -> Callable[[], bool] | None:
    """A function that says whether the micro-batch just trained ended a gradient
    accumulation window; None where nothing accumulates (no Accelerator was made)."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.GradientState._shared_state:
        return None
    gradients = state.GradientState()  # the Accelerator's (the state is shared)
    return lambda: bool(gradients.sync_gradients)
