"""Protection without a time limit and a deadline's lead: periodic checkpoints that a rerun
after a SIGKILL resumes from, a checkpoint in a launcher's first minute, a grace that fits what
checkpoints take and a validation pass before the deadline."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ..conftest import assert_bit_identical, procckpt_argv, run
from ..harness.processes import ASYNC, TINY, events, reference


def test_without_a_time_limit_the_rerun_after_a_sigkill_resumes_from_a_periodic_checkpoint(
        workdir: Path):
    args = ["--epochs", "80", "--step-sleep", "0.02"]
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # No --interval and no --time-limit: periodic checkpoints come by default (auto); --mtbf
    # says failures are frequent here, so they come within seconds.
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--mtbf", "10s", "--", *TINY, *args,
            "--out", str(out)]
    launcher = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not [e for e in events(ckpt, "checkpoint") if e.get("step", 0) >= 60]:
            assert launcher.poll() is None and time.monotonic() < deadline, \
                "no periodic checkpoint past step 60"
            time.sleep(0.1)
        launcher.kill()  # the node (or the OOM killer) takes the launcher: no clean-up at all
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    saved = max(e["step"] for e in events(ckpt, "checkpoint"))
    again = run(argv, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    start = next(line for line in again.stdout.splitlines() if line.startswith("start step"))
    assert int(start.split()[2]) >= saved >= 60, start  # not from step 0
    assert all(e["reason"] == "interval" for e in events(ckpt, "trigger")
               if e["action"] == "checkpoint")
    assert_bit_identical(expected, out)
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert "periodic checkpoints: every" in status.stdout and "Young/Daly" in status.stdout, \
        status.stdout


def test_a_launcher_killed_in_its_first_minute_leaves_a_checkpoint(workdir: Path):
    args = ["--epochs", "40", "--n", "256"]  # 320 steps
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # No --time-limit, no --interval, no --mtbf: the defaults alone protect the first minute.
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY, *args,
            "--step-sleep", "0.25", "--out", str(out)]
    launcher = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(65)
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        launcher.kill()  # the node (or the OOM killer) takes the launcher: no clean-up at all
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    saved = [e for e in events(ckpt, "checkpoint") if e.get("reason") == "interval"]
    assert saved, "no periodic checkpoint within 65 s"
    # The rerun (faster: the sleep only paced the first one) says where it starts.
    again = run([*argv[:-4], "--out", str(out)], cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    newest = max(saved, key=lambda e: e["step"])
    assert f"the command resumes from {newest['checkpoint']} (step {newest['step']})" \
        in again.stderr, again.stderr[-3000:]
    start = next(line for line in again.stdout.splitlines() if line.startswith("start step"))
    assert int(start.split()[2]) == newest["step"] > 0, start
    assert_bit_identical(expected, out)


def test_a_grace_shorter_than_a_measured_checkpoint_is_said_with_the_number_to_use(
        workdir: Path):
    ckpt = workdir / "ckpt"
    # Each checkpoint of this state is slowed to take about 3 s to become durable.
    # (24-s cycles: with 16-s ones, a loaded CI runner's cycles were start-up and stop, a
    # few steps each, and the run ran out of its 20 restarts.)
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "24s", "--grace",
               "2s", "--interval", "3s", "--", *ASYNC, "--dir", str(ckpt), "--epochs", "12",
               "--samples", "400", "--width", "4096", "--chunk", "65536", "--write-pause", "0.2",
               "--step-sleep", "0.05"], cwd=workdir, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    warned = events(ckpt, "grace-short")
    # Said in the first cycle, as soon as a measured checkpoint showed it: a run that ends
    # before its first deadline (a quick machine's) is told too.
    assert warned and warned[0]["cycle"] == 1, res.stderr[-3000:]
    assert "to become durable" in res.stderr and "pass --grace " in res.stderr
    needed = int(warned[0]["message"].split("pass --grace ")[1].split("s")[0])
    assert needed > 2
    # Asked that much earlier, every stop's checkpoint was confirmed in time. (30 s of steps
    # against a 24-s limit: at least one deadline stop everywhere.)
    assert [e for e in events(ckpt, "trigger") if e["reason"] == "deadline"], res.stderr[-3000:]
    # (But where the deadline came as the last cycle's training had finished its steps and
    # wrote its output, no safe point was left to answer: seen on a loaded machine.)
    finished = {e["cycle"] for e in events(ckpt, "cycle-end") if e["ended"] == "finished"}
    assert all(e["cycle"] in finished for e in events(ckpt, "unconfirmed")), res.stderr[-3000:]


def test_the_deadline_is_asked_for_early_enough_to_cover_a_validation_pass(workdir: Path):
    args = ["--epochs", "3", "--n", "256", "--step-sleep", "0.2"]  # 8 steps of 0.2 s an epoch
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "40s",
               "--term-timeout", "20s", "--", *TINY, *args, "--validate-seconds", "20",
               "--out", str(out)], cwd=workdir, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    stops = [e for e in events(ckpt, "trigger") if e["reason"] == "deadline"]
    assert len(stops) >= 2, res.stderr[-4000:]
    # The first cycle cannot know of the validation pass; once it was seen, the deadline's
    # checkpoint is asked for early enough that it lands before the end: every stop after the
    # first cycle is confirmed within its grace, and each cycle journals the lead it learned.
    assert all(e["cycle"] == 1 for e in events(ckpt, "unconfirmed")), res.stderr[-4000:]
    leads = [e["lead"] for e in events(ckpt, "cycle")]
    assert all(lead >= 20 for lead in leads[1:]), leads
    assert "without a safe point" in res.stderr, res.stderr[-4000:]
    # Said once, not at every cycle's start (again only if the lead grew by a tenth, which a
    # loaded machine can make the measured gap do).
    said = res.stderr.count("without a safe point")
    assert said == 1 or said < len(events(ckpt, "cycle")), res.stderr[-4000:]
    assert_bit_identical(expected, out)


def test_the_longest_stretch_without_a_safe_point_is_journalled_and_a_new_launch_leads_by_it(
        workdir: Path):
    """An 8-s validation at each epoch's end: the checkpoints journal the stretch (the journal
    held no gap at all before), and the next launch on the dir (a requeued job's launcher
    starts afresh) asks for its deadline's checkpoint early enough from its first cycle."""
    train = [*TINY, "--epochs", "6", "--n", "128", "--step-sleep", "0.2",
             "--validate-seconds", "8"]
    first = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "30s", "--grace", "3s",
                 "--max-restarts", "0", "--", *train], cwd=workdir, timeout=300)
    assert first.returncode == 75, first.stderr[-3000:]
    gaps = [e.get("gap") for e in events(workdir / "c", "checkpoint")]
    assert max(g or 0 for g in gaps) >= 7.5, gaps
    again = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "30s", "--grace", "3s",
                 "--max-restarts", "0", "--", *train], cwd=workdir, timeout=300)
    assert again.returncode in (0, 75), again.stderr[-3000:]
    cycles = events(workdir / "c", "cycle")
    assert cycles[0]["lead"] == 3.0 and cycles[-1]["lead"] >= 10, cycles
    assert "without a safe point" in again.stderr, again.stderr[-3000:]
