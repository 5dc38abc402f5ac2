"""The run loop driven through its seams: a fake clock, a fake child and a fake engine play
deadline -> checkpoint request -> grace -> stop -> restart/exit in milliseconds, with a real
checkpoint dir and journal. (The end-to-end tests run the same loop with real processes.)"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from procckpt.launcher.config import RunConfig
from procckpt.launcher.deadline import Deadline, LocalDeadline, NoDeadline
from procckpt.launcher.engines import Confirmation, Engine
from procckpt.launcher.interval import FIRST_AUTO_MAX, young_daly
from procckpt.launcher.restart import Decision, LocalRestart, Verdict
from procckpt.launcher.supervisor import ExitReason, Supervisor
from procckpt.protocol.control import Heartbeat
from procckpt.protocol.events import append_event, read_events
from procckpt.protocol.group import LeaderBoard
from procckpt.store import CheckpointStore

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


@dataclass
class Cycle:
    """How the command behaves in one cycle (times in seconds after its start)."""

    exits_at: float | None = None  # exits by itself then, with ``code``
    code: int = 0
    completes: bool = False  # marks the training complete when it exits by itself
    confirm_after: float | None = 1.0  # a stop request is confirmed this long after
    connects_at: float = 0.0  # ...it connected (a slow start under load: imports, a group)
    step: int | None = None  # the step of the confirmed checkpoint
    exit_after_confirm: float = 0.5  # then it exits (0) this long after the confirmation
    ignores_term: bool = False  # SIGTERM does not stop it (the launcher must SIGKILL)
    step_seconds: float = 0.1  # it reports its steps (a heartbeat) at this pace...
    hangs_at: float | None = None  # ...until then, after which no step completes
    pause: float = 0.5  # what a periodic checkpoint costs it (journalled, as the training does)
    rank_fails_at: float | None = None  # a rank reports an exception then; the command runs on
    node_lost_at: float | None = None  # from then the scheduler calls node n2 lost
    no_image: bool = False  # a stop is answered at once with no checkpoint; it runs on
    noted: int | None = None  # procckpt ended a rank with this code (its note; exits.py)
    writing: bool = False  # the engine says the stop's image is being written until confirmed
    image_fails: str | None = None  # the stop's image fails with this error (then it exits)


@dataclass
class World:
    store: CheckpointStore
    cycles: list[Cycle]
    now: float = 1000.0
    index: int = -1
    started: float = 0.0
    requests: list[tuple[float, str, str]] = field(default_factory=list)
    stop_asked: float | None = None
    exited: int | None = None
    killed_with: list[int] = field(default_factory=list)
    stopped_at: list[float] = field(default_factory=list)  # when the launcher stopped it
    dumped: list[int] = field(default_factory=list)  # whose stacks were asked for
    envs: list[dict[str, str]] = field(default_factory=list)  # each cycle's environment

    @property
    def cycle(self) -> Cycle:
        return self.cycles[self.index]

    def elapsed(self) -> float:
        return self.now - self.started

    def confirmed_at(self) -> float | None:
        c = self.cycle
        if self.stop_asked is None or c.confirm_after is None:
            return None
        return max(self.stop_asked, self.started + c.connects_at) + c.confirm_after


class FakeChild:
    pid = 4242
    signalled = False  # (the launcher's own signals are in world.killed_with)

    def __init__(self, world: World, argv: list[str], env: dict[str, str]) -> None:
        self.world = world
        world.envs.append(env)

    def start(self) -> None:
        w = self.world
        w.index += 1
        w.started, w.stop_asked, w.exited = w.now, None, None

    def poll(self) -> int | None:
        w, c = self.world, self.world.cycle
        if w.exited is not None:
            return w.exited
        if c.exits_at is not None and w.elapsed() >= c.exits_at:
            if c.completes:
                w.store.mark_complete(step=100)
            w.exited = c.code
        confirmed = w.confirmed_at()
        if confirmed is not None and not c.no_image and \
                w.now >= confirmed + c.exit_after_confirm:
            w.exited = 0
        return w.exited

    def signal(self, sig: int) -> None:
        self.world.killed_with.append(sig)

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> int:
        w = self.world
        w.stopped_at.append(w.elapsed())
        self.signal(signal.SIGTERM)
        if w.cycle.ignores_term:
            w.now += term_timeout
            self.signal(signal.SIGKILL)
            w.exited = 128 + signal.SIGKILL
        else:
            w.exited = 128 + signal.SIGTERM
        return w.exited

    def kill_leftovers(self, timeout: float = 5.0) -> None:
        pass


class FakeEngine(Engine):
    name = "hooks"
    reports_progress = True

    def __init__(self, world: World) -> None:
        self.world = world
        self.seq = 0
        self.answered: set[int] = set()  # periodic checkpoints, durable and acknowledged

    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        return list(argv), {"PROCCKPT_TOKEN": token}

    def request(self, action: str, reason: str) -> int:
        self.seq += 1
        w = self.world
        w.requests.append((w.elapsed(), action, reason))
        if action == "stop":
            w.stop_asked = w.now
        else:  # the training writes it in the background and journals what it cost
            append_event(w.store.events_path, "checkpoint", checkpoint=f"ckpt-{self.seq:08d}",
                         stall=w.cycle.pause, seconds=2 * w.cycle.pause, reason=reason)
            self.answered.add(self.seq)
        return self.seq

    def progress(self) -> Heartbeat | None:
        w, c = self.world, self.world.cycle
        running = w.elapsed() if c.hangs_at is None else min(w.elapsed(), c.hangs_at)
        return Heartbeat(int(running / c.step_seconds), w.now)

    def _confirmation(self) -> Confirmation | None:
        w = self.world
        at = w.confirmed_at()
        if at is None or w.now < at:
            return None
        if w.cycle.no_image:  # as the DMTCP engine answers once it saw a forked copy
            return Confirmation(None, None, False, self.seq, "it runs forked copies of itself")
        if w.cycle.image_fails:
            return Confirmation(None, None, True, self.seq, w.cycle.image_fails)
        return Confirmation(f"ckpt-{w.index + 1:08d}", w.cycle.step, True, self.seq)

    @property
    def stuck(self) -> str | None:
        return "no image of it is kept" if self.world.cycle.no_image else None

    def confirmation(self, seq: int) -> Confirmation | None:
        if seq in self.answered:
            return Confirmation(f"ckpt-{seq:08d}", None, False, seq)
        return self._confirmation()

    def connected(self) -> bool:
        w = self.world
        return w.cycle.confirm_after is not None and w.elapsed() >= w.cycle.connects_at

    def writing(self, seq: int) -> bool:
        return self.world.cycle.writing and self._confirmation() is None

    def end_cycle(self) -> Confirmation | None:
        return self._confirmation()

    def procckpt_exits(self) -> list[dict[str, object]]:
        noted = self.world.cycle.noted
        return [] if noted is None else [{"rank": 1, "code": noted}]

    def failures(self) -> list[dict[str, object]]:
        w, c = self.world, self.world.cycle
        if c.rank_fails_at is None or w.elapsed() < c.rank_fails_at:
            return []
        return [{"rank": 1, "host": "n2", "error": "RuntimeError: Connection closed by peer"}]


class NodesPolicy(LocalRestart):
    """A scheduler's policy that reports node n2 lost from the cycle's ``node_lost_at``, and
    requeues the job then."""

    def __init__(self, world: World, max_restarts: int) -> None:
        super().__init__(max_restarts)
        self.world = world
        self.asked: list[float] = []

    def lost_nodes(self) -> list[object]:
        w = self.world
        self.asked.append(w.elapsed())
        lost_at = w.cycle.node_lost_at
        return ["n2 (its slurmd does not answer)"] if lost_at is not None and \
            w.elapsed() >= lost_at else []

    def after_node_loss(self, lost, restarts: int) -> Verdict:
        return Verdict(Decision.REQUEUED, f"requeued (lost {', '.join(map(str, lost))})")


def supervise(tmp_path: Path, cycles: list[Cycle], time_limit: float | None = 100.0,
              grace: float | None = 10.0, max_restarts: int = 20,
              interval: float | str | None = "auto",
              hang_timeout: float | str | None = "auto", deadline: object = None,
              restart_on_failure: bool = False, nodes: bool = False, nodes_count: int = 1,
              at: dict[float, Callable[[], object]] | None = None,
              ) -> tuple[World, object, float]:
    """Supervise ``cycles``; ``at`` acts at those times into a cycle (as another process
    would; a signal it returns reaches the launcher)."""
    store = CheckpointStore(tmp_path / "ckpt").open()
    world = World(store, cycles)
    config = RunConfig(command=["train"], dir=store.root, time_limit=time_limit, grace=grace,
                       max_restarts=max_restarts, term_timeout=10.0, interval=interval,
                       hang_timeout=hang_timeout, restart_on_failure=restart_on_failure,
                       nodes=nodes_count)
    pending = dict(at or {})

    def wait(timeout: float) -> list[int]:
        world.now += max(timeout, 0.001)
        arrived = [pending.pop(t)() for t in [t for t in pending if t <= world.elapsed()]]
        return [s for s in arrived if isinstance(s, signal.Signals)]

    if deadline is None:
        deadline = LocalDeadline(time_limit) if time_limit is not None else NoDeadline()
    policy = NodesPolicy(world, max_restarts) if nodes else LocalRestart(max_restarts)
    world.policy = policy  # type: ignore[attr-defined]
    supervisor = Supervisor(config, store, FakeEngine(world), deadline,
                            policy, clock=lambda: world.now,
                            child_factory=lambda argv, env: FakeChild(world, argv, env),
                            wait_signals=wait, stack_dumper=world.dumped.append)
    if nodes_count > 1:  # its wait for the followers' beats on the same fake clock
        supervisor.board = LeaderBoard(store.control_dir, nodes_count, clock=lambda: world.now,
                                       sleep=wait)
    started = time.perf_counter()
    result = supervisor.run()
    return world, result, time.perf_counter() - started


def journal(world: World) -> list[str]:
    return [e["event"] for e in read_events(world.store.events_path)]


def test_deadline_checkpoint_stop_restart_finish(tmp_path: Path, monkeypatch):
    # torch's inductor writes its default cache dir into os.environ once asked for it: another
    # test in this worker may have done so. A launcher's environment has none by default.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    world, result, took = supervise(tmp_path, [Cycle(step=10), Cycle(step=20),
                                               Cycle(exits_at=30, completes=True)])
    assert result.reason is ExitReason.FINISHED and result.exit_code == 0
    assert result.cycles == 3
    stops = [r for r in world.requests if r[1] == "stop"]
    assert [round(t) for t, _, _ in stops] == [90, 90]  # time limit 100 - grace 10
    assert journal(world).count("restart") == 2 and journal(world)[-1] == "exit"
    assert took < 5  # 230 s of supervised time in (far) less than a second of real time
    ends = [e["ended"] for e in read_events(world.store.events_path) if e["event"] == "cycle-end"]
    assert ends == ["stopped", "stopped", "finished"]
    # torch.compile's kernels are kept beside the checkpoints: a restart reuses them.
    assert {env["TORCHINDUCTOR_CACHE_DIR"] for env in world.envs} == \
        {str(world.store.root / "compile-cache")}


def test_a_compile_cache_the_user_chose_is_kept(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    world, _, _ = supervise(tmp_path, [Cycle(exits_at=5, completes=True)])
    assert world.envs[0]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_no_confirmation_within_the_grace_stops_and_three_such_cycles_give_up(tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(confirm_after=60, ignores_term=True)] * 5)
    assert result.reason is ExitReason.NO_PROGRESS and result.exit_code == 75
    assert result.cycles == 3
    assert world.killed_with.count(signal.SIGKILL) == 3  # TERM ignored: bounded, then KILL
    assert journal(world).count("unconfirmed") == 3


def test_a_stop_whose_image_is_still_being_written_past_the_lead_waits_for_it(tmp_path: Path):
    """An image engine under load: the stop's image (asked at 90 s) is written until 115 s,
    past the lead. Stopping the command at 100 s would cut it short and leave no image (a
    SIGKILL pending in CRIU's image of the tree, seen here); the launcher waits for it."""
    world, result, _ = supervise(tmp_path, [Cycle(confirm_after=25, writing=True, step=10),
                                            Cycle(exits_at=30, completes=True)])
    assert result.reason is ExitReason.FINISHED and result.exit_code == 0, result.message
    assert "unconfirmed" not in journal(world)
    assert world.killed_with == [] and world.stopped_at == []
    assert [round(t) for t, action, _ in world.requests if action == "stop"] == [90]


def test_a_stop_whose_image_failed_says_so_in_its_last_line(tmp_path: Path):
    """An image engine's stop image failed (CRIU met a process ending): the run's last line
    gives the failure, not that the command reached no safe point, which it never has to."""
    error = "criu dump failed: Error (criu/seize.c:882): Zombies with threads are not supported"
    _, result, _ = supervise(tmp_path, [Cycle(image_fails=error)], max_restarts=0)
    assert result.exit_code != 0
    assert (f"the checkpoint after its time limit was near failed ({error}), so the work since "
            "the last checkpoint is lost") in result.message, result.message
    assert "safe point" not in result.message


@pytest.mark.parametrize("grace", [10.0, 30.0])
def test_a_command_the_engine_takes_no_image_of_is_stopped_before_the_deadline(
        tmp_path: Path, grace: float):
    # Asked at 100 - grace, answered at once with no checkpoint, and the command runs on: it
    # is stopped no later than the deadline less its bounded exit (term_timeout 10 s).
    world, result, _ = supervise(tmp_path, [Cycle(no_image=True, confirm_after=0.0)],
                                 grace=grace)
    assert result.reason is ExitReason.NOT_CHECKPOINTABLE and result.exit_code == 124
    assert [round(t) for t, action, _ in world.requests if action == "stop"] == [100 - grace]
    assert [round(t) for t in world.stopped_at] == [90]


def test_a_command_the_engine_takes_no_image_of_may_finish_before_the_deadline(
        tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(no_image=True, confirm_after=0.0,
                                                  exits_at=88, completes=True)], grace=30)
    assert result.reason is ExitReason.FINISHED and result.exit_code == 0, result.message
    assert world.stopped_at == []


