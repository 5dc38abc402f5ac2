"""Between the launchers of one run that spans nodes, each node starting its own part of the
command (Kubernetes pods of an Indexed Job; any cluster without srun).

The launcher of node 0, the leader, runs the cycles as on one node and says which one runs;
the launcher of every other node, a follower, starts its node's part of the command with that
cycle's environment and stops it once the cycle is over. A follower asked to stop (its pod's
SIGTERM) asks the leader for a checkpoint, then a stop of every node.

    leader                                          follower K
    ------                                          ----------
    control/leader.json {launch, state, token,  ->  starts its part with ``env`` when a cycle
      cycle, env, code, time}                       it has not run is "running"; stops it when
      state: running | between | exited             the cycle is no longer running
                                                <-  control/stop-K.json {token, node, reason}
    checkpoint, then stop: as after a SIGTERM

``launch`` names one start of the leader (a new pod, a rerun): a follower started after a
leader exited must not take that old exit for its own. The files live in the checkpoint dir's
``control/`` and are written as control.py writes (atomic, without following links).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from .control import _opened_dir, _read_in, _write_in

__all__ = ["LEADER_FILE", "RUNNING", "BETWEEN", "EXITED", "LeaderBoard", "read_leader",
           "ask_stop", "stop_requests"]

LEADER_FILE = "leader.json"
STOP_PREFIX = "stop-"

RUNNING = "running"  # the cycle ``token`` runs
BETWEEN = "between"  # the cycle ended; another may follow
EXITED = "exited"  # the leader is gone, with exit ``code``


def _write(control_dir: Path, name: str, info: dict[str, Any]) -> None:
    with _opened_dir(control_dir) as fd:
        _write_in(fd, name, json.dumps(info).encode(), durable=True)


def _read(control_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        with _opened_dir(control_dir) as fd:
            data = json.loads(_read_in(fd, name))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class LeaderBoard:
    """The leader's side: says what it runs."""

    def __init__(self, control_dir: Path, nodes: int) -> None:
        self.dir = control_dir
        self.nodes = nodes
        self.launch = uuid.uuid4().hex
        self.token: str | None = None

    def _say(self, state: str, **fields: Any) -> None:
        _write(self.dir, LEADER_FILE, {"launch": self.launch, "nodes": self.nodes,
                                       "state": state, "token": self.token,
                                       "time": time.time(), **fields})

    def running(self, token: str, cycle: int, env: dict[str, str]) -> None:
        self.token = token
        self._say(RUNNING, cycle=cycle, env=env)

    def between(self) -> None:
        self._say(BETWEEN)

    def exited(self, code: int, message: str) -> None:
        self._say(EXITED, code=code, message=message)

    def stop_requests(self) -> list[dict[str, Any]]:
        """What followers asked of the running cycle (:func:`ask_stop`), by node."""
        return stop_requests(self.dir, self.token) if self.token else []


def read_leader(control_dir: Path) -> dict[str, Any] | None:
    """What the leader said last, or None if it said nothing (yet) or it cannot be read."""
    info = _read(control_dir, LEADER_FILE)
    if info is None or info.get("state") not in (RUNNING, BETWEEN, EXITED):
        return None
    return info


def ask_stop(control_dir: Path, token: str, node: int, reason: str) -> None:
    """A follower asks the leader to checkpoint cycle ``token``, then stop it on every node."""
    _write(control_dir, f"{STOP_PREFIX}{node}.json",
           {"token": token, "node": node, "reason": reason, "pid": os.getpid(),
            "time": time.time()})


def stop_requests(control_dir: Path, token: str) -> list[dict[str, Any]]:
    try:
        with _opened_dir(control_dir) as fd:
            names = sorted(n for n in os.listdir(fd)
                           if n.startswith(STOP_PREFIX) and n.endswith(".json"))
    except OSError:
        return []
    found = (_read(control_dir, name) for name in names)
    return [r for r in found if r is not None and r.get("token") == token]
