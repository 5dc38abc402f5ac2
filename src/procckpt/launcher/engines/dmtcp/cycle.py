"""What the DMTCP engine knows of the cycle in progress and of the checkpoint it is taking."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass, field

from ....store import CheckpointInfo
from .coordinator import Coordinator

__all__ = ["Cycle", "Job"]


@dataclass
class Job:
    """One checkpoint request being served by the checkpoint thread."""

    seq: int
    reason: str
    stop: bool
    thread: threading.Thread | None = None
    #: A stop that arrived while this (non-stop) checkpoint was in flight: served by a
    #: checkpoint of its own right after, since this image is of a process that kept running.
    then_stop: Job | None = None
    sent_at: float | None = None  # when DMTCP was asked
    wrote: bool = False  # whether any image byte appeared since
    committing: bool = False  # the images are complete and being moved into the store
    answered: bool = False  # its confirmation is out: a later request needs a new checkpoint
    #: The command's (processes, forked copies of it) as the request went out.
    processes: tuple[int, int] | None = None
    unusable: bool = False  # its image stalled or was refused (counted in StuckImages)


@dataclass
class Cycle:
    """What the engine knows about the cycle in progress."""

    token: str
    coordinator: Coordinator
    restored_from: CheckpointInfo | None
    pid: int | None = None
    running: threading.Event = field(default_factory=threading.Event)
    running_at: float = 0.0  # (monotonic) when DMTCP said it runs
    over: threading.Event = field(default_factory=threading.Event)
    over_at: float = 0.0
    restore_failed: str | None = None

    def kill(self) -> None:
        """SIGKILL the command's process group (a stuck restore or image); it may be gone."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
