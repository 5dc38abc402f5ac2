"""A rank that an exception ends tells the launcher so, before Python prints the traceback.

In a group, one rank's end is seen by its peers as a broken connection, and they end too; but a
rank whose peer died with its node can be left waiting for it (srun waits for a task whose
node is gone). The launcher, told that a rank failed while the command still runs, asks the
scheduler whether a node of the job is lost (launcher/watch.py). The report is a file in the
control directory (``failed-<rank>.json``), written by a ``sys.excepthook`` that then calls
the one it replaced.
"""

from __future__ import annotations

import contextlib
import sys
from types import TracebackType

from ... import errors
from ...protocol import control as ctl
from ...protocol.exits import leave_exit_note

__all__ = ["report_through", "note_exits"]

#: The channel and rank of the newest Checkpointer of this process, and the hook replaced.
_current: tuple[ctl.ControlChannel, int] | None = None
_previous = sys.excepthook


def _report(kind: type[BaseException], value: BaseException,
            tb: TracebackType | None) -> None:
    if _current is not None and not issubclass(kind, KeyboardInterrupt):
        control, rank = _current
        lines = str(value).strip().splitlines()
        with contextlib.suppress(Exception):  # the traceback must be printed whatever happens
            control.report_failure(rank, f"{kind.__name__}: {lines[0] if lines else ''}")
    _previous(kind, value, tb)


def report_through(control: ctl.ControlChannel, rank: int) -> None:
    """From now on, this rank's uncaught exceptions are reported through ``control``."""
    global _current, _previous
    _current = (control, rank)
    if sys.excepthook is not _report:
        _previous = sys.excepthook
        sys.excepthook = _report


#: The rank whose exits procckpt notes (None: no listener installed yet).
_noted_rank: int | None = None


def _note(error: errors.ProcckptError) -> None:
    if _noted_rank is not None:
        leave_exit_note(_noted_rank, error.exit_code, str(error))


def note_exits(rank: int) -> None:
    """From now on, an error procckpt ends this rank with leaves a note for the launcher
    (protocol/exits.py): its exit code is procckpt's, not the script's."""
    global _noted_rank
    _noted_rank = rank
    if _note not in errors.exit_listeners:
        errors.exit_listeners.append(_note)
