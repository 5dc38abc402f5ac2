"""What ``procckpt run`` exits with and when it restarts: the command's own exit code, a crash
restarted when its cycle had saved a checkpoint, the restart count the command sees, a finished
run that is not trained again unless forced."""

from __future__ import annotations

import json
from pathlib import Path

from ..conftest import procckpt_argv, run
from ..harness.processes import TINY, events


def test_exit_code_is_the_commands(workdir: Path):
    result = run([*procckpt_argv(), "run", "--", "sh", "-c", "exit 7"], cwd=workdir)
    assert result.returncode == 7
    assert "failed with exit code 7" in result.stderr
    killed = run([*procckpt_argv(), "run", "--dir", "k", "--", "sh", "-c", "kill -9 $$"],
                 cwd=workdir)
    assert killed.returncode == 128 + 9


def test_a_crash_after_a_checkpoint_is_restarted_and_one_that_repeats_ends_in_a_line(
        workdir: Path):
    """The default: a crash (exit 3 at step 12, once) after the cycle saved a checkpoint (at
    the end of epoch 1, step 8) is restarted from it and the run ends; a bug (SIGSEGV at step
    12 at every start) is restarted once, crashes again before it saves anything and ends the
    run in one line; one before any checkpoint ends it at once; --no-restart-on-failure ends
    it. Without the memory tier (test_memory_tier.py has the crashes with it), so that the
    restarts resume from these checkpoints, wherever the machine's speed put the tier's."""
    once = run([*procckpt_argv(), "run", "--dir", "once", "--no-memory-tier", "--", *TINY,
                "--epochs", "2", "--save-every", "1", "--fail-at-step", "12"], cwd=workdir)
    assert once.returncode == 0, once.stderr[-3000:]
    assert "restarting at once (it saved a checkpoint in this cycle; --no-restart-on-failure " \
        "ends the run instead)" in once.stderr, once.stderr[-3000:]
    assert "start step 8 restart 1" in once.stdout, once.stdout

    bug = run([*procckpt_argv(), "run", "--dir", "bug", "--no-memory-tier", "--", *TINY,
               "--epochs", "3", "--save-every", "1", "--crash-at-step", "12"], cwd=workdir)
    assert bug.returncode == 128 + 11, bug.stderr[-3000:]
    assert bug.stdout.count("step 11\n") == 2 and "start step 8 restart 1" in bug.stdout
    last = bug.stderr.strip().splitlines()[-1]
    assert "the command was killed by signal 11 (SIGSEGV) before it saved a checkpoint in this " \
        "cycle, so a restart would most likely fail the same way: not restarted" in last, last
    assert "resumes from ckpt-" in last, last

    early = run([*procckpt_argv(), "run", "--dir", "early", "--no-memory-tier", "--", *TINY,
                 "--epochs", "1", "--fail-at-step", "4"], cwd=workdir)
    assert early.returncode == 3 and "restart 1" not in early.stdout, early.stderr[-3000:]
    assert "before it saved a checkpoint in this cycle" in early.stderr, early.stderr[-3000:]
    asked = run([*procckpt_argv(), "run", "--dir", "early", "--restart-on-failure",
                 "--no-memory-tier", "--",
                 *TINY, "--epochs", "1", "--fail-at-step", "4"], cwd=workdir)
    assert asked.returncode == 0 and "restart 1" in asked.stdout, asked.stderr[-3000:]

    never = run([*procckpt_argv(), "run", "--dir", "never", "--no-restart-on-failure", "--",
                 *TINY, "--epochs", "2", "--save-every", "1", "--fail-at-step", "12"],
                cwd=workdir)
    assert never.returncode == 3, never.stderr[-3000:]
    assert "not restarted (--no-restart-on-failure)" in never.stderr, never.stderr[-3000:]