def test_a_command_that_never_connects_exits_124(tmp_path: Path):
    _, result, _ = supervise(tmp_path, [Cycle(confirm_after=None)])
    assert result.reason is ExitReason.NOT_CHECKPOINTABLE and result.exit_code == 124


@pytest.mark.parametrize("signum, reason", [
    (signal.SIGUSR1, ExitReason.CHECKPOINTED),  # a warning: waits for the slow start, saves
    (signal.SIGTERM, ExitReason.NOT_CHECKPOINTABLE),  # the kill is close: the lead, no more
], ids=["USR1", "TERM"])
def test_a_stop_signal_before_the_command_connected(tmp_path: Path, signum: signal.Signals,
                                                    reason: ExitReason):
    # Slurm sends its B:USR1 up to a minute early: here 5 s into a cycle whose command needs
    # 40 s to import and connect, far longer than the 10 s grace.
    world, result, _ = supervise(tmp_path, [Cycle(connects_at=40, step=3)],
                                 at={5: lambda: signum})
    assert result.reason is reason, result.message
    assert [r[1:] for r in world.requests] == [("stop", signum.name)]
    assert ("unconfirmed" in journal(world)) is (signum == signal.SIGTERM)


def test_the_restart_budget_is_kept(tmp_path: Path):
    cycles = [Cycle(step=10 * (i + 1)) for i in range(5)]
    _, result, _ = supervise(tmp_path, cycles, max_restarts=2)
    assert result.reason is ExitReason.BUDGET_EXHAUSTED and result.exit_code == 75
    assert result.cycles == 3


