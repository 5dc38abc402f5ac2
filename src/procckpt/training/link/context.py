"""What ``procckpt run`` tells the training process through its environment, read once at start.

Launched, a script gets a token (proof that a launcher is listening on ``control/``), the
checkpoint dir the launcher chose, the restart count, the engine in use and the exit code a
planned stop should end with. Run alone, it gets none of these, and the script's own choices
(or ``$PROCCKPT_DIR``) decide.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import EX_TEMPFAIL, ProcckptError
from ...protocol import control as ctl
from ...store.remote import split_location
from .failures import note_exits, report_through

__all__ = ["LaunchContext", "DEFAULT_DIR", "default_dir", "force_requested", "open_control"]

logger = logging.getLogger(__name__)

DEFAULT_DIR = "procckpt-checkpoints"


@dataclass(frozen=True)
class LaunchContext:
    """The launcher's side of the bargain, as the training process sees it."""

    token: str | None
    restart: int
    rank: int
    #: The exit code after a checkpoint taken to stop: what ``procckpt run`` asked for, or 75.
    stop_exit_code: int

    @property
    def launched(self) -> bool:
        return bool(self.token)

    @classmethod
    def from_environment(cls) -> LaunchContext:
        """Read the environment.

        Raises:
            ProcckptError: the launcher images this process with DMTCP, so checkpoints of
                the script's own would compete with its images.
        """
        token = os.environ.get(ctl.ENV_TOKEN) or None
        if not token and os.environ.get(ctl.ENV_ENGINE) == "dmtcp":
            raise ProcckptError(
                "this script uses procckpt.Checkpointer, but procckpt run is checkpointing it "
                "with DMTCP (--engine auto could not see the script, or --engine dmtcp was "
                "given): run it with --engine hooks")
        # procckpt run asks for 0 after a stop: it knows from the ack that this was planned,
        # and a non-zero exit would make torchrun print a failure report for every rank.
        stop_exit = (_env_count(ctl.ENV_STOP_EXIT) if os.environ.get(ctl.ENV_STOP_EXIT)
                     else EX_TEMPFAIL)
        return cls(token=token, restart=_env_count(ctl.ENV_RESTART), rank=_rank(),
                   stop_exit_code=stop_exit)


def default_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint dir: the launcher's, else ``explicit``, else $PROCCKPT_DIR, else
    ``./procckpt-checkpoints``."""
    launched = os.environ.get(ctl.ENV_TOKEN) and os.environ.get(ctl.ENV_DIR)
    if launched:
        chosen = Path(os.environ[ctl.ENV_DIR])
        if explicit is not None and Path(explicit).absolute() != chosen.absolute():
            logger.warning("procckpt run chose checkpoint dir %s; ignoring %s given in the script",
                           chosen, explicit)
        return chosen
    if explicit is not None:
        return Path(explicit)
    return Path(os.environ.get(ctl.ENV_DIR) or DEFAULT_DIR)


def dir_and_remote(explicit: str | os.PathLike[str] | None = None) -> tuple[Path, str | None]:
    """The checkpoint dir as :func:`default_dir` chooses it, and the remote URL where it was
    given as ``s3://BUCKET/PREFIX`` (then the dir is its local dir: store/remote.py). Under
    ``procckpt run`` the launcher chose both; its local dir's marker names the remote."""
    launched = os.environ.get(ctl.ENV_TOKEN) and os.environ.get(ctl.ENV_DIR)
    spec = explicit if explicit is not None else os.environ.get(ctl.ENV_DIR)
    if launched or spec is None or not str(spec).startswith("s3://"):
        return default_dir(explicit), None
    return split_location(spec)


def _env_count(name: str) -> int:
    """A count the launcher passes in the environment; 0, with a warning, if it is not one."""
    text = os.environ.get(name, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        logger.warning("ignoring %s=%r: expected a whole number (it is set by procckpt run)",
                       name, text)
        return 0
    return value


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def force_requested() -> bool:
    """Whether ``PROCCKPT_FORCE`` asks a script run alone to train a finished run again."""
    return os.environ.get("PROCCKPT_FORCE", "").strip().lower() in ("1", "true", "yes", "on")


def open_control(control_dir: Path, token: str | None, rank: int) -> ctl.ControlChannel | None:
    """The control channel of a launched run (None outside ``procckpt run``), with this rank's
    uncaught exceptions reported through it, and procckpt's own exits noted (failures.py)."""
    if not token:
        return None
    control = ctl.ControlChannel(control_dir, token)
    report_through(control, rank)
    note_exits(rank)
    return control
