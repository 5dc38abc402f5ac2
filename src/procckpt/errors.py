"""The few exception types procckpt raises; only ``cli.main`` turns them into exit codes."""

from __future__ import annotations

__all__ = [
    "ProcckptError",
    "UsageError",
    "StoreError",
    "LockedError",
    "CheckpointCorruptError",
    "CommandNotFoundError",
    "EX_USAGE",
    "EX_SOFTWARE",
    "EX_TEMPFAIL",
    "EX_NOTFOUND",
]

#: Exit codes. EX_TEMPFAIL (sysexits' "temporary failure, retry") is what procckpt
#: returns when the run was checkpointed but not finished and nothing restarted it:
#: a wrapper outside a container, a job-array chain or a Kubernetes Job retries on it.
EX_USAGE = 2
EX_SOFTWARE = 70
EX_TEMPFAIL = 75
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

    exit_code = 1


class CheckpointCorruptError(ProcckptError):
    """Checkpoints exist but none of them can be loaded."""

    exit_code = 1


class CommandNotFoundError(ProcckptError):
    """The command to supervise does not exist or is not executable."""

    exit_code = EX_NOTFOUND
