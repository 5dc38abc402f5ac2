"""procckpt: checkpoint, requeue and resume PyTorch training across scheduler time limits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Checkpointer", "Sharded", "ShuffleBuffer", "init_distributed", "__version__"]

if TYPE_CHECKING:
    from .training.checkpointer import Checkpointer
    from .training.group import Sharded, init_distributed
    from .training.position.shuffle_buffer import ShuffleBuffer


def __getattr__(name: str) -> Any:
    # The launcher imports this package too and must not pay for importing torch.
    if name == "Checkpointer":
        from .training.checkpointer import Checkpointer

        return Checkpointer
    if name == "ShuffleBuffer":
        from .training.position.shuffle_buffer import ShuffleBuffer

        return ShuffleBuffer
    if name in ("Sharded", "init_distributed"):
        from .training import group

        return getattr(group, name)
    raise AttributeError(f"module 'procckpt' has no attribute {name!r}")