@pytest.mark.parametrize("code, noted, reason, words", [
    (3, None, ExitReason.FAILED, "failed with exit code 3"),
    (137, None, ExitReason.FAILED, "was killed by signal 9 (SIGKILL)"),
    (74, 74, ExitReason.STORAGE_FAILED, "is not restarted"),
    (1, 74, ExitReason.STORAGE_FAILED, "is not restarted"),  # a rank's, through torchrun
    (74, None, ExitReason.FAILED, "exit code 74 (the command's own code"),
])
def test_a_command_that_ends_by_itself(tmp_path: Path, code: int, noted: int | None,
                                       reason: ExitReason, words: str):
    _, result, _ = supervise(tmp_path, [Cycle(exits_at=5, code=code, noted=noted)] * 3)
    assert result.reason is reason and result.cycles == 1
    assert result.exit_code == (74 if noted else code)
    assert words in result.message, result.message


def test_no_time_limit_and_no_interval_means_no_request(tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(exits_at=5000, completes=True)],
                                 time_limit=None, interval=None)
    assert result.reason is ExitReason.FINISHED and world.requests == []


def test_by_default_checkpoints_come_at_the_young_daly_period_of_their_measured_cost(
        tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(exits_at=2000, completes=True, pause=0.5)],
                                 time_limit=None)
    assert result.reason is ExitReason.FINISHED
    times = [t for t, action, reason in world.requests if reason == "interval"]
    assert times[0] == pytest.approx(FIRST_AUTO_MAX, abs=1.5)  # the first: to measure the cost
    period = young_daly(0.5, 24 * 3600)  # then sqrt(2 C M) - C = 293 s
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps and all(g == pytest.approx(period, abs=1.5) for g in gaps)
    intervals = [e for e in read_events(world.store.events_path) if e["event"] == "interval"]
    assert "Young/Daly" in intervals[-1]["why"]


