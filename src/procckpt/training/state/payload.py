"""The hooks engine's checkpoint file: what ``state.pt`` holds, loaded back into the statefuls.

``state.pt`` is one ``torch.save`` of plain containers, tensors, numbers and strings, so that
it loads with ``torch.load(weights_only=True)``::

    {"format": 1,
     "statefuls": {name: state_dict(), ...},      # model, optimizer, scheduler, ...
     "progress": {"epoch", "batch", "step", "best_metric", "loader",  # loader: its shape
                  "epoch_samples_before"?},  # after a resume with another world size
     "rng": {...}, "epoch_rng": {...} | None,     # see progress.py
     "extras": {...}}                             # the script's own small values
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ...errors import ProcckptError, UsageError
from ...store import CheckpointInfo
from ..save.frozen import resolve_chunks
from .mapped import detach_from_file

__all__ = ["PAYLOAD", "PAYLOAD_FORMAT", "Stateful", "build_payload", "checkpoint_meta",
           "read_payload", "load_statefuls", "collect_statefuls", "is_framework"]

PAYLOAD = "state.pt"
PAYLOAD_FORMAT = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


def collect_statefuls(**given: Stateful | None) -> dict[str, Stateful]:
    """The statefuls a Checkpointer was given, by name, without the ones left out (None).

    Raises:
        TypeError: one of them has no ``state_dict()``/``load_state_dict()``.
    """
    statefuls = {name: obj for name, obj in given.items() if obj is not None}
    for name, obj in statefuls.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}={obj!r} has no state_dict()/load_state_dict()")
    return statefuls


def build_payload(statefuls: Mapping[str, Stateful], progress: dict[str, Any],
                  streams: dict[str, Any], extras: dict[str, Any],
                  exclude: set[str] | None = None) -> dict[str, Any]:
    """The replicated state (rank 0's in a group), without the ``exclude`` statefuls.

    Raises:
        ProcckptError: ``extras`` holds a value a ``weights_only`` load could not read back.
    """
    if "loader_state" in streams:
        _checked(streams["loader_state"], "the data loader's state_dict()")
    payload = {
        "format": PAYLOAD_FORMAT,
        "statefuls": {name: obj.state_dict() for name, obj in statefuls.items()
                      if not (exclude and name in exclude) and not is_framework(obj)},
        "progress": progress,
        **streams,
        "extras": _checked(extras, "extras"),
    }
    for name, obj in statefuls.items():
        if is_framework(obj) and not (exclude and name in exclude):
            outer = _checked(obj.state_dict(), f"the {name} checkpoint")
            clash = sorted(set(outer) & set(payload))
            if clash:
                raise ProcckptError(f"the {name} checkpoint has keys procckpt uses itself: "
                                    f"{', '.join(map(str, clash))}")
            payload.update(outer)
    return payload


def is_framework(obj: object) -> bool:
    """Whether ``obj``'s ``state_dict()`` is a framework's whole checkpoint (Lightning's):
    its keys go at the top of ``state.pt`` beside procckpt's, so that the framework loads
    the file with its own tools, and procckpt never loads it back (the framework does)."""
    return getattr(obj, "procckpt_framework", False) is True


def checkpoint_meta(position: tuple[int, int, int], reason: str, restart: int,
                    metric: float | None, metric_mode: str) -> dict[str, Any]:
    """What the manifest says about a hooks checkpoint, besides its files."""
    epoch, batch, step = position
    return {
        "step": step, "epoch": epoch, "batch": batch, "reason": reason,
        "engine": "hooks", "torch": torch.__version__, "restart": restart,
        "job_id": _job_id(), "metric": metric, "metric_mode": metric_mode,
        "python": sys.version.split()[0], "host": socket.gethostname(),
    }


def read_payload(info: CheckpointInfo, mmap: bool = False) -> dict[str, Any]:
    """``state.pt`` of ``info``, with the tensors of its chunks put back (save/frozen.py);
    ``weights_only``, so safe even before its checksum is verified.

    Raises:
        ValueError: the file is not a procckpt hooks checkpoint, or a chunk is damaged.
        CheckpointReadError: a chunk could not be read.
    """
    payload = torch.load(info.file(PAYLOAD), map_location="cpu", weights_only=True, mmap=mmap)
    if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
        raise ValueError("it is not a procckpt hooks checkpoint")
    return resolve_chunks(payload, info.chunk_store, info.chunks)


def load_statefuls(info: CheckpointInfo, payload: dict[str, Any],
                   statefuls: Mapping[str, Stateful],
                   prints: dict[int, tuple[int, int]] | None = None) -> int:
    """Load every stateful that is not sharded from a (possibly memory-mapped) payload;
    ``prints``, where given, gets the fingerprints of the tensors the load copied out of the
    payload (mapped.py, ``detach_from_file``). Returns how many bytes of those copies went
    over what the optimizers held before (memory touched already).

    Raises:
        ProcckptError: the checkpoint has no state for one of them (another script wrote it).
    """
    states = payload["statefuls"]
    sharded = set(info.manifest.get("sharded") or [])
    statefuls = {name: obj for name, obj in statefuls.items() if not is_framework(obj)}
    missing = sorted(set(statefuls) - set(states) - sharded)
    if missing:
        raise ProcckptError(
            f"checkpoint {info.name} in {info.path.parent.parent} has no state for "
            f"{', '.join(missing)}: it was written by another script or other Checkpointer "
            "arguments; use a new dir")
    # What the optimizers hold now: their loads replace it, and its memory can take the copies.
    displaced = [t for name, obj in statefuls.items()
                 if name not in sharded and isinstance(obj, torch.optim.Optimizer)
                 for state in obj.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor)]
    for name, obj in statefuls.items():
        if name not in sharded:
            try:
                obj.load_state_dict(states[name])
            except (RuntimeError, KeyError, ValueError, TypeError) as e:
                raise UsageError(
                    f"the {name} saved in checkpoint {info.name} does not fit this script's "
                    f"{name} ({_first_problem(e)}): the script changed since it was saved; run "
                    "the script that wrote it, or use a new dir to start over") from e
    # Nothing may keep pointing into the mapped file (see detach_from_file). Sharded state
    # came through DCP, not from this file (and holds DTensors, which have no storage of
    # their own to compare).
    return detach_from_file(payload, [obj for name, obj in statefuls.items()
                                      if name not in sharded], displaced, prints).written_over


def _first_problem(error: BaseException) -> str:
    """The first line of a ``load_state_dict`` error that names a problem, and how many more
    there are (torch lists every mismatched tensor on a line of its own)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    if not lines:
        return type(error).__name__
    first = lines[0].rstrip(".")
    return first if len(lines) == 1 else f"{first}; and {len(lines) - 1} more"


def _checked(value: dict[str, Any], what: str) -> dict[str, Any]:
    """Refuse a value that a weights_only load could not read back (``what`` names it)."""
    def check(value: Any, where: str) -> None:
        if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
            return
        if isinstance(value, bytes):  # torch.save writes b"" as a call weights_only refuses
            if value:
                return
            raise ProcckptError(f"{what}{where} is an empty bytes, which a weights_only load "
                                "cannot read back: use None for no bytes")
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{where}[{i}]")
            return
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, (str, int)):
                    raise ProcckptError(f"{what}{where}: key {k!r} must be a str or int")
                check(v, f"{where}[{k!r}]")
            return
        raise ProcckptError(
            f"{what}{where} is a {type(value).__name__}; checkpoints hold only tensors, "
            "numbers, strings, bytes, None, lists and dicts (so that they load with "
            "weights_only=True)"
        )

    check(value, "")
    return value


def _job_id() -> str | None:
    job = os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{job}_{task}" if job and task else job
