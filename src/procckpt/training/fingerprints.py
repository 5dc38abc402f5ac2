"""The training side of ``procckpt check``: a fingerprint of the whole state after every step,
a stop in the middle, and an end after the steps to compare.

``procckpt check`` sets ``PROCCKPT_CHECK`` (JSON: ``end``, ``stop_at``, ``trace``) and runs the
script several times. At each safe point after a step the Checkpointer appends one line to the
trace file: the step, and a CRC-32 of each part of what a checkpoint would hold (every stateful,
each ``extras`` entry, each random stream, the position). At ``stop_at`` in a run that did not
resume, it checkpoints and exits as after a stop; at ``end`` it saves a checkpoint and exits 0,
so the runs can be compared bit for bit at the same step. (Every rank of a group runs the same
steps, so both saves happen at the same step everywhere, without the ranks' agreement.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Callable
from typing import Any

import torch

from ..protocol.control import CHECK_UNSAVED as UNSAVED
from ..protocol.control import ENV_CHECK, keep_unsaved_advice
from ..store.checksum import crc32
from .unsaved import HeldTensors, describe_unsaved, unsaved_statefuls

__all__ = ["ENV_CHECK", "CheckHook", "NoCheck", "check_hook", "fingerprints"]

logger = logging.getLogger(__name__)

#: What the check's checkpoints are recorded with: the stop in the middle, the last one.
STOP_REASON = "check-stop"
END_REASON = "check-end"


def fingerprints(payload: dict[str, Any],
                 entries: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
    """A CRC-32 per part of a checkpoint payload: ``statefuls.NAME``, ``extras.KEY``,
    ``rng.STREAM``, ``epoch_rng.STREAM``, ``loader_state``, ``progress``.

    A stateful's state dict is fingerprinted entry by entry (a model's ``wte.weight``, an
    optimizer's ``state``), its part's CRC taken over theirs; ``entries`` gets them, so that a
    difference can be named down to the tensor."""
    parts: dict[str, Any] = {}
    for group in ("statefuls", "extras", "rng", "epoch_rng"):  # epoch_rng: at the epoch's start
        for key, value in (payload.get(group) or {}).items():
            parts[f"{group}.{key}"] = value
    if payload.get("loader_state") is not None:  # a stateful loader's own
        parts["loader_state"] = payload["loader_state"]
    for key, value in payload.items():  # a framework's own checkpoint, beside procckpt's parts
        if key not in _PROCCKPT_KEYS:
            parts[f"framework.{key}"] = value
    progress = dict(payload.get("progress") or {})
    progress.pop("loader", None)  # its shape, not its position
    parts["progress"] = progress
    return {name: _part_crc(name, value, entries) for name, value in sorted(parts.items())}


#: A logger's run folder in a path (Lightning's ``lightning_logs/version_3``): each run of the
#: script opens the next one, so a framework's state (ModelCheckpoint's ``dirpath``, ``best
#: _model_path``) names another in every run, though the training is the same.
_LOG_VERSION = re.compile(r"(?<=[/\\])version_\d+(?=$|[/\\])")


def _without_log_versions(value: Any) -> Any:
    """``value`` with every logger's ``version_N`` in its strings written ``version_N``."""
    if isinstance(value, str):
        return _LOG_VERSION.sub("version_N", value)
    if isinstance(value, dict):  # (its type does not count: _crc sorts the keys)
        return {k: _without_log_versions(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_log_versions(v) for v in value]
    if type(value) is tuple:
        return tuple(_without_log_versions(v) for v in value)
    return value


def _part_crc(name: str, value: Any, entries: dict[str, dict[str, int]] | None) -> int:
    """One part's CRC; a stateful's state dict entry by entry, into ``entries``. A
    framework's own parts leave out the run folder its logger numbers anew in each run."""
    if name.startswith("framework."):
        value = _without_log_versions(value)
    if not (name.startswith(("statefuls.", "framework.")) and isinstance(value, dict) and value):
        return _crc(value)
    each = {key if isinstance(key, str) else repr(key): _crc(item)
            for key, item in value.items()}  # named in the state dict's order
    if entries is not None:
        entries[name] = each
    return zlib.crc32(json.dumps(each, sort_keys=True).encode())


#: The top-level keys of a payload that are procckpt's (payload.build_payload).
_PROCCKPT_KEYS = frozenset({"format", "statefuls", "progress", "extras", "rng", "epoch_rng",
                            "loader_state"})


def _crc(value: Any, crc: int = 0) -> int:
    if isinstance(value, torch.Tensor):
        local = getattr(value, "to_local", None)  # a DTensor: this rank's shard
        t = (local() if callable(local) else value).detach().cpu().contiguous()
        crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
        return crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)  # the buffer: no copy
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            crc = _crc(value[key], zlib.crc32(repr(key).encode(), crc))
        return crc
    if isinstance(value, (list, tuple)):
        for item in value:
            crc = _crc(item, crc)
        return zlib.crc32(type(value).__name__.encode(), crc)
    np = __import__("sys").modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return zlib.crc32(value.tobytes(), zlib.crc32(str(value.dtype).encode(), crc))
    return zlib.crc32(repr(value).encode(), crc)


