"""Engines: the ways a snapshot of the training is taken and restored.

The supervisor talks to an engine through :class:`Engine`; ``hooks`` asks the training
process (which uses ``procckpt.Checkpointer``) to save its own state; ``dmtcp`` saves the whole
process image of an unmodified command.

Two optional methods, looked up with ``getattr`` so that an engine needs them only if it uses
them: ``child_started(pid)`` (the cycle's command runs as ``pid``, leader of its own process
group) and ``after_exit(exit_code, requested, signalled) -> str | None`` (called after
``end_cycle``; ``requested`` says whether the supervisor asked for a stop or signalled the
command, ``signalled`` whether it sent the command a signal; a message means
"run another cycle, this one failed for the engine's reasons", e.g. a process image that could
not be restored, and says why), and ``progress() -> Heartbeat | None`` (the step the training
last said it reached, and when: what hang detection watches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Engine", "Confirmation", "RequestUndelivered"]


class RequestUndelivered(Exception):
    """A checkpoint request could not be passed on (the control file could not be written);
    ``seq`` is the number it would have had."""

    def __init__(self, seq: int, message: str) -> None:
        super().__init__(message)
        self.seq = seq


@dataclass(frozen=True)
class Confirmation:
    """A checkpoint the engine confirmed durable during the current cycle."""

    checkpoint: str | None
    step: int | None  # the training step it holds; None where the engine knows no steps
    stopping: bool  # the training process exits after it
    seq: int = 0
    error: str | None = None
    number: int | None = None  # its number in the store (ckpt-N)

    @property
    def progress(self) -> int | None:
        """What shows the run moved on: its step, or the checkpoint's number where the
        engine knows no steps (DMTCP: every image is taken later in the run)."""
        return self.step if self.step is not None else self.number


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