def test_no_periodic_checkpoint_begins_that_the_deadlines_would_wait_for(tmp_path: Path):
    """Periodic checkpoints take 1 s to be durable here; the deadline's is asked for at 90 s
    (limit 100, grace 10). One due at 89.1 s would still be written then: the stop's would
    wait for it, and it would be superseded a second later. It is left out; the earlier
    ones are not, and the next cycle's schedule starts afresh."""
    world, result, _ = supervise(tmp_path, [Cycle(step=10), Cycle(exits_at=70, completes=True)],
                                 interval=29.7)
    assert result.reason is ExitReason.FINISHED, result.message
    asked = [(round(t, 1), reason) for t, _, reason in world.requests]
    assert asked == [(29.7, "interval"), (59.4, "interval"), (90.0, "deadline"),
                     (29.7, "interval"), (59.4, "interval")], asked


def test_a_hung_command_gets_its_stacks_dumped_and_is_restarted(tmp_path: Path):
    cycles = [Cycle(hangs_at=50, confirm_after=None), Cycle(exits_at=30, completes=True)]
    world, result, _ = supervise(tmp_path, cycles, time_limit=None, interval=None,
                                 hang_timeout=20.0)
    assert result.reason is ExitReason.FINISHED and result.cycles == 2
    assert world.dumped == [FakeChild.pid]
    hang = next(e for e in read_events(world.store.events_path) if e["event"] == "hang")
    assert hang["step"] == 500 and 20 <= hang["seconds"] <= 22  # 50 s at 0.1 s a step
    assert any(e["event"] == "restart" and e["cause"] == "hang"
               for e in read_events(world.store.events_path))


