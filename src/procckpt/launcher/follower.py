"""``procckpt run --nodes N --node-rank K``, K > 0: run this node's part of each of the leader's
cycles (protocol/group.py).

The leader (node 0) is an ordinary launcher: it holds the checkpoint dir's lock, asks for the
checkpoints, decides on restarts. A follower only mirrors its cycles: it starts the command
with the environment of the cycle the leader runs, so that its ranks join the same checkpoint
requests; it stops the command if it outlives the cycle; and it exits when the leader exits,
with the leader's code. A stop signal here (the pod's SIGTERM) becomes a request to the leader:
every node checkpoints, then stops. Every 2 s it says it lives, so that the leader can tell a
rank that failed because this node vanished from one that failed by itself.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ..durations import format_duration
from ..errors import EX_TEMPFAIL
from ..protocol import group
from ..store import CheckpointStore
from .child import Child
from .config import RunConfig
from .loop import RunLoop
from .results import ExitReason, RunResult
from .signals import HANDLED_SIGNALS, Action, SignalPipe, signal_actions
from .watch import EXIT_AFTER_CONFIRM

__all__ = ["Follower", "LEADER_WAIT"]

logger = logging.getLogger(__name__)

#: How long a follower waits for the leader's first (or next) cycle before it gives up.
LEADER_WAIT = 600.0
#: How often it looks at what the leader says.
LOOK_EVERY = 0.5


class Follower(RunLoop):
    """Runs node ``config.node_rank``'s part of a run led by node 0's launcher.

    ``clock``, ``child_factory`` and ``wait_signals`` are seams for unit tests, as in the
    supervisor.
    """

    def __init__(self, config: RunConfig, store: CheckpointStore, *,
                 leader_wait: float = LEADER_WAIT,
                 clock: Callable[[], float] = time.monotonic,
                 child_factory: Callable[..., Child] = Child,
                 wait_signals: Callable[[float], list[int]] | None = None) -> None:
        self.config = config
        self.store = store
        self.node = config.node_rank
        self.leader_wait = leader_wait
        self._clock = clock
        self._child_factory = child_factory
        self._wait = wait_signals
        self._actions = signal_actions(config.checkpoint_signal)
        self._signals = SignalPipe((*HANDLED_SIGNALS,
                                    getattr(signal, f"SIG{config.checkpoint_signal}")))
        #: The leader's launches seen running, and the cycles (tokens) this node ran.
        self._launches: set[str] = set()
        self._ran: set[str] = set()
        #: The signal that asked this node to stop, once one did.
        self.stopped_by: str | None = None
        self.cycles = 0
        self._beats = 0
        self._last_beat: float | None = None
        self._beat_failed = False

    def _run(self) -> RunResult:
        logger.info("node %d of %d: following the launcher of node 0 through %s", self.node,
                    self.config.nodes, self.store.control_dir)
        waiting_since = self._clock()
        while True:
            self._beat()
            if self.store.completion():
                return self._end(ExitReason.FINISHED, "training finished")
            leader = group.read_leader(self.store.control_dir) or {}
            state = leader.get("state")
            if state in (group.RUNNING, group.BETWEEN):
                self._launches.add(str(leader.get("launch")))
            if state == group.RUNNING and leader.get("token") not in self._ran:
                if self.stopped_by is not None:
                    return self._stopped()
                self._run_cycle(leader)
                waiting_since = self._clock()
                continue
            if state == group.EXITED and str(leader.get("launch")) in self._launches:
                return self._leader_exited(leader)
            if self.stopped_by is not None and state != group.RUNNING:
                return self._stopped()
            waited = self._clock() - waiting_since
            if waited >= self.leader_wait:
                return self._end(ExitReason.CHECKPOINTED,
                                 f"node {self.node}: the launcher of node 0 started no cycle "
                                 f"for {format_duration(waited)} (is it running, with the same "
                                 f"--dir {self.store.root} on shared storage?); run the same "
                                 "command again to resume")
            for signum in self._wait(LOOK_EVERY):  # type: ignore[misc]
                self._on_signal(signum, None, None)

    def _run_cycle(self, leader: dict[str, Any]) -> None:
        token = str(leader["token"])
        self._ran.add(token)
        self.cycles += 1
        cycle = leader.get("cycle")
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (leader.get("env") or {}).items()})
        child = self._child_factory(self.config.command, env)
        child.start()
        logger.info("node %d: cycle %s: started %s (pid %d)", self.node, cycle,
                    " ".join(self.config.command), child.pid)
        over_at: float | None = None  # when the leader's cycle was seen to be over
        while True:
            self._beat()
            for signum in self._wait(LOOK_EVERY):  # type: ignore[misc]
                self._on_signal(signum, child, token)
            rc = child.poll()
            if rc is not None:
                child.kill_leftovers()
                logger.info("node %d: cycle %s: the command exited with %d", self.node, cycle,
                            rc)
                return
            now = self._clock()
            if over_at is None:
                now_leader = group.read_leader(self.store.control_dir)
                if now_leader is None or now_leader.get("token") != token \
                        or now_leader.get("state") != group.RUNNING:
                    over_at = now
            elif now - over_at >= EXIT_AFTER_CONFIRM:
                logger.warning("node %d: cycle %s is over on node 0 but the command here still "
                               "runs %s later; stopping it", self.node, cycle,
                               format_duration(now - over_at))
                child.stop(term_timeout=self.config.term_timeout)
                return

    def _beat(self) -> None:
        """Say that this node lives, every :data:`group.BEAT_EVERY` seconds."""
        now = self._clock()
        if self._last_beat is not None and now - self._last_beat < group.BEAT_EVERY:
            return
        self._last_beat = now
        self._beats += 1
        try:
            group.beat(self.store.control_dir, self.node, self._beats)
        except OSError as e:
            if not self._beat_failed:  # once: it is retried every beat
                logger.warning("node %d: cannot write its beat in %s (%s): node 0 will take "
                               "this node for lost if its command fails", self.node,
                               self.store.control_dir, e.strerror or e)
            self._beat_failed = True
        else:
            self._beat_failed = False

    def _on_signal(self, signum: int, child: Child | None, token: str | None) -> None:
        action = self._actions.get(signum)
        name = signal.Signals(signum).name
        if action is Action.FORWARD:
            if child is not None:
                child.signal(signum)
            return
        if action not in (Action.CHECKPOINT_STOP, Action.INTERRUPT):
            return
        if self.stopped_by is not None:
            if action is Action.INTERRUPT and child is not None:
                logger.warning("node %d: second stop (%s): killing the command now", self.node,
                               name)
                child.kill_leftovers()
            return
        self.stopped_by = name
        if token is None:
            leader = group.read_leader(self.store.control_dir) or {}
            if leader.get("state") in (group.RUNNING, group.BETWEEN) and leader.get("token") \
                    and str(leader.get("launch")) in self._launches:
                # Between two cycles (or before this node's part of one started): node 0 must
                # not go on with a cycle this node's ranks will not join.
                logger.info("node %d: %s: no cycle runs here; asking node 0 to stop every "
                            "node", self.node, name)
                self._ask_stop(str(leader["token"]), name, None)
            else:
                logger.info("node %d: %s: no cycle runs here; exiting", self.node, name)
            return
        # The ranks here stop with the others once node 0 has asked them for the checkpoint;
        # a signal to them directly would cut their part of the checkpoint short.
        logger.info("node %d: %s: asking node 0 for a checkpoint, then a stop of every node",
                    self.node, name)
        self._ask_stop(token, name, child)

    def _ask_stop(self, token: str, name: str, child: Child | None) -> None:
        """Ask node 0 to checkpoint and stop cycle ``token`` on every node; where that cannot
        be written, stop this node's part of the command (``child``) here."""
        try:
            group.ask_stop(self.store.control_dir, token, self.node, name)
        except OSError as e:
            logger.warning("node %d: could not ask node 0 to stop (%s); stopping the command "
                           "here", self.node, e.strerror or e)
            if child is not None:
                child.stop(term_timeout=self.config.term_timeout)

    def _leader_exited(self, leader: dict[str, Any]) -> RunResult:
        code = leader.get("code")
        code = code if isinstance(code, int) else EX_TEMPFAIL
        said = f"node {self.node}: node 0 exited with {code} ({leader.get('message', '')})"
        if code == 0:
            return self._end(ExitReason.FINISHED if self.store.completion()
                             else ExitReason.REQUEUED, said)
        if code == EX_TEMPFAIL:
            return self._end(ExitReason.CHECKPOINTED, said)
        return self._end(ExitReason.FAILED, said, error=True, command_code=code)

    def _stopped(self) -> RunResult:
        return self._end(ExitReason.CHECKPOINTED,
                         f"node {self.node}: stopped after {self.stopped_by}; run the same "
                         "command again to resume")
