"""Engines: the ways a snapshot of the training is taken and restored.

The supervisor talks to an engine through :class:`Engine`; ``hooks`` asks the training
process (which uses ``procckpt.Checkpointer``) to save its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Engine", "Confirmation"]


@dataclass(frozen=True)
class Confirmation:
    """A checkpoint the engine confirmed durable during the current cycle."""

    checkpoint: str | None
    step: int | None
    stopping: bool  # the training process exits after it
    seq: int = 0
    error: str | None = None


class Engine(Protocol):
    name: str

    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        """Return the argv to run for this cycle and extra environment for it."""

    def request(self, action: str, reason: str) -> int:
        """Ask for a checkpoint ("checkpoint") or a checkpoint then exit ("stop"); returns a
        sequence number that :meth:`confirmation` answers to."""

    def confirmation(self, seq: int) -> Confirmation | None:
        """The confirmation for request ``seq`` (or a later one), if it came."""

    def connected(self) -> bool:
        """Whether the command is known to be able to checkpoint in this cycle."""

    def end_cycle(self) -> Confirmation | None:
        """Clean up after the cycle's command exited; return the last stopping confirmation."""
