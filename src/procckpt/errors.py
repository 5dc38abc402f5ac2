"""The few exception types procckpt raises; only ``cli.main`` turns them into exit codes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

__all__ = [
    "ProcckptError",
    "UsageError",
    "StoreError",
    "LockedError",
    "CheckpointCorruptError",
    "CommandNotFoundError",
    "CheckpointReadError",
    "StorageError",
    "exiting",
    "logged_exit",
    "EX_USAGE",
    "EX_IOERR",
    "EX_DATAERR",
    "EX_SOFTWARE",
    "EX_TEMPFAIL",
    "EX_NOTFOUND",
    "EX_AUDIT",
    "ResumeAuditError",
]

#: Exit codes. EX_TEMPFAIL (sysexits' "temporary failure, retry") is what procckpt
#: returns when the run was checkpointed but not finished and nothing restarted it:
#: a wrapper outside a container, a job-array chain or a Kubernetes Job retries on it.
EX_USAGE = 2
EX_SOFTWARE = 70
#: The checkpoint dir's storage failed in a way that would fail again (no space, no
#: permission, a read error): procckpt stops instead of restarting into the same failure.
EX_IOERR = 74
#: Checkpoints exist but none can be used (every one is damaged): sysexits' "the input data
#: was incorrect". Never restarted either: it would find the same damage.
EX_DATAERR = 65
EX_TEMPFAIL = 75
#: A resumed run's first batch was not the one the interrupted run was about to train on, and
#: ``--audit strict`` stopped it (training/audit.py). Never restarted: it would resume the
#: same way. (Not sysexits' meaning of 66: a code of procckpt's own in its unused range.)
EX_AUDIT = 66
#: The command was stopped (its time limit, a stop signal) and nothing could be saved.
EX_NOT_SAVED = 124
EX_NOTFOUND = 127


class ProcckptError(Exception):
    """An error with a one-line message that tells the user what to do."""

    exit_code: int = 1


class UsageError(ProcckptError):
    """Bad input on the command line, in the environment or in the config file."""

    exit_code = EX_USAGE


class StoreError(ProcckptError):
    """The checkpoint directory cannot be used (unwritable, foreign, ...)."""

    exit_code = EX_USAGE


class LockedError(StoreError):
    """Another live process holds the checkpoint directory."""

    exit_code = EX_USAGE


class CheckpointCorruptError(ProcckptError):
    """Checkpoints exist but none of them can be loaded."""

    exit_code = EX_DATAERR


class CommandNotFoundError(ProcckptError):
    """The command to supervise does not exist or is not executable."""

    exit_code = EX_NOTFOUND


class CheckpointReadError(ProcckptError):
    """A checkpoint could not be read (permission, I/O error, stale handle): the storage is at
    fault, not the checkpoint, so it is neither renamed nor skipped."""

    exit_code = EX_IOERR


class StorageError(ProcckptError):
    """A checkpoint could not be written for a reason that would repeat (no space left, no
    permission, a read-only file system); the previous checkpoint is intact."""

    exit_code = EX_IOERR


class ResumeAuditError(ProcckptError):
    """A resumed run would train on other data than the interrupted run was about to, and
    ``--audit strict`` stops it before it does."""

    exit_code = EX_AUDIT


_EXITING: dict[type, type] = {}


#: Called with each error :func:`logged_exit` ends a process with: the training side tells
#: its launcher that procckpt, not the script, chose the exit code (protocol/exits.py).
exit_listeners: list[Callable[[ProcckptError], None]] = []


def logged_exit(error: ProcckptError, logger: logging.Logger | None = None) -> ProcckptError:
    """Log ``error`` as the one line a user reads, and return it as :func:`exiting` does."""
    (logger or logging.getLogger("procckpt")).error("error: %s", error)
    for listener in exit_listeners:
        with contextlib.suppress(Exception):  # the error is what matters; the note is a help
            listener(error)
    return exiting(error)


def exiting(error: ProcckptError) -> ProcckptError:
    """The same error, also a ``SystemExit`` with the error's exit code.

    The training side runs inside the user's script, which has no ``main()`` of ours to turn
    errors into exit codes. Raised through this, an error that nothing catches ends the
    process with its exit code and no traceback (the caller logs its one line first), while
    ``except ProcckptError`` (or the error's own type) still catches it.
    """
    if isinstance(error, SystemExit):
        return error
    cls = type(error)
    both = _EXITING.get(cls)
    if both is None:
        both = type(cls.__name__, (cls, SystemExit), {"__module__": cls.__module__,
                                                      "__qualname__": cls.__qualname__})
        _EXITING[cls] = both
    exit_error: Any = BaseException.__new__(both)
    exit_error.args = error.args
    exit_error.__dict__.update(error.__dict__)
    exit_error.code = error.exit_code
    return exit_error
