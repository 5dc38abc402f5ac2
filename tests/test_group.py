"""A run on several nodes, each with its launcher (protocol/group.py, launcher/follower.py): the
leader's word and a follower's part of each cycle, driven through the seams with a fake clock
and a fake command, on a real checkpoint dir. tests/e2e/test_pods.py runs two real launchers
and a two-node torchrun group."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from procckpt.launcher.config import RunConfig
from procckpt.launcher.follower import Follower
from procckpt.launcher.results import ExitReason
from procckpt.protocol import group
from procckpt.store import CheckpointStore

from .test_supervisor import Cycle, supervise


class Part:
    """This node's part of the command: runs until stopped, or exits at ``exits_at``."""

    pid = 777

    def __init__(self, clock: list[float], env: dict[str, str], exits_at: float | None) -> None:
        self.clock, self.env, self.exits_at = clock, env, exits_at
        self.started: float | None = None
        self.signals: list[int] = []
        self.code: int | None = None

    def start(self) -> None:
        self.started = self.clock[0]

    def poll(self) -> int | None:
        if self.code is None and self.exits_at is not None and self.started is not None \
                and self.clock[0] - self.started >= self.exits_at:
            self.code = 0
        return self.code

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> int:
        self.signals.append(signal.SIGTERM)
        self.code = 128 + signal.SIGTERM
        return self.code

    def kill_leftovers(self, timeout: float = 5.0) -> None:
        pass


def follow(tmp_path: Path, script: dict[float, Callable[[], object]],
           exits_at: float | None = None, signals: dict[float, int] | None = None,
           leader_wait: float = 600.0) -> tuple[object, list[Part], CheckpointStore]:
    """Run node 1's follower; ``script`` acts at those (fake) times, as node 0 would."""
    store = CheckpointStore(tmp_path / "ckpt").open()
    clock = [0.0]
    parts: list[Part] = []
    pending = dict(sorted(script.items()))
    signals = dict(signals or {})

    def wait(timeout: float) -> list[int]:
        clock[0] += timeout
        for at in [t for t in pending if t <= clock[0]]:
            pending.pop(at)()
        return [signals.pop(at) for at in [t for t in signals if t <= clock[0]]]

    def part(argv: list[str], env: dict[str, str]) -> Part:
        parts.append(Part(clock, env, exits_at))
        return parts[-1]

    config = RunConfig(command=["torchrun", "train.py"], dir=store.root, nodes=2, node_rank=1)
    follower = Follower(config, store, leader_wait=leader_wait, clock=lambda: clock[0],
                        child_factory=part, wait_signals=wait)
    return follower.run(), parts, store


def test_a_follower_runs_each_cycle_of_the_leader_with_its_env_and_exits_with_it(
        tmp_path: Path):
    board = group.LeaderBoard(tmp_path / "ckpt" / "control", nodes=2)
    env = {"PROCCKPT_TOKEN": "t1", "PROCCKPT_RESTART": "0"}
    result, parts, _ = follow(tmp_path, {
        5: lambda: board.running("t1", 1, env),
        50: board.between,  # the cycle's ranks stop at the same step: this one's part too
        51: lambda: board.running("t2", 2, {**env, "PROCCKPT_TOKEN": "t2"}),
        90: lambda: board.exited(75, "checkpointed after SIGTERM"),
    }, exits_at=44)
    assert result.exit_code == 75 and result.reason is ExitReason.CHECKPOINTED
    assert "node 0 exited with 75 (checkpointed after SIGTERM)" in result.message
    assert [p.env["PROCCKPT_TOKEN"] for p in parts] == ["t1", "t2"]
    assert [p.started for p in parts] == [5.0, 51.0]
    assert all(p.signals == [] for p in parts)  # each exited by itself


def test_a_part_that_outlives_its_cycle_is_stopped(tmp_path: Path):
    board = group.LeaderBoard(tmp_path / "ckpt" / "control", nodes=2)
    result, parts, _ = follow(tmp_path, {
        1: lambda: board.running("t1", 1, {"PROCCKPT_TOKEN": "t1"}),
        20: lambda: board.exited(1, "the command failed with exit code 1"),
    })
    assert parts[0].signals == [signal.SIGTERM]
    assert parts[0].code is not None
    assert result.exit_code == 1 and result.reason is ExitReason.FAILED


def test_an_old_leaders_exit_is_not_taken_for_the_new_ones(tmp_path: Path):
    CheckpointStore(tmp_path / "ckpt").open()
    old = group.LeaderBoard(tmp_path / "ckpt" / "control", nodes=2)
    old.exited(75, "checkpointed")  # the pods before these ones
    result, parts, _ = follow(tmp_path, {}, leader_wait=30)
    assert parts == []
    assert result.exit_code == 75
    assert "the launcher of node 0 started no cycle for 30" in result.message


def test_a_signal_to_a_follower_asks_the_leader_to_stop_every_node(tmp_path: Path):
    board = group.LeaderBoard(tmp_path / "ckpt" / "control", nodes=2)
    result, parts, store = follow(tmp_path, {
        1: lambda: board.running("t1", 1, {"PROCCKPT_TOKEN": "t1"}),
        30: lambda: board.exited(75, "checkpointed after SIGTERM on node 1"),
    }, exits_at=25, signals={10: signal.SIGTERM})
    asked = group.stop_requests(store.control_dir, "t1")
    assert [(a["node"], a["reason"]) for a in asked] == [(1, "SIGTERM")]
    assert parts[0].signals == []  # its ranks stop when node 0's checkpoint says so
    assert result.exit_code == 75


def test_the_leader_says_what_runs_and_stops_every_node_when_a_follower_asks(tmp_path: Path):
    control = tmp_path / "ckpt" / "control"
    seen: list[dict] = []

    def follower_asks() -> None:
        leader = group.read_leader(control)
        seen.append(leader)
        group.ask_stop(control, leader["token"], 1, "SIGTERM")

    world, result, _ = supervise(tmp_path, [Cycle(step=10)], time_limit=None, interval=None,
                                 nodes_count=2, at={30.0: follower_asks})
    assert seen[0]["state"] == group.RUNNING and seen[0]["env"]["PROCCKPT_TOKEN"]
    assert seen[0]["env"]["PROCCKPT_DIR"] == str(world.store.root)
    assert [(round(t), action, reason) for t, action, reason in world.requests] == \
        [(30, "stop", "SIGTERM on node 1")]
    assert result.exit_code == 75
    final = group.read_leader(control)
    assert final["state"] == group.EXITED and final["code"] == 75