def test_a_command_that_keeps_hanging_uses_up_the_restart_budget(tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(hangs_at=5, confirm_after=None)] * 4,
                                 time_limit=None, interval=None, hang_timeout=20.0,
                                 max_restarts=2)
    assert result.reason is ExitReason.HUNG and result.exit_code == 1 and result.cycles == 3


def test_a_grace_shorter_than_a_measured_checkpoint_is_widened_and_said(tmp_path: Path,
                                                                         caplog):
    store = CheckpointStore(tmp_path / "ckpt").open()
    append_event(store.events_path, "checkpoint", checkpoint="ckpt-00000001", seconds=30.0)
    world, result, _ = supervise(tmp_path, [Cycle(step=10), Cycle(exits_at=5, completes=True)],
                                 interval=None, grace=10.0)
    stops = [t for t, action, _ in world.requests if action == "stop"]
    assert stops == [pytest.approx(100 - (1.5 * 30 + 0.1 + 2), abs=1.5)]
    # Said once, at the first cycle's start (before a step was timed): not again every cycle.
    assert caplog.text.count("pass --grace") == 1 and "pass --grace 47s" in caplog.text


class LearnedLimit(Deadline):
    """A scheduler's deadline: its limit is known only once it has been asked (Slurm's)."""

    source = "a scheduler"
    limit: float | None = None

    def end(self, cycle_started: float, now: float) -> float | None:
        self.limit = 100.0
        return cycle_started + 100.0


def test_the_default_grace_follows_a_limit_learned_from_the_scheduler(tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(step=10), Cycle(exits_at=5, completes=True)],
                                 time_limit=None, grace=None, interval=None,
                                 deadline=LearnedLimit())
    stops = [t for t, action, _ in world.requests if action == "stop"]
    assert stops == [pytest.approx(75, abs=1.5)]  # a quarter of 100 s, not the 60 s default


def test_the_same_failure_again_and_again_backs_off_then_stops(tmp_path: Path):
    crash = Cycle(exits_at=5.0, code=3)
    world, result, _ = supervise(tmp_path, [crash] * 6, time_limit=None, interval=None,
                                 restart_on_failure=True)
    assert result.reason is ExitReason.FAILED and result.exit_code == 3
    assert result.cycles == 3 and "3 times in a row" in result.message, result.message
    # Three 5 s cycles: the first failure restarted at once, the second after 2 s.
    assert world.now - 1000.0 == pytest.approx(3 * 5 + 0 + 2, abs=0.5)