class NoCheck:
    """Not under ``procckpt check``: nothing to record; after a resume, rank 0 says once which
    stateful objects of the script no checkpoint holds (training/unsaved.py). Tensors held in
    a variable count once training changed them again by the next safe point: a loop's
    variable bound to each new batch (which a DataLoader's worker wrote in place) does not."""

    #: A framework drives the loops and saves its own objects (training/driven.py).
    driven = False
    #: How a framework that writes its own files takes the check's stop (see CheckHook).
    stop_through: Callable[[str, int], None] | None = None
    compared: Callable[[], dict[str, Any]] | None = None

    def __init__(self) -> None:
        self._looked = False
        #: Held tensors found at the first safe point, confirmed (or not) at the next.
        self._held: dict[str, tuple[Any, str]] = {}

    def at_safe_point(self, ck: Any, epoch_end: bool, saves: bool = True,
                      defer: bool = False) -> None:
        if self._looked:
            if self._held:
                held, self._held = self._held, {}
                self._warn({name: found for name, found in held.items()
                            if found[0].changed_since_found()})
            return
        self._looked = True
        if ck.resumed_from is None or ck.rank != 0 or self.driven:
            return
        found = unsaved_statefuls(ck._statefuls, sys._getframe(1), ck.extras)
        self._held = {n: f for n, f in found.items() if isinstance(f[0], HeldTensors)}
        self._warn({n: f for n, f in found.items() if n not in self._held})

    @staticmethod
    def _warn(found: dict[str, tuple[Any, str]]) -> None:
        if found:
            logger.warning("resumed, but %s %s in no checkpoint, so %s afresh: if %s during "
                           "training, %s", describe_unsaved(found),
                           "is" if len(found) == 1 else "are",
                           "it starts" if len(found) == 1 else "they start",
                           "it changes" if len(found) == 1 else "they change",
                           keep_unsaved_advice(list(found)))


