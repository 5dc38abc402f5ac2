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
                                                <-  control/node-K.json {seq, ...}, a new seq
    after a failure, a node whose seq stands           every 2 s while its launcher lives
      still is lost (its pod, its machine)

A rank whose peer node vanished fails with a connection error, like a bug in the script; the
beats tell the two apart: a follower's launcher dies with its node.

``launch`` names one start of the leader (a new pod, a rerun): a follower started after a
leader exited must not take that old exit for its own. The files live in the checkpoint dir's
``control/`` and are written as control.py writes (atomic, without following links).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .control import read_json, read_json_files, write_json

__all__ = ["LEADER_FILE", "RUNNING", "BETWEEN", "EXITED", "LeaderBoard", "SilentNode",
           "read_leader", "ask_stop", "stop_requests", "stop_name", "beat", "read_beats",
           "BEAT_EVERY", "NODE_SILENT"]

LEADER_FILE = "leader.json"
STOP_PREFIX = "stop-"
NODE_PREFIX = "node-"

#: How often a follower's launcher says it lives, and how long a silence means its node is
#: gone: several beats, so that a slow shared file system is not taken for a lost node.
BEAT_EVERY = 2.0
NODE_SILENT = 15.0
LOOK_EVERY = 0.5

RUNNING = "running"  # the cycle ``token`` runs
BETWEEN = "between"  # the cycle ended; another may follow
EXITED = "exited"  # the leader is gone, with exit ``code``


@dataclass(frozen=True)
class SilentNode:
    """A follower whose launcher went silent: its node (pod, machine) is taken for lost."""

    node: int
    seconds: float

    def __str__(self) -> str:
        return (f"node {self.node} (its launcher has not been heard from for "
                f"{self.seconds:.0f}s)")


class LeaderBoard:
    """The leader's side: says what it runs, and hears whether the followers live.

    ``clock`` and ``sleep`` are seams for unit tests.
    """

    def __init__(self, control_dir: Path, nodes: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.dir = control_dir
        self.nodes = nodes
        self.launch = uuid.uuid4().hex
        self.token: str | None = None
        self._clock, self._sleep = clock, sleep
        #: Each follower's last beat seen, when (this clock) it was new, and whether it was seen
        #: to change (a beat seen once may be an old one).
        self._heard: dict[int, tuple[Any, float, bool]] = {}
        self._all_heard = False
        #: Each follower's beat at this launcher's first look, and when that was.
        self._first: tuple[dict[int, Any], float] | None = None

    def _say(self, state: str, **fields: Any) -> None:
        write_json(self.dir, LEADER_FILE, {"launch": self.launch, "nodes": self.nodes,
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

    def unheard(self, after: float = NODE_SILENT) -> list[int]:
        """The followers whose launcher has not beaten since the first look, once ``after``
        seconds have passed since it (a beat left by an earlier launch does not count);
        without waiting. Once every follower has been heard, the answer stays empty and
        control/ is not listed again."""
        if self._all_heard:
            return []
        beats, now = read_beats(self.dir), self._clock()
        if self._first is None:
            self._first = (beats, now)
        first, since = self._first
        if now - since < after:
            return []
        silent = [node for node in range(1, self.nodes)
                  if node not in beats or beats[node] == first.get(node)]
        self._all_heard = not silent
        return silent

    def silent_nodes(self, silence: float = NODE_SILENT) -> list[SilentNode]:
        """The followers whose launcher has not beaten for ``silence`` seconds: asked after
        the command failed or hung. Waits (at most ``silence``) until each follower has
        either beaten since the last look or stayed silent that long."""
        while True:
            now = self._clock()
            beats = read_beats(self.dir)
            silent, unsure = [], False
            for node in range(1, self.nodes):
                seq = beats.get(node)
                last = self._heard.get(node)
                if last is None:  # a beat seen for the first time may be an old one
                    self._heard[node] = last = (seq, now, False)
                elif last[0] != seq:
                    self._heard[node] = last = (seq, now, True)
                _, since, moved = last
                quiet = now - since
                if quiet >= silence:
                    silent.append(SilentNode(node, quiet))
                elif not moved or quiet >= 1.5 * BEAT_EVERY:
                    unsure = True  # wait for its next beat, or for the silence
            if not unsure:
                return silent
            self._sleep(LOOK_EVERY)


def read_leader(control_dir: Path) -> dict[str, Any] | None:
    """What the leader said last, or None if it said nothing (yet) or it cannot be read."""
    info = read_json(control_dir, LEADER_FILE)
    if info is None or info.get("state") not in (RUNNING, BETWEEN, EXITED):
        return None
    return info


def ask_stop(control_dir: Path, token: str, node: int, reason: str) -> None:
    """A follower asks the leader to checkpoint cycle ``token``, then stop it on every node."""
    write_json(control_dir, f"{STOP_PREFIX}{node}.json",
           {"token": token, "node": node, "reason": reason, "pid": os.getpid(),
            "time": time.time()})


def beat(control_dir: Path, node: int, seq: int) -> None:
    """A follower's launcher says it lives (``seq`` counts up); not synced: only the beats'
    coming matters, and a lost one is replaced 2 s later."""
    write_json(control_dir, f"{NODE_PREFIX}{node}.json",
           {"node": node, "seq": seq, "pid": os.getpid(), "host": socket.gethostname(),
            "time": time.time()}, durable=False)


def read_beats(control_dir: Path) -> dict[int, Any]:
    """Each follower's newest beat (its ``seq``), by node."""
    return {info["node"]: (info.get("pid"), info.get("seq"))
            for info in read_json_files(control_dir, NODE_PREFIX)
            if isinstance(info.get("node"), int)}


def stop_requests(control_dir: Path, token: str) -> list[dict[str, Any]]:
    """What followers asked of cycle ``token``, by node."""
    return [r for r in read_json_files(control_dir, STOP_PREFIX) if r.get("token") == token]


def stop_name(requests: list[dict[str, Any]]) -> str | None:
    """The first of ``requests`` (:func:`stop_requests`) in words ("SIGTERM on node 1")."""
    if not requests:
        return None
    return f"{requests[0].get('reason')} on node {requests[0].get('node')}"
