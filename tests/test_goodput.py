"""The goodput breakdown from journals written by hand: each part where it belongs, and the
parts always adding up to the wall time. The end-to-end test (tests/e2e/test_goodput.py) reads
journals that real runs wrote."""

from __future__ import annotations

import pytest

from procckpt.inspect.goodput import KINDS, compute_goodput

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0


def ev(t: float, kind: str, **fields) -> dict:
    return {"time": T0 + t, "event": kind, **fields}


def cycle(start: float, end: float, ended: str, *inside: dict, number: int = 1) -> list[dict]:
    return [ev(start, "cycle", cycle=number, lead=5.0, interval=None), *inside,
            ev(end, "cycle-end", cycle=number, code=0, ended=ended)]


def assert_adds_up(g) -> None:
    assert sum(g.seconds().values()) == pytest.approx(g.wall, abs=1e-6)
    for c in g.cycles:
        assert sum(c.seconds().values()) == pytest.approx(c.end - c.start, abs=1e-6)


def test_a_stopped_cycle_is_startup_restore_training_a_pause_and_its_exit():
    journal = [ev(0, "start", job_id=None),
               *cycle(1, 30, "stopped",
                      ev(5, "ready", restore=1.0),       # started 1..4, restored 4..5
                      ev(6, "resume-skip", seconds=0.5),  # replayed 5.5..6
                      ev(20, "checkpoint", seconds=2.0, background=True, stall=0.25),
                      ev(28, "checkpoint", seconds=1.0)),  # the stop's: 27..28, then the exit
               ev(31, "exit", reason="checkpointed")]
    g = compute_goodput(journal)
    s = g.seconds()
    assert g.wall == pytest.approx(31)
    assert s["startup"] == pytest.approx(3 + 1)  # the cycle's, and the launcher's first second
    assert s["restore"] == pytest.approx(1.0) and s["replay"] == pytest.approx(0.5)
    assert s["checkpoint_stall"] == pytest.approx(1.25)  # 18..18.25 and 27..28
    assert s["idle"] == pytest.approx(2 + 1)  # 28..30 in the cycle, 30..31 after it
    assert s["lost"] == 0 and s["queue"] == 0
    assert s["training"] == pytest.approx(31 - 4 - 1 - 0.5 - 1.25 - 3)
    assert g.ettr == pytest.approx(s["training"] / 31)
    assert g.cycles[0].checkpoints == [T0 + 20, T0 + 28]
    assert_adds_up(g)


def test_a_crash_loses_what_was_trained_after_the_last_checkpoint():
    journal = [ev(0, "start", job_id=None),
               *cycle(0, 40, "failed",
                      ev(2, "ready", restore=0.0),
                      ev(12, "checkpoint", seconds=1.0)),  # kept up to 12
               ev(40, "restart", cause="failure"),
               *cycle(42, 60, "finished", ev(44, "ready", restore=0.5), ev(59, "complete"),
                      number=2),
               ev(60, "exit", reason="finished")]
    g = compute_goodput(journal)
    crashed, resumed = g.cycles
    assert crashed.seconds()["lost"] == pytest.approx(28)
    assert crashed.seconds()["training"] == pytest.approx(9)  # 2..11, then the pause
    assert crashed.then == "failure" and resumed.ended == "finished"
    assert resumed.seconds()["idle"] == pytest.approx(1)  # after complete
    assert g.seconds()["idle"] == pytest.approx(2 + 1)  # the back-off between the cycles
    assert_adds_up(g)


def test_a_cycle_that_never_checkpointed_loses_all_but_its_start():
    journal = [ev(0, "start", job_id=None),
               *cycle(0, 10, "hung", ev(3, "ready", restore=0.0), ev(9, "hang", step=4))]
    g = compute_goodput(journal)
    s = g.cycles[0].seconds()
    assert (s["startup"], s["lost"], s["training"]) == (pytest.approx(3), pytest.approx(7), 0)
    assert g.cycles[0].hangs == [T0 + 9]
    assert_adds_up(g)


def test_the_first_steps_excess_over_the_second_is_startup():
    journal = [ev(0, "start", job_id=None),
               *cycle(0, 30, "stopped", ev(2, "ready", restore=0.0),
                      ev(14, "warm", first=11.0, second=1.0),  # step 1 ended at 13: 10 s compile
                      ev(29, "checkpoint", seconds=0.5))]
    g = compute_goodput(journal)
    s = g.cycles[0].seconds()
    assert s["startup"] == pytest.approx(2 + 10)
    assert s["training"] == pytest.approx(30 - 12 - 0.5 - 1)
    assert_adds_up(g)