def test_failures_whose_exit_code_alternates_are_no_progress_either(tmp_path: Path):
    crashes = [Cycle(exits_at=5.0, code=code) for code in (3, 4, 3, 4, 3, 4)]
    world, result, _ = supervise(tmp_path, crashes, time_limit=None, interval=None,
                                 restart_on_failure=True)
    assert result.reason is ExitReason.FAILED and result.exit_code == 3
    assert result.cycles == 3, result.message
    assert result.message.startswith("the command failed 3 times in a row (exit codes 3, 4) "
                                     "with no new checkpoint in between"), result.message
    assert world.now - 1000.0 == pytest.approx(3 * 5 + 0 + 2, abs=0.5)  # backed off


def test_restarts_after_failures_that_run_out_say_so(tmp_path: Path):
    crashes = [Cycle(exits_at=5.0, code=code) for code in (3, 4)]
    _, result, _ = supervise(tmp_path, crashes, time_limit=None, interval=None,
                             restart_on_failure=True, max_restarts=1)
    assert result.reason is ExitReason.FAILED and result.exit_code == 4
    assert result.message.startswith("the command failed with exit code 4, and --max-restarts "
                                     "1 is spent (1 restart in this launch)"), result.message


# -- a lost node ------------------------------------------------------------------------------

def test_a_rank_failed_and_a_node_lost_while_the_command_waits_requeues_the_job(tmp_path: Path):
    # Rank 1's node dies at 20 s: rank 0 reports the broken connection; srun would wait for the
    # dead node's task for as long as Slurm takes to notice. The launcher asks soon after.
    world, result, _ = supervise(tmp_path, [Cycle(rank_fails_at=20, node_lost_at=20)],
                                 time_limit=None, grace=None, nodes=True)
    assert result.reason is ExitReason.REQUEUED and result.exit_code == 0
    assert "lost n2" in result.message
    events = list(read_events(world.store.events_path))
    lost = [e for e in events if e["event"] == "node-lost"]
    assert [e["nodes"] for e in lost] == [["n2 (its slurmd does not answer)"]]
    assert [e["ended"] for e in events if e["event"] == "cycle-end"] == ["node-lost"]
    [failed] = [e for e in events if e["event"] == "rank-failed"]
    assert failed["rank"] == 1 and failed["node"] == "n2" and "closed by peer" in failed["error"]
    assert signal.SIGTERM in world.killed_with
    # Asked once the peers had time to end by themselves, long before a hang timeout.
    asked = world.policy.asked  # type: ignore[attr-defined]
    assert asked and 25 <= asked[0] <= 40, asked


def test_a_rank_failure_with_every_node_there_is_the_scripts_own(tmp_path: Path):
    # A bug on one rank: its peer sees the broken connection and the command exits 1.
    world, result, _ = supervise(tmp_path, [Cycle(rank_fails_at=20, exits_at=21, code=1)],
                                 time_limit=None, grace=None, nodes=True)
    assert result.reason is ExitReason.FAILED and result.exit_code == 1
    assert world.policy.asked == [21.0]  # type: ignore[attr-defined]
    assert not [e for e in read_events(world.store.events_path) if e["event"] == "node-lost"]


def test_a_command_that_failed_when_a_node_was_lost_is_requeued(tmp_path: Path):
    world, result, _ = supervise(tmp_path, [Cycle(exits_at=30, code=137, node_lost_at=25)],
                                 time_limit=None, grace=None, nodes=True)
    assert result.reason is ExitReason.REQUEUED, result.message
    assert [e["ended"] for e in read_events(world.store.events_path)
            if e["event"] == "cycle-end"] == ["node-lost"]


def test_a_hang_when_a_node_was_lost_requeues_instead_of_restarting_here(tmp_path: Path):
    # NCCL ranks whose peer vanished may wait in a collective instead of failing: the hang
    # timeout ends the wait, and the lost node decides what follows.
    world, result, _ = supervise(tmp_path, [Cycle(hangs_at=20, node_lost_at=20)],
                                 time_limit=None, grace=None, hang_timeout=60, nodes=True)
    assert result.reason is ExitReason.REQUEUED, result.message
    events = list(read_events(world.store.events_path))
    assert [e["event"] for e in events if e["event"] in ("hang", "node-lost", "restart")] == \
        ["hang", "node-lost"]
    assert [e["ended"] for e in events if e["event"] == "cycle-end"] == ["node-lost"]
