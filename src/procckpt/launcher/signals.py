"""The launcher's signals: what each one means, and a wakeup pipe so that no handler does any work.

    signal          what procckpt run does
    -------------   -------------------------------------------------------------------------
    SIGTERM         checkpoint now, then stop the command (Slurm's time limit, preemption,
                    scancel, Kubernetes' pod termination all start with SIGTERM)
    SIGUSR1         the same: checkpoint now, then stop. Default of --checkpoint-signal, which
                    `procckpt sbatch` asks Slurm to send (`--signal=B:USR1@grace`)
    SIGUSR2         checkpoint now and keep training (a snapshot on demand)
    SIGINT          Ctrl-C: checkpoint at the next safe point, then stop (exit 75, resumable);
                    a second one kills the command at once. Forwarded instead to a command
                    that never connected to procckpt (it has nothing to save)
    SIGHUP          forwarded to the command's process group
    SIGCONT         forwarded (Slurm sends it with SIGTERM to wake suspended jobs)

A stop signal during the deadline's stop is kept: the run ends after that checkpoint
(watch.py). USR1/USR2 are never forwarded raw: NCCL installs a SIGUSR1 handler and DMTCP
uses SIGUSR2 internally, so the request reaches the training process through ``control/``
instead. Under
``--engine dmtcp`` DMTCP's own checkpoint signal is moved to SIGRTMIN+6 (engines/dmtcp/engine.py).
docs/cli.md repeats the table for users.
"""

from __future__ import annotations

import enum
import os
import select
import signal
from typing import Any

__all__ = ["Action", "HANDLED_SIGNALS", "signal_actions", "SignalPipe"]

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT,
                   signal.SIGHUP, signal.SIGCONT)
#: Signals that mean nothing but "checkpoint" to a launcher: ignored once its run is over.
_CHECKPOINT_ONLY = (signal.SIGUSR1, signal.SIGUSR2)


class Action(enum.Enum):
    CHECKPOINT_STOP = "checkpoint-stop"
    CHECKPOINT = "checkpoint"
    FORWARD = "forward"
    INTERRUPT = "interrupt"  # Ctrl-C: the first checkpoints and stops, a second kills


def signal_actions(checkpoint_signal: str) -> dict[int, Action]:
    """What each handled signal asks for; ``checkpoint_signal`` (``USR1``, ``TERM``) is a stop."""
    table: dict[int, Action] = {
        signal.SIGTERM: Action.CHECKPOINT_STOP,
        signal.SIGUSR1: Action.CHECKPOINT_STOP,
        signal.SIGUSR2: Action.CHECKPOINT,
        signal.SIGINT: Action.INTERRUPT,
        signal.SIGHUP: Action.FORWARD,
        signal.SIGCONT: Action.FORWARD,
    }
    table[getattr(signal, f"SIG{checkpoint_signal}")] = Action.CHECKPOINT_STOP
    return table


class SignalPipe:
    """Delivers signals to the run loop through ``signal.set_wakeup_fd``.

    The installed handlers do nothing: the C-level handler already wrote the signal's number
    into the pipe, which :meth:`wait` reads. SIGCHLD is caught too, only so that a child's exit
    wakes the loop at once.
    """

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = tuple(dict.fromkeys((*signals, signal.SIGCHLD)))
        self._read = self._write = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1

    def install(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._read, self._write = r, w
        for signum in self.signals:
            self._old_handlers[signum] = signal.signal(signum, _record_only)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def restore(self) -> None:
        """Put the handlers back, but for SIGUSR1 and SIGUSR2 where they were the default:
        the run is over, and a checkpoint signal now (Slurm's warning, come as the training
        finished) asks for nothing. Its default action would end this process by the signal,
        which Slurm records as a failed job."""
        signal.set_wakeup_fd(self._old_wakeup)
        for signum, handler in self._old_handlers.items():
            if signum in _CHECKPOINT_ONLY and handler == signal.SIG_DFL:
                handler = signal.SIG_IGN
            signal.signal(signum, handler)
        self._old_handlers.clear()
        os.close(self._read)
        os.close(self._write)

    def wait(self, timeout: float) -> list[int]:
        """The signals that arrived within ``timeout`` seconds (none: the time passed)."""
        try:
            ready, _, _ = select.select([self._read], [], [], timeout)
        except InterruptedError:
            ready = [self._read]
        if not ready:
            return []
        try:
            data = os.read(self._read, 4096)
        except BlockingIOError:
            return []
        return [b for b in data if b != signal.SIGCHLD]


def _record_only(signum: int, frame: object) -> None:
    pass