def test_a_requeue_waits_in_the_queue_until_slurms_start_time():
    journal = [ev(0, "start", job_id="7"),
               *cycle(1, 50, "stopped", ev(3, "ready"), ev(49, "checkpoint", seconds=1)),
               ev(51, "exit", reason="requeued"),
               ev(200, "start", job_id="7"),  # Slurm started it again at 190
               *cycle(201, 260, "finished", ev(203, "ready", restore=0.2), ev(259, "complete"),
                      number=2),
               ev(261, "exit", reason="finished")]
    second = next(e for e in journal if e["event"] == "cycle" and e["cycle"] == 2)
    second["job_started"] = T0 + 190
    g = compute_goodput(journal)
    s = g.seconds()
    assert s["queue"] == pytest.approx(190 - 51)
    assert [c.launch for c in g.cycles] == [1, 2]
    assert g.cycles[0].then == "requeued"
    assert_adds_up(g)
    # Without Slurm's start time the whole wait is queued; a launch by hand waits idle.
    del second["job_started"]
    assert compute_goodput(journal).seconds()["queue"] == pytest.approx(200 - 51)
    for e in journal:
        if e["event"] == "start":
            e["job_id"] = None
    by_hand = compute_goodput(journal).seconds()
    assert by_hand["queue"] == 0 and by_hand["idle"] >= 200 - 51


def test_a_running_cycle_ends_now_and_a_dead_launchers_at_its_last_event():
    journal = [ev(0, "start", job_id=None), ev(0, "cycle", cycle=1), ev(2, "ready", restore=0),
               ev(10, "checkpoint", seconds=1.0)]
    running = compute_goodput(journal, now=T0 + 20)
    assert running.cycles[0].ended == "running" and running.wall == pytest.approx(20)
    assert running.cycles[0].seconds()["lost"] == 0
    vanished = compute_goodput(journal)
    assert vanished.cycles[0].ended == "killed" and vanished.wall == pytest.approx(10)
    assert_adds_up(running)
    assert_adds_up(vanished)


def test_force_starts_a_new_run_in_the_journal():
    old = [ev(0, "start", job_id=None), *cycle(0, 10, "finished", ev(9, "complete")),
           ev(10, "exit", reason="finished"), ev(500, "archive", to="previous-x")]
    new = [ev(501, "start", job_id=None), *cycle(501, 520, "finished", ev(519, "complete")),
           ev(520, "exit", reason="finished")]
    g = compute_goodput(old + new)
    assert g.wall == pytest.approx(19) and len(g.cycles) == 1


def test_nothing_to_say_before_a_launch_and_every_kind_is_reported():
    assert compute_goodput([]) is None
    assert compute_goodput([ev(0, "checkpoint", seconds=1)]) is None  # a script on its own
    g = compute_goodput([ev(0, "start"), *cycle(0, 5, "exited")])
    assert set(g.as_json()["seconds"]) == set(KINDS)
    assert g.as_json()["ettr"] == pytest.approx(1.0)


def test_a_node_lost_mid_cycle_loses_the_work_since_its_last_checkpoint():
    # The launch ends with the job requeued; its cycle ended node-lost (the journal as the
    # two-node test wrote it: rank-failed, then node-lost with cycle-end, then the exit).
    journal = [ev(0, "start", job_id="7"),
               *cycle(0, 58, "node-lost",
                      ev(22, "ready", restore=0.0),
                      ev(32, "checkpoint", seconds=1.0, background=True, stall=0.01),
                      ev(38, "rank-failed", rank=0, node="n1", error="RuntimeError: ...")),
               ev(58, "node-lost", cycle=1, nodes=["n2 (Slurm says DOWN)"]),
               ev(58.1, "exit", reason="requeued")]
    g = compute_goodput(journal)
    [c] = g.cycles
    assert c.ended == "node-lost" and c.then == "requeued"
    # The checkpoint's write began at 31 (its pause 31..31.01): what came after is lost.
    assert c.seconds()["lost"] == pytest.approx(58 - 31.01)
    assert c.seconds()["training"] == pytest.approx(31 - 22)
    assert_adds_up(g)


def test_the_last_restart_says_where_its_state_came_from_and_what_went_into_touched_memory():
    from procckpt.inspect.status import recovery_line

    restart = ev(40, "recovery", backoff=0.0, spawn=0.01, imports=0.0, checkpointer=0.05,
                 restore=0.02, bytes=64_000_000, source="the memory tier", touched=42_000_000,
                 first_step=0.03, total=0.4)
    line = recovery_line([ev(39, "cycle", cycle=2, warm=True), restart])
    assert line is not None and "(warm: torch was imported)" in line, line
    assert "restore 0.02s (64.0 MB, from the memory tier, 42.0 MB of it into memory touched " \
        "already)" in line, line
    cold = recovery_line([ev(39, "cycle", cycle=2),
                          {**restart, "touched": None, "source": "the checkpoint dir"}])
    assert cold is not None and "restore 0.02s (64.0 MB, from the checkpoint dir)" in cold
