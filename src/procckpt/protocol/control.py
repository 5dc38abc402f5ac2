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
                                        <-     control/failed-<rank>.json {token, rank, host,
                                               error}: an exception ends this rank
    SIGURG to the process group         ->     every Python process prints its stacks (hangs)

Every file carries the token of the launcher cycle it belongs to, so a leftover request or
ack from an earlier cycle or job is never mistaken for a current one.

Every file is reached through the directory opened without following a link, created without
following one, and read only when it is a regular file, without blocking and at most
:data:`MAX_CONTROL_FILE` bytes: a FIFO or a link planted in ``control/`` (or ``control/``
replaced by a link) can neither stall the launcher nor send a write elsewhere. What cannot be
read counts as absent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Request", "Ack", "Heartbeat", "ControlChannel", "ENV_TOKEN", "ENV_DIR", "ENV_RESTART",
           "ENV_CYCLE", "ENV_ENGINE", "ENV_CHECK", "ENV_RECOVERY", "CHECK_UNSAVED",
           "keep_unsaved_advice",
           "STACK_DUMP_SIGNAL", "ENV_AUDIT", "ENV_TIER", "TIER_RANK_DIR", "AUDIT_MODES",
           "AUDIT_REFUSED"]

ENV_TOKEN = "PROCCKPT_TOKEN"
ENV_DIR = "PROCCKPT_DIR"
ENV_RESTART = "PROCCKPT_RESTART"
ENV_CYCLE = "PROCCKPT_CYCLE"
ENV_ENGINE = "PROCCKPT_ENGINE_IN_USE"  # the engine procckpt run checkpoints the command with
ENV_STOP_EXIT = "PROCCKPT_STOP_EXIT_CODE"
#: JSON, in a cycle started after a failure: when the launcher saw it fail ("seen") and when
#: it started this command ("spawned"), wall-clock (training/link/timing.py).
ENV_RECOVERY = "PROCCKPT_RECOVERY"
#: Set by ``procckpt check`` for its runs (JSON: where to stop, where to end, the trace).
ENV_CHECK = "PROCCKPT_CHECK"
#: In its traces: the parts that hold what the script keeps and no checkpoint does.
CHECK_UNSAVED = "unsaved."
#: The first-batch audit of a resume (training/audit.py): strict, warn (unset) or off.
ENV_AUDIT = "PROCCKPT_AUDIT"
#: The memory tier's directory (launcher/tier.py): the training keeps its newest state there.
ENV_TIER = "PROCCKPT_MEMORY_TIER_DIR"
#: In a group, each rank's slots inside that directory (training/group/tier.py writes them,
#: launcher/tier.py reads them).
TIER_RANK_DIR = "rank-{rank:05d}"
AUDIT_MODES = ("strict", "warn", "off")
#: What a rank that the audit stopped reports as its failure's kind (``report_failure``).
AUDIT_REFUSED = "ResumeAuditError"


def keep_unsaved_advice(names: list[str]) -> str:
    """How to keep ``names`` in the checkpoint: objects go to the Checkpointer, tensors to
    ``ckpt.extras``."""
    it = "it" if len(names) == 1 else "them"
    keep = ", ".join(f"{name}={name}" for name in names)
    extras = ", ".join(f"ckpt.extras['{name}'] = {name}" for name in names)
    return (f"pass {it} to the Checkpointer (Checkpointer(..., {keep})), or, for tensors, "
            f"keep {it} in ckpt.extras ({extras}; take {it} from there after a resume)")


#: Asks every process of the training to print its Python stacks (``faulthandler``). Its default
#: action is to be ignored, so processes that did not register for it (torchrun's agent, a
#: shell, the keeper) are not harmed by it; nothing else here sends it.
STACK_DUMP_SIGNAL = signal.SIGURG

#: The longest control file read; the protocol's are a few hundred bytes.
MAX_CONTROL_FILE = 64 << 10

