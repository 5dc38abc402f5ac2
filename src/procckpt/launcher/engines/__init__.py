"""Engines: the ways a snapshot of the training is taken and restored.

The supervisor talks to an engine through :class:`Engine`; ``hooks`` asks the training
process (which uses ``procckpt.Checkpointer``) to save its own state; ``dmtcp`` saves the whole
process image of an unmodified command. Every hook the supervisor calls is declared on
:class:`Engine`; those an engine has no use for keep their no-op default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...protocol.control import Heartbeat

__all__ = ["Engine", "Confirmation", "RequestUndelivered"]


class RequestUndelivered(Exception):
    """A checkpoint request could not be passed on (the control file could not be written);
    ``seq`` is the number it would have had."""

    def __init__(self, seq: int, message: str, lasting: bool = False) -> None:
        super().__init__(message)
        self.seq = seq
        #: The cause will repeat (no space left, no permission: store/files.py).
        self.lasting = lasting


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


class Engine:
    """How a snapshot of the command is taken: the supervisor's side of an engine."""

    name: str = "engine"

    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        """Return the argv to run for this cycle and extra environment for it."""
        raise NotImplementedError

    def request(self, action: str, reason: str) -> int:
        """Ask for a checkpoint ("checkpoint") or a checkpoint then exit ("stop"); returns a
        sequence number that :meth:`confirmation` answers to."""
        raise NotImplementedError

    def confirmation(self, seq: int) -> Confirmation | None:
        """The confirmation for request ``seq`` (or a later one), if it came."""
        raise NotImplementedError

    def connected(self) -> bool:
        """Whether the command is known to be able to checkpoint in this cycle."""
        raise NotImplementedError

    def end_cycle(self) -> Confirmation | None:
        """Clean up after the cycle's command exited; return the last stopping confirmation."""
        raise NotImplementedError

    # -- hooks with a default: an engine overrides those it has a use for ----------------
    #: Whether :meth:`progress` reports the training's steps (hang detection needs it).
    reports_progress: bool = False

    def progress(self) -> Heartbeat | None:
        """The step the training last said it reached, and when: what hang detection
        watches; None before the first (or from an engine that cannot see steps)."""
        return None

    def failures(self) -> list[dict[str, Any]]:
        """What the ranks an exception ended in this cycle said (rank, host, error)."""
        return []

    def procckpt_exits(self) -> list[dict[str, Any]] | None:
        """The ranks procckpt itself ended in this cycle, with its exit code (rank, code,
        error: protocol/exits.py); read after :meth:`end_cycle`. None: the engine could not
        tell (then the command's exit code is taken for procckpt's where it is one of its)."""
        return []

    def writing(self, seq: int) -> bool:
        """Whether the image request ``seq`` asked for is being written now (or waits for the
        one before it). Stopping the command then would cut the image short and leave none,
        so a stop waits for it past its lead: the engine bounds the write itself."""
        return False

    @property
    def stuck(self) -> str | None:
        """Why no snapshot of this command will ever complete (a failure that repeats), once
        seen; None while there is hope."""
        return None

    def child_started(self, pid: int) -> None:
        """The cycle's command runs as ``pid``, leader of its own process group."""

    def after_exit(self, exit_code: int, requested: bool, signalled: bool = False) -> str | None:
        """Called after :meth:`end_cycle`. ``requested``: the supervisor asked for a stop or
        signalled the command; ``signalled``: it sent the command a signal. A message means
        "run another cycle, this one failed for the engine's reasons" (a process image that
        could not be restored, say), and says why."""
        return None
