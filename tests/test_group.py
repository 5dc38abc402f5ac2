"""A run on several nodes, each with its launcher (protocol/group.py, launcher/follower.py): the
leader's word and a follower's part of each cycle, driven through the seams with a fake clock
and a fake command, on a real checkpoint dir. tests/e2e/test_pods.py runs two real launchers
and a two-node torchrun group."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from procckpt.launcher.config import RunConfig
from procckpt.launcher.follower import Follower
from procckpt.launcher.results import ExitReason
from procckpt.protocol import group
from procckpt.protocol.events import read_events
from procckpt.store import CheckpointStore

from .test_supervisor import Cycle, supervise

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


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


@pytest.mark.parametrize("asked_at", [92.5, 93.5],
                         ids=["a-look-before-its-exit", "with-its-exit"])
def test_a_follower_asking_while_the_deadlines_stop_is_taken_ends_the_run_instead_of_a_restart(
        tmp_path: Path, asked_at: float):
    # The deadline's stop is asked at 90 and confirmed at 91; the command exits at 94. Node
    # 1's pod gets its SIGTERM meanwhile (the failure of a slowed run of tests/e2e/test_pods.py:
    # the leader restarted, and its next cycle waited for a node whose launcher had gone).
    control = tmp_path / "ckpt" / "control"

    def follower_asks() -> None:
        group.ask_stop(control, group.read_leader(control)["token"], 1, "SIGTERM")

    world, result, _ = supervise(tmp_path, [Cycle(step=10, exit_after_confirm=3.0), Cycle()],
                                 interval=None, nodes_count=2, at={asked_at: follower_asks})
    assert result.exit_code == 75 and result.reason is ExitReason.CHECKPOINTED, result.message
    assert result.cycles == 1
    assert [(round(t), action, reason) for t, action, reason in world.requests] == \
        [(90, "stop", "deadline")]  # its one checkpoint serves both
    events = read_events(world.store.events_path)
    assert [(e["signal"], e["during"]) for e in events if e["event"] == "stop-signal"] == \
        [("SIGTERM on node 1", "deadline")]
    assert "restart" not in [e["event"] for e in events]
    assert group.read_leader(control)["state"] == group.EXITED


def test_a_follower_asking_as_a_cycle_ends_ends_the_run_before_the_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    said_between = group.LeaderBoard.between

    def between_then_asked(board: group.LeaderBoard) -> None:
        said_between(board)  # node 1's pod gets its SIGTERM as it reads this
        group.ask_stop(board.dir, str(board.token), 1, "SIGTERM")

    monkeypatch.setattr(group.LeaderBoard, "between", between_then_asked)
    world, result, _ = supervise(tmp_path, [Cycle(step=10), Cycle()], interval=None,
                                 nodes_count=2)
    assert result.exit_code == 75 and result.reason is ExitReason.CHECKPOINTED, result.message
    assert result.cycles == 1
    assert result.message.startswith("stopped after SIGTERM on node 1, before a restart; "
                                     "running the same command again "), result.message
    events = read_events(world.store.events_path)
    assert [(e["signal"], e["during"]) for e in events if e["event"] == "stop-signal"] == \
        [("SIGTERM on node 1", "restart")]
    assert "restart" not in [e["event"] for e in events]


def test_a_signal_to_a_follower_between_two_cycles_asks_the_leader_to_stop(tmp_path: Path):
    board = group.LeaderBoard(tmp_path / "ckpt" / "control", nodes=2)
    result, parts, store = follow(tmp_path, {
        1: lambda: board.running("t1", 1, {"PROCCKPT_TOKEN": "t1"}),
        20: board.between,
        40: lambda: board.exited(75, "stopped after SIGTERM on node 1, before a restart"),
    }, exits_at=15, signals={25: signal.SIGTERM})
    asked = group.stop_requests(store.control_dir, "t1")
    assert [(a["node"], a["reason"]) for a in asked] == [(1, "SIGTERM")]
    assert len(parts) == 1 and result.exit_code == 75, result.message


def test_a_follower_says_it_lives_every_two_seconds_while_it_waits_and_runs(tmp_path: Path):
    board = group.LeaderBoard(tmp_path / "ckpt" / "control", nodes=2)
    seen: list[object] = []

    def look() -> None:
        seen.append(group.read_beats(board.dir).get(1))

    follow(tmp_path, {
        **{t + 0.25: look for t in range(1, 40, 2)},
        5: lambda: board.running("t1", 1, {"PROCCKPT_TOKEN": "t1"}),
        40: lambda: board.exited(0, "training finished"),
    }, exits_at=20)
    # A new beat at every look (2 s apart), before the cycle, during it and after it.
    assert None not in seen and len(set(seen)) == len(seen) == 20, seen


def test_the_leader_takes_a_silent_follower_for_a_lost_node_and_a_beating_one_for_alive(
        tmp_path: Path):
    control = tmp_path / "ckpt" / "control"
    CheckpointStore(tmp_path / "ckpt").open()
    clock = [0.0]
    beating = [True]

    def sleep(seconds: float) -> None:
        before = clock[0]
        clock[0] += seconds
        if beating[0] and int(clock[0] / 2) != int(before / 2):  # a beat every 2 s
            group.beat(control, 1, int(clock[0]))

    board = group.LeaderBoard(control, nodes=3, clock=lambda: clock[0], sleep=sleep)
    group.beat(control, 1, 0)
    group.beat(control, 2, 0)  # an old beat: node 2's launcher is gone
    lost = board.silent_nodes()
    assert [(n.node, n.seconds) for n in lost] == [(2, 15.0)]
    assert str(lost[0]) == "node 2 (its launcher has not been heard from for 15s)"
    assert clock[0] == 15.0  # it waited for the silence, not longer
    # Asked again later: node 1 still beats, node 2 is still silent; no new wait for node 1.
    assert [n.node for n in board.silent_nodes()] == [2]
    beating[0] = False
    clock[0] += 3  # node 1 late: wait for its beat or its silence
    assert [n.node for n in board.silent_nodes()] == [1, 2]


def test_a_failure_while_a_follower_is_silent_is_a_lost_node_and_checkpointed_exit(
        tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(exits_at=20, code=1)], time_limit=None,
                                 interval=None, nodes_count=2)
    assert result.exit_code == 75 and result.reason is ExitReason.CHECKPOINTED
    assert "lost node 1 (its launcher has not been heard from for 15s)" in result.message
    lost = [e for e in read_events(world.store.events_path) if e["event"] == "node-lost"]
    assert lost and lost[0]["nodes"] == ["node 1 (its launcher has not been heard from for 15s)"]
    assert group.read_leader(world.store.control_dir)["code"] == 75  # the followers exit so


def test_a_failure_while_every_follower_beats_is_the_scripts_own(tmp_path: Path):
    control = tmp_path / "ckpt" / "control"
    beats = {float(t): (lambda t=t: group.beat(control, 1, t)) for t in range(0, 80, 2)}
    world, result, _ = supervise(tmp_path, [Cycle(exits_at=20, code=1)], time_limit=None,
                                 interval=None, nodes_count=2, at=beats)
    assert result.exit_code == 1 and result.reason is ExitReason.FAILED, result.message
    assert "node-lost" not in [e["event"] for e in read_events(world.store.events_path)]


def test_a_follower_that_never_started_is_said_and_a_sigterm_is_blamed_for_the_stop(
        tmp_path: Path, caplog):
    # Node 1's launcher was never started: its ranks never join, so the stop's checkpoint
    # cannot come. The start says whose launcher is missing; the end blames the SIGTERM.
    stuck = Cycle(confirm_after=1e9)  # connected, but its checkpoint never comes
    with caplog.at_level("WARNING", logger="procckpt"):
        world, result, _ = supervise(tmp_path, [stuck], time_limit=None, interval=None,
                                     hang_timeout=None, nodes_count=2,
                                     at={40.0: lambda: signal.SIGTERM})
    said = [r.getMessage() for r in caplog.records if "has not been heard from" in r.getMessage()]
    assert said == ["the launcher of node 1 has not been heard from since this one started: "
                    "the command waits for the ranks there. Start procckpt run --nodes N "
                    "--node-rank K with the same --dir on each node"], said
    assert result.exit_code == 75, result.message
    assert result.message.startswith("no checkpoint was taken after SIGTERM"), result.message
    assert "node-lost" not in [e["event"] for e in read_events(world.store.events_path)]


def test_a_follower_unheard_since_the_first_look_is_named_and_control_is_not_read_once_all_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    now = [0.0]
    board = group.LeaderBoard(tmp_path, 3, clock=lambda: now[0])
    group.beat(tmp_path, 1, 1)  # a beat left by an earlier launch
    assert board.unheard(after=10) == []  # the first look; too early to say
    now[0] = 11
    group.beat(tmp_path, 2, 1)
    assert board.unheard(after=10) == [1]  # node 1's beat is the old one
    group.beat(tmp_path, 1, 2)
    assert board.unheard(after=10) == []
    reads = []
    monkeypatch.setattr(group, "read_beats", lambda d: reads.append(d) or {})
    assert board.unheard(after=10) == [] and reads == []
