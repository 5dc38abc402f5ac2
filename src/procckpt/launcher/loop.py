"""The shape both run loops share, node 0's supervisor and another node's follower: signals
come through a wakeup pipe for as long as the run lasts, and a run ends with the exit code of
decide.py's table."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .decide import EXIT_CODES
from .results import ExitReason, RunResult
from .signals import SignalPipe

__all__ = ["RunLoop"]

logger = logging.getLogger(__name__)


class RunLoop:
    """``run()`` installs the signals (or leaves a test's ``wait_signals`` in their place),
    runs ``_run()`` and restores them; ``_end()`` makes the result."""

    cycles: int = 0
    _signals: SignalPipe
    #: Wait up to N seconds for signals; the ones that came. A test's, or the pipe's in run().
    _wait: Callable[[float], list[int]] | None

    def run(self) -> RunResult:
        if self._wait is not None:  # a test drives the signals
            return self._run()
        self._signals.install()
        self._wait = self._signals.wait
        try:
            return self._run()
        finally:
            self._signals.restore()
            self._wait = None

    def _run(self) -> RunResult:
        raise NotImplementedError

    def _end(self, reason: ExitReason, message: str, error: bool = False,
             command_code: int = 0) -> RunResult:
        """The run's result: its exit code from the table (the command's own where the
        table says so), said in the log."""
        code = EXIT_CODES[reason]
        code = command_code if code is None else code
        (logger.error if error else logger.info)("%s", message)
        return RunResult(code, reason, self.cycles, message)