class CheckHook:
    """Under ``procckpt check``: records the trace, stops at ``stop_at``, ends at ``end``."""

    def __init__(self, end: int, stop_at: int | None, trace: str) -> None:
        self.end, self.stop_at, self.trace = end, stop_at, trace
        # What procckpt warns of in this run goes beside the check's verdict too (a warning
        # printed only in a run's own log is seen with --keep alone).
        rank = os.environ.get("RANK", "0").strip() or "0"
        warnings = logging.FileHandler(f"{trace}-warnings.{rank}", delay=True)
        warnings.setLevel(logging.WARNING)
        warnings.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("procckpt").addHandler(warnings)
        self._recorded: int | None = None
        self._deferred = False  # whether the step recorded last left its stop to the next point
        #: What the script holds beside its checkpoint (found at the first safe point): its
        #: state is recorded as ``unsaved.NAME`` and compared like the rest.
        self._unsaved: dict[str, tuple[Any, str]] | None = None
        self._unconfirmed: list[str] = []  # held tensors found, not yet seen changing again
        self.driven = False  # see NoCheck.driven
        #: Set by a framework whose checkpoint holds files it writes itself (the Trainer's):
        #: called with the stop's reason and exit code, it has the framework write them, then
        #: saves and ends the process with that code.
        self.stop_through: Callable[[str, int], None] | None = None
        #: Set by a framework that saves its model and optimizers in files of its own (the
        #: Trainer's): their states, compared with the rest as ``framework.NAME``.
        self.compared: Callable[[], dict[str, Any]] | None = None

    def at_safe_point(self, ck: Any, epoch_end: bool, saves: bool = True,
                      defer: bool = False) -> None:
        """Record the state after this step; ``saves``: whether this is a point where a
        checkpoint can be taken (a framework's loop skips an epoch's last batch): the check
        stops and resumes only at those. ``defer``: one can, at the next safe point of the
        same step (an epoch's last batch and the epoch's end): the stop waits for it."""
        step = ck.step
        if self._recorded is None and ck.resumed_from is not None:
            self._recorded = ck.resumed_from.step  # the stopped process recorded it
        if step == self._recorded:  # an epoch's end after its last step: nothing new,
            if saves and not defer and self._deferred:  # but the stop its last batch left
                self._deferred = False
                self._stop_or_end(ck, step, stops=True)
            return
        self._recorded, self._deferred = step, saves and defer
        if self._unsaved is None:
            self._unsaved = {} if self.driven else unsaved_statefuls(
                ck._statefuls, sys._getframe(1), ck.extras)
            self._unconfirmed = [name for name, (obj, _) in self._unsaved.items()
                                 if isinstance(obj, HeldTensors)]
        elif self._unconfirmed:  # the second step: held tensors are state if changed again
            for name in self._unconfirmed:
                if not self._unsaved[name][0].changed_since_found():
                    del self._unsaved[name]
            self._unconfirmed = []
        entries: dict[str, dict[str, int]] = {}
        parts = fingerprints(ck._payload(), entries)
        if self.compared is not None:
            parts.update({f"framework.{name}": _part_crc(f"framework.{name}", value, entries)
                          for name, value in self.compared().items()})
        parts.update({f"{UNSAVED}{name}": _crc(obj.state_dict())
                      for name, (obj, _) in self._unsaved.items()})
        line = {"step": step, "epoch": ck.epoch, "batch": ck.batch, "parts": parts,
                "entries": entries,
                **({} if saves else {"saves": False}),
                **({"unsaved": describe_unsaved(self._unsaved)} if self._unsaved else {})}
        with open(f"{self.trace}.{ck.rank}", "a") as f:  # every rank its own
            f.write(json.dumps(line) + "\n")
        self._stop_or_end(ck, step, stops=saves and not defer)

    def _stop_or_end(self, ck: Any, step: int, stops: bool) -> None:
        # Every rank of a group gets here at the same step: the saves below are collective.
        # At stop_at, or at the first point after it where a checkpoint can be taken (inside
        # a gradient accumulation it waits for the window's end; at an epoch's last batch,
        # for the epoch's end).
        if self.stop_at is not None and step >= self.stop_at and ck.resumed_from is None \
                and stops:
            if self.stop_through is not None:
                self.stop_through(STOP_REASON, ck._context.stop_exit_code)
                return
            ck.save(STOP_REASON)
            self.leave(ck, ck._context.stop_exit_code)
        elif step >= self.end:
            ck.save(END_REASON)
            self.leave(ck, 0)

    @staticmethod
    def leave(ck: Any, code: int) -> None:
        """End the process with ``code`` after the check's checkpoint."""
        ck._exiting = True
        ck.close()
        raise SystemExit(code)


def check_hook() -> CheckHook | NoCheck:
    """The hook ``PROCCKPT_CHECK`` asks for (the no-op one when it is unset)."""
    raw = os.environ.get(ENV_CHECK)
    if not raw:
        return NoCheck()
    spec = json.loads(raw)
    return CheckHook(int(spec["end"]), spec.get("stop_at"), str(spec["trace"]))