#: A rank ended by an exception writes ``failed-<rank>.json``, with this much of its error.
FAILURE_PREFIX = "failed-"
MAX_ERROR_TEXT = 500

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
    it was seen to move (training/link/liveness.py), the longest stretch between two of its safe
    points so far, and when."""

    step: int
    time: float  # wall clock, seconds since the epoch
    moves: int = 0
    gap: float = 0.0


@contextlib.contextmanager
def _opened_dir(path: Path) -> Iterator[int]:
    """A descriptor of directory ``path``, opened without following a link (ELOOP if it is
    one)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _read_in(dir_fd: int, name: str) -> bytes:
    """The content of regular file ``name`` in ``dir_fd`` (OSError for a link, a FIFO, a
    device), at most :data:`MAX_CONTROL_FILE` bytes."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        return os.read(fd, MAX_CONTROL_FILE)
    finally:
        os.close(fd)


def _write_in(dir_fd: int, name: str, data: bytes, durable: bool) -> None:
    """Replace ``name`` in ``dir_fd`` with ``data`` atomically (a new file renamed over it)."""
    tmp = f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        os.fsync(dir_fd)


def write_json(path: Path, name: str, info: dict[str, Any], durable: bool = True) -> None:
    """Replace ``name`` in directory ``path`` with ``info`` as JSON, without following links."""
    with _opened_dir(path) as fd:
        _write_in(fd, name, json.dumps(info).encode(), durable)


def read_json(path: Path, name: str) -> dict[str, Any] | None:
    """The JSON object in ``name`` in directory ``path``; None when it is missing, not a
    regular file, or not an object."""
    try:
        with _opened_dir(path) as fd:
            data = json.loads(_read_in(fd, name))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_json_files(path: Path, prefix: str) -> list[dict[str, Any]]:
    """The JSON objects in the files ``PREFIX*.json`` of directory ``path``, by name."""
    try:
        with _opened_dir(path) as fd:
            names = sorted(n for n in os.listdir(fd)
                           if n.startswith(prefix) and n.endswith(".json"))
    except OSError:
        return []
    found = (read_json(path, name) for name in names)
    return [data for data in found if data is not None]


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

    # files, each reached through the directory opened without following a link -------------
    def _write(self, name: str, info: dict[str, Any], durable: bool = True) -> None:
        write_json(self.dir, name, info, durable)

    def _read_json(self, name: str) -> dict[str, Any] | None:
        return read_json(self.dir, name)

    def _changed(self, name: str, seen: tuple[int, int] | None) -> tuple[int, int] | None:
        """The (inode, mtime) of ``name`` when it differs from ``seen`` (a ``stat`` of the
        entry itself); None when it is the same or gone."""
        try:
            with _opened_dir(self.dir) as fd:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns)
        return None if key == seen else key

    # launcher side -------------------------------------------------------------------------
    def send(self, seq: int, action: str, reason: str) -> Request:
        req = Request(self.token, seq, action, reason, time.time())
        self._write(self.request_path.name, asdict(req))
        return req

    def read_ack(self) -> Ack | None:
        data = self._read_json(self.ack_path.name)
        if not data or data.get("token") != self.token:
            return None
        try:
            return Ack(**data)
        except TypeError:
            return None

    def hello(self) -> dict[str, Any] | None:
        """What the training process said when it started in this cycle, if it did."""
        return self._read_json(f"hello-{self.token}.json")

    def heartbeat(self) -> Heartbeat | None:
        """The newest heartbeat of this cycle's training, if it sent one. Cheap when nothing
        changed (a ``stat``)."""
        key = self._changed(self.heartbeat_path.name, self._beat_seen)
        if key is not None:
            self._beat_seen = key
            data = self._read_json(self.heartbeat_path.name)
            if data and data.get("token") == self.token:
                try:
                    self._beat = Heartbeat(int(data["step"]), float(data["time"]),
                                           int(data.get("moves", 0)),
                                           float(data.get("gap", 0.0)))
                except (KeyError, TypeError, ValueError):
                    pass
        return self._beat

    def failures(self) -> list[dict[str, Any]]:
        """What the ranks of this cycle that ended in an exception said (:meth:`report_failure`),
        by rank."""
        return [f for f in read_json_files(self.dir, FAILURE_PREFIX)
                if f.get("token") == self.token]

    def clear(self) -> None:
        try:
            with _opened_dir(self.dir) as fd:
                for name in os.listdir(fd):
                    if name.endswith(".json"):
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=fd)
        except OSError:
            pass

    # training-process side -----------------------------------------------------------------
    def say_hello(self, **fields: Any) -> None:
        info = {"pid": os.getpid(), "time": time.time(), **fields}
        self._write(f"hello-{self.token}.json", info)

    def beat(self, step: int, moves: int = 0, gap: float = 0.0) -> None:
        """Say that ``step`` was reached, the training moved ``moves`` times and went ``gap``
        seconds at most between safe points (not fsynced: it only says how things are now)."""
        info = {"token": self.token, "step": step, "moves": moves, "gap": gap,
                "time": time.time()}
        self._write(self.heartbeat_path.name, info, durable=False)

    def report_failure(self, rank: int, error: str) -> None:
        """Say that an exception is ending this rank: the launcher of a group whose other ranks
        go on running (a peer that died with its node leaves them waiting) looks at the nodes."""
        info = {"token": self.token, "rank": rank, "host": socket.gethostname(),
                "pid": os.getpid(), "error": error[:MAX_ERROR_TEXT], "time": time.time()}
        self._write(f"{FAILURE_PREFIX}{rank}.json", info)

    def poll(self) -> Request | None:
        """Return a new request for this cycle, or None. Cheap when nothing changed."""
        # Each request is renamed into place, so a new one has a new inode even when the
        # filesystem's clock did not tick between two writes.
        key = self._changed(self.request_path.name, self._seen)
        if key is None:
            return None
        self._seen = key
        data = self._read_json(self.request_path.name)
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
        self._write(self.ack_path.name, asdict(ack))
