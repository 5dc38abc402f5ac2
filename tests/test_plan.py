"""The checkpoint plan's parts: the period (interval.py), the deadline's lead (grace.py), the
costs learned from a real journal (costs.py), hang detection (hang.py), and the room check of
the store on a real, small tmpfs."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from procckpt.launcher.costs import CheckpointCosts
from procckpt.launcher.grace import deadline_lead
from procckpt.launcher.hang import AUTO_MIN, HangWatch
from procckpt.launcher.interval import FIRST_AUTO_MAX, choose_period, young_daly
from procckpt.protocol.control import ControlChannel, Heartbeat
from procckpt.protocol.events import EventTail, append_event
from procckpt.store import CheckpointInfo, CheckpointStore
from procckpt.training.link.triggers import SaveTriggers

from .conftest import mounted_tmpfs
from .harness.processes import fill

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


# -- the period --------------------------------------------------------------------------------
def test_young_daly_is_sqrt_2_c_m_minus_c():
    assert young_daly(2.0, 3600) == pytest.approx(math.sqrt(2 * 2 * 3600) - 2)
    assert young_daly(3000, 3600) == 3600  # a checkpoint as long as half the MTBF: once per MTBF


def test_the_first_auto_period_measures_soon_and_the_next_follow_the_cost():
    first = choose_period("auto", 24 * 3600, pause=None)
    assert first.seconds == FIRST_AUTO_MAX and "measure" in first.why
    short_mtbf = choose_period("auto", 60, pause=None)
    assert short_mtbf.seconds == pytest.approx(young_daly(1.0, 60))
    measured = choose_period("auto", 24 * 3600, pause=0.5, durable=2.0)
    assert measured.seconds == pytest.approx(young_daly(0.5, 24 * 3600))
    assert "Young/Daly" in measured.why


def test_auto_checkpoints_take_at_most_one_percent_and_never_queue_behind_a_write():
    cheap_but_slow_to_write = choose_period("auto", 600, pause=0.01, durable=30.0)
    assert cheap_but_slow_to_write.seconds == 60.0 and "twice" in cheap_but_slow_to_write.why
    costly = choose_period("auto", 60, pause=1.0)  # Young/Daly says 10 s: 10 % of the run
    assert costly.seconds == 100.0 and "1%" in costly.why


def test_a_fixed_or_no_interval_is_kept():
    assert choose_period(600.0, 3600, pause=5.0).seconds == 600.0
    assert choose_period(None, 3600, pause=5.0).seconds is None


# -- the lead ----------------------------------------------------------------------------------
def test_the_grace_stands_until_a_checkpoint_is_measured_slower():
    assert deadline_lead(60.0, None, None).seconds == 60.0
    fits = deadline_lead(60.0, (10.0, "ckpt-00000003"), 0.5)
    assert fits.seconds == 60.0 and fits.warning is None


def test_a_slow_checkpoint_widens_the_lead_and_says_the_grace_to_use():
    lead = deadline_lead(60.0, (50.0, "ckpt-00000007"), 1.0)
    assert lead.seconds == pytest.approx(1.5 * 50 + 1 + 2)
    assert "ckpt-00000007 took 50.0s" in lead.warning and "pass --grace 78s" in lead.warning


def test_the_lead_leaves_a_short_cycle_a_quarter_of_its_time():
    lead = deadline_lead(10.0, (50.0, "ckpt-00000001"), None, limit=60.0)
    assert lead.seconds == 45.0 and "longer time limit" in lead.warning


def test_the_lead_covers_the_longest_stretch_between_safe_points():
    # A 20 s validation pass between two steps of 0.1 s: a request arriving as it starts is
    # seen 20 s later, so the deadline's checkpoint is asked for before that.
    lead = deadline_lead(10.0, (0.4, "ckpt-00000002"), 0.1, limit=40.0, gap=20.5)
    assert lead.seconds == pytest.approx(1.5 * 0.4 + 20.5 + 2)
    assert "went 20s without a safe point" in lead.warning and "--grace 24s" in lead.warning
    assert "ckpt-00000002 took" not in lead.warning  # the write is not what needs the time
    before_any_checkpoint = deadline_lead(10.0, None, 0.1, gap=20.5)
    assert before_any_checkpoint.seconds == pytest.approx(22.5)


def test_a_need_just_above_the_grace_is_met_without_a_word():
    # The old message: "asked for 2.0s before the end instead of the 2.0s grace".
    lead = deadline_lead(2.0, (0.01, "ckpt-00000003"), 0.02)
    assert lead.seconds == pytest.approx(2.0 + 0.015 + 0.02) and lead.warning is None
    lead = deadline_lead(60.0, (2.0, "ckpt-00000003"), 0.5, gap=60.0)  # 65 s: within 10 %
    assert lead.seconds == pytest.approx(1.5 * 2 + 60 + 2) and lead.warning is None
    far = deadline_lead(2.0, (3.0, "ckpt-00000003"), 0.02)
    assert far.warning is not None and "6.5s before the end, not 2.0s" in far.warning


def test_slurms_kill_wait_shorter_than_a_checkpoint_is_said():
    lead = deadline_lead(120.0, (45.0, "ckpt-00000002"), None, kill_wait=30.0)
    assert lead.seconds == 120.0 and "KillWait=30s" in lead.warning


def test_a_slurm_signal_lead_shorter_than_a_checkpoint_is_said_with_the_directive_to_use():
    lead = deadline_lead(120.0, (60.0, "ckpt-00000004"), None, signal_lead=60.0)
    assert lead.seconds == 120.0 and "--signal=B:USR1@92" in lead.warning


def test_the_signal_lead_is_read_from_the_job_script():
    from procckpt.schedulers.slurm import signal_lead

    assert signal_lead("#!/bin/bash\n#SBATCH --signal=B:USR1@300\nexec x\n") == 300
    assert signal_lead("#!/bin/bash\n#SBATCH --signal=USR1\n") == 60
    assert signal_lead("#!/bin/bash\n#SBATCH -t 10\n") is None


# -- costs from the journal ------------------------------------------------------------------
def test_costs_follow_the_journal_as_it_grows(tmp_path: Path):
    journal = tmp_path / "events.jsonl"
    costs = CheckpointCosts(journal)
    assert not costs.update() and costs.pause is None and costs.longest_durable is None
    append_event(journal, "checkpoint", checkpoint="ckpt-00000001", seconds=2.0, stall=0.1)
    append_event(journal, "checkpoint", checkpoint="ckpt-00000002", seconds=3.0)  # synchronous
    append_event(journal, "trigger", action="checkpoint")
    assert costs.update()
    assert costs.pause == pytest.approx((0.1 + 3.0) / 2)
    append_event(journal, "checkpoint", checkpoint="ckpt-00000003", seconds=9.5, stall=0.2)
    # The launcher's request-to-confirmation time may include the command's start-up: not a cost.
    append_event(journal, "confirmed", checkpoint="ckpt-00000004", seconds=99.0)
    assert costs.update() and costs.longest_durable == (9.5, "ckpt-00000003")
    assert not costs.update()


def test_the_tail_skips_a_line_cut_short_and_reads_it_once_complete(tmp_path: Path):
    journal = tmp_path / "events.jsonl"
    tail = EventTail(journal)
    with open(journal, "w") as f:
        f.write('{"event": "a"}\n{"event": "b"')
    assert [e["event"] for e in tail.new_events()] == ["a"]
    with open(journal, "a") as f:
        f.write(', "x": 1}\n')
    assert tail.new_events() == [{"event": "b", "x": 1}]


# -- hangs -------------------------------------------------------------------------------------
def test_the_heartbeat_goes_through_the_control_dir(tmp_path: Path):
    training, launcher = ControlChannel(tmp_path, "tok"), ControlChannel(tmp_path, "tok")
    assert launcher.heartbeat() is None
    training.beat(7, moves=12)
    beat = launcher.heartbeat()
    assert beat is not None and beat.step == 7 and beat.moves == 12
    ControlChannel(tmp_path, "another cycle").beat(99)
    assert launcher.heartbeat().step == 7  # another cycle's heartbeat is not this one's


def test_hang_detection_starts_with_the_connection_and_measures_steps():
    hangs = HangWatch(30.0)
    hangs.observe(None, connected=False, now=0.0)
    assert hangs.stuck_for(1000.0) is None  # not connected: a slow start is no hang
    hangs.observe(None, connected=True, now=1000.0)
    for step in range(10):
        hangs.observe(Heartbeat(step, 0.0), connected=True, now=1001.0 + 2 * step)
    assert hangs.step_seconds == pytest.approx(2.0) and hangs.last_step == 9
    assert hangs.stuck_for(1019.0 + 30) is None
    assert hangs.stuck_for(1019.0 + 31) == pytest.approx(31)


def test_a_moving_stack_between_steps_is_progress_and_the_longest_gap_is_kept():
    hangs = HangWatch(20.0)
    hangs.observe(None, connected=True, now=0.0)
    hangs.observe(Heartbeat(1, 0.0, moves=3), True, 1.0)
    hangs.observe(Heartbeat(2, 0.0, moves=8), True, 2.0)
    # A 30 s validation pass: no step, but the training moves.
    for t in range(3, 33):
        hangs.observe(Heartbeat(2, 0.0, moves=8 + t), True, float(t))
        assert hangs.stuck_for(float(t) + 0.5) is None
    hangs.observe(Heartbeat(3, 0.0, moves=50, gap=30.2), True, 33.0)
    assert hangs.longest_gap == pytest.approx(30.2)
    # Then stuck: neither the step nor the training moves again.
    for t in range(34, 60):
        hangs.observe(Heartbeat(3, 0.0, moves=50, gap=30.2), True, float(t))
    assert hangs.stuck_for(53.0) is None and hangs.stuck_for(54.0) == pytest.approx(21.0)
    hangs.start_cycle()  # the next cycle's process starts counting again: the run keeps it
    hangs.observe(Heartbeat(1, 0.0, moves=1, gap=0.1), True, 70.0)
    assert hangs.longest_gap == pytest.approx(30.2)


def test_auto_hang_timeout_is_ten_minutes_or_fifty_steps():
    hangs = HangWatch("auto")
    assert hangs.timeout == AUTO_MIN
    hangs.observe(Heartbeat(0, 0.0), True, 0.0)
    hangs.observe(Heartbeat(1, 0.0), True, 60.0)  # a minute per step
    assert hangs.timeout == 50 * 60.0
    assert HangWatch(None).timeout is None


def test_an_answer_the_full_disk_refused_is_sent_once_there_is_room(tmp_path: Path):
    """The launcher asks for no periodic checkpoint while the last one is unanswered: an
    answer lost to a moment of full disk left a run training for hours without any."""
    with mounted_tmpfs(tmp_path / "fs", "1m") as mount:
        launcher, control = ControlChannel(mount, "tok"), ControlChannel(mount, "tok")
        training = SaveTriggers(control, polls_control=True, answers=True, interval=None,
                                save_every=None, save_best=False)
        launcher.send(1, "checkpoint", "interval")
        training.poll(0.0)
        assert training.request is not None and training.request.seq == 1
        fill(mount)
        training.answer(CheckpointInfo(mount / "ckpt-000007", 7, {}), 5, stopping=False)
        assert launcher.read_ack() is None  # refused: nothing to read yet
        training.poll(1.0)
        assert launcher.read_ack() is None  # still full
        (mount / "filler").unlink()
        training.poll(2.0)
        ack = launcher.read_ack()
        assert ack is not None and (ack.seq, ack.checkpoint, ack.step) == (1, "ckpt-000007", 5)


# -- room for the checkpoints to keep (a real 4 MiB tmpfs) ------------------------------------
@pytest.fixture
def tiny_fs(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "fs") as mount:
        yield mount


def test_a_dir_too_small_for_the_checkpoints_to_keep_is_said(tiny_fs: Path):
    store = CheckpointStore(tiny_fs / "ckpt", keep=2).open()
    with store.begin({"step": 1}) as pending:
        (pending.path / "state.pt").write_bytes(os.urandom(1_500_000))
        pending.add_file("state.pt")
        pending.commit()
    message = store.room_shortfall()
    assert message is not None and "keeping 2 checkpoints of 1.5 MB" in message, message
    assert "make room or lower --keep" in message
    assert CheckpointStore(tiny_fs / "ckpt", keep=1).open().room_shortfall() is None