def test_a_restart_after_a_crash_is_timed_phase_by_phase(workdir: Path):
    """A crash at step 12, restarted by --restart-on-failure: the resumed training journals
    where the time from the crash seen to its first resumed step went, and procckpt status
    shows it. The phases add up to the whole, and the goodput adds up the restarts'."""
    done = run([*procckpt_argv(), "run", "--dir", "b", "--restart-on-failure", "--",
                *TINY, "--epochs", "2", "--save-every", "1", "--fail-at-step", "12"],
               cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    [recovery] = events(workdir / "b", "recovery")
    phases = ("backoff", "spawn", "imports", "checkpointer", "restore", "first_step")
    assert all(recovery[p] >= 0 for p in phases), recovery
    assert recovery["backoff"] < 1.0  # the first failure after progress: restarted at once
    assert recovery["imports"] > recovery["restore"]  # python and torch, not the small state
    assert abs(sum(recovery[p] for p in phases) - recovery["total"]) < 0.1, recovery
    status = run([*procckpt_argv(), "status", "b"], cwd=workdir)
    assert "last restart: " in status.stdout and "from the end of the cycle before to the " \
        "end of the first resumed step: back-off 0." in status.stdout, status.stdout
    # The goodput adds the restarts' phases up (here the one), in status, its JSON and the
    # report.
    assert f"1 restart timed, {recovery['total']:.2f}s from the cycles' ends to their first " \
        f"resumed steps: back-off {recovery['backoff']:.2f}s" in status.stdout, status.stdout
    data = json.loads(run([*procckpt_argv(), "status", "--json", "b"], cwd=workdir).stdout)
    timed = data["goodput"]["recoveries"]
    assert timed["restarts"] == 1 and abs(timed["seconds"]["total"] - recovery["total"]) < 1e-3
    assert abs(timed["seconds"]["restore"] - recovery["restore"]) < 1e-3, timed
    report = run([*procckpt_argv(), "report", "b"], cwd=workdir)
    assert report.returncode == 0, report.stderr
    assert "1 restart timed, " in (workdir / "b" / "report.html").read_text()


def test_restart_count_reaches_the_command(workdir: Path):
    # 32 steps of 0.5 s (16 s) against cycles that train 13 s less their start (1-10 s,
    # quiet to slowed): two cycles or more, each with time to train.
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "16s", "--grace", "3s",
                  "--", *TINY, "--epochs", "4", "--n", "256", "--step-sleep", "0.5"],
                 cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    starts = [line for line in result.stdout.splitlines() if line.startswith("start step")]
    assert len(starts) >= 2
    # Each cycle's command is told its restart number. (Under load a cycle can end while its
    # script still imports, before it says anything: seen in CI, imports of 10-12 s against
    # a 13-s cycle. The next one is a restart more.)
    said = [int(s.split()[-1]) for s in starts]
    cycles = [e["restart"] for e in events(workdir / "c") if e["event"] == "cycle"]
    assert said[0] == 0 and said[-1] == cycles[-1], (said, cycles)
    assert said == sorted(set(said)) and set(said) <= set(cycles), (said, cycles)


def test_a_rerun_of_a_script_that_finished_early_trains_nothing_unless_forced(workdir: Path):
    argv = [*TINY, "--epochs", "3", "--finish-at-step", "5", "--ckpt-dir", str(workdir / "c")]
    first = run(argv, cwd=workdir)
    assert first.returncode == 0 and "step 5" in first.stdout, first.stderr[-3000:]
    again = run(argv, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [line for line in again.stdout.splitlines() if line.startswith("step ")], \
        again.stdout
    assert "already finished (step 5); nothing to train" in again.stderr, again.stderr
    forced = run(argv, cwd=workdir, env={"PROCCKPT_FORCE": "1"})
    assert forced.returncode == 0 and "step 1\n" in forced.stdout, forced.stderr[-3000:]
    assert "PROCCKPT_FORCE: the finished run's checkpoints moved to" in forced.stderr


def test_a_first_cycle_shorter_than_a_slow_start_restarts_and_the_run_finishes(workdir: Path):
    """The script imports procckpt but is still starting (20 s before its Checkpointer, the
    first cycle alone) when the first cycle's deadline comes: a slow start, counted as a
    cycle without progress, not a script without procckpt (that ended the run with 124)."""
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "15s", "--grace",
                  "3s", "--", *TINY, "--epochs", "2", "--step-sleep", "0.1",
                  "--slow-first-start", "20"], cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cycle 1 ended before the command connected to procckpt: a slow start (" in (
        result.stderr), result.stderr[-3000:]
    assert "use procckpt.Checkpointer" not in result.stderr
    assert "training finished" in result.stderr
