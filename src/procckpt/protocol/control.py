"""The launcher <-> training-process protocol.

The launcher never signals the training process to ask for a checkpoint: a signal does not
cross ``torchrun`` or ``srun`` intact (torchrun turns SIGTERM into killing its workers, NCCL
owns SIGUSR1, DMTCP SIGUSR2), and it cannot reach ranks on other nodes. Instead it writes a
small request file into ``DIR/control/``, which every process of the run can see, and the
training process polls it at its safe points: a ``stat`` every few hundred milliseconds.

    launcher                                   training process (procckpt.Checkpointer)
    --------                                   ----------------------------------------
    env PROCCKPT_TOKEN=<cycle token>    ->     writes control/hello-<token>.json at start
                                        <-     control/heartbeat.json {token, step, moves,
                                               gap, time}, at most every second while the
                                               step or the training thread moves
    control/request.json {seq, action}  ->     at the next safe point: save (and exit)
                                        <-     control/ack.json {token, seq, checkpoint, stopping}
    SIGURG to the process group         ->     every Python process prints its stacks (hangs)

Every file carries the token of the launcher cycle it belongs to, so a leftover request or
ack from an earlier cycle or job is never mistaken for a current one.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..store import write_file_atomic

__all__ = ["Request", "Ack", "Heartbeat", "ControlChannel", "ENV_TOKEN", "ENV_DIR", "ENV_RESTART",
           "ENV_CYCLE", "ENV_ENGINE", "STACK_DUMP_SIGNAL"]

ENV_TOKEN = "PROCCKPT_TOKEN"
ENV_DIR = "PROCCKPT_DIR"
ENV_RESTART = "PROCCKPT_RESTART"
ENV_CYCLE = "PROCCKPT_CYCLE"
ENV_ENGINE = "PROCCKPT_ENGINE_IN_USE"  # the engine procckpt run checkpoints the command with
ENV_STOP_EXIT = "PROCCKPT_STOP_EXIT_CODE"

#: Asks every process of the training to print its Python stacks (``faulthandler``). Its default
#: action is to be ignored, so processes that did not register for it (torchrun's agent, a
#: shell, the keeper) are not harmed by it; nothing else here sends it.
STACK_DUMP_SIGNAL = signal.SIGURG

ACTION_CHECKPOINT = "checkpoint"  # save and go on training
ACTION_STOP = "stop"  # save, then exit


@dataclass(frozen=True)
class Request:
    token: str
    seq: int
    action: str
    reason: str
    time: float


@dataclass(frozen=True)
class Ack:
    token: str
    seq: int
    checkpoint: str | None
    step: int | None
    stopping: bool
    error: str | None = None
    time: float = 0.0


@dataclass(frozen=True)
class Heartbeat:
    """The training's last word that it is making progress: the step it reached, how often
    it was seen to move (training/liveness.py), the longest stretch between two of its safe
    points so far, and when."""

    step: int
    time: float  # wall clock, seconds since the epoch
    moves: int = 0
    gap: float = 0.0


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class ControlChannel:
    """Both ends of the protocol over one ``control/`` directory."""

    def __init__(self, control_dir: Path, token: str) -> None:
        self.dir = control_dir
        self.token = token
        self.request_path = control_dir / "request.json"
        self.ack_path = control_dir / "ack.json"
        self.heartbeat_path = control_dir / "heartbeat.json"
        self._seen: tuple[int, int] | None = None
        self._last_seq = 0
        self._beat_seen: tuple[int, int] | None = None
        self._beat: Heartbeat | None = None

    # launcher side -------------------------------------------------------------------------
    def send(self, seq: int, action: str, reason: str) -> Request:
        req = Request(self.token, seq, action, reason, time.time())
        write_file_atomic(self.request_path, json.dumps(asdict(req)).encode())
        return req

    def read_ack(self) -> Ack | None:
        data = _read_json(self.ack_path)
        if not data or data.get("token") != self.token:
            return None
        try:
            return Ack(**data)
        except TypeError:
            return None

    def hello(self) -> dict[str, Any] | None:
        """What the training process said when it started in this cycle, if it did."""
        return _read_json(self.dir / f"hello-{self.token}.json")

    def heartbeat(self) -> Heartbeat | None:
        """The newest heartbeat of this cycle's training, if it sent one. Cheap when nothing
        changed (a ``stat``)."""
        try:
            st = self.heartbeat_path.stat()
        except FileNotFoundError:
            return self._beat
        key = (st.st_ino, st.st_mtime_ns)
        if key != self._beat_seen:
            self._beat_seen = key
            data = _read_json(self.heartbeat_path)
            if data and data.get("token") == self.token:
                try:
                    self._beat = Heartbeat(int(data["step"]), float(data["time"]),
                                           int(data.get("moves", 0)),
                                           float(data.get("gap", 0.0)))
                except (KeyError, TypeError, ValueError):
                    pass
        return self._beat

    def clear(self) -> None:
        for p in self.dir.glob("*.json"):
            try:
                p.unlink()
            except OSError:
                pass

    # training-process side -----------------------------------------------------------------
    def say_hello(self, **fields: Any) -> None:
        info = {"pid": os.getpid(), "time": time.time(), **fields}
        write_file_atomic(self.dir / f"hello-{self.token}.json", json.dumps(info).encode())

    def beat(self, step: int, moves: int = 0, gap: float = 0.0) -> None:
        """Say that ``step`` was reached, the training moved ``moves`` times and went ``gap``
        seconds at most between safe points (not fsynced: it only says how things are now)."""
        info = {"token": self.token, "step": step, "moves": moves, "gap": gap,
                "time": time.time()}
        write_file_atomic(self.heartbeat_path, json.dumps(info).encode(), durable=False)

    def poll(self) -> Request | None:
        """Return a new request for this cycle, or None. Cheap when nothing changed."""
        try:
            st = self.request_path.stat()
        except FileNotFoundError:
            return None
        # Each request is renamed into place, so a new one has a new inode even when the
        # filesystem's clock did not tick between two writes.
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._seen:
            return None
        self._seen = key
        data = _read_json(self.request_path)
        if not data or data.get("token") != self.token:
            return None
        try:
            req = Request(**data)
        except TypeError:
            return None
        if req.seq <= self._last_seq:
            return None
        self._last_seq = req.seq
        return req

    def acknowledge(self, ack: Ack) -> None:
        write_file_atomic(self.ack_path, json.dumps(asdict(ack)).encode())
