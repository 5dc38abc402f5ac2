"""What ``procckpt run`` exits with and when it restarts: the command's own exit code, a crash
restarted only when asked, the restart count the command sees, a finished run that is not
trained again unless forced."""

from __future__ import annotations

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


def test_crash_is_not_restarted_unless_asked(workdir: Path):
    crash = run([*procckpt_argv(), "run", "--dir", "a", "--", *TINY, "--epochs", "1",
                 "--save-every", "1", "--fail-at-step", "4"], cwd=workdir)
    assert crash.returncode == 3
    assert "--restart-on-failure" in crash.stderr
    retried = run([*procckpt_argv(), "run", "--dir", "b", "--restart-on-failure", "--",
                   *TINY, "--epochs", "2", "--save-every", "1", "--fail-at-step", "12"],
                  cwd=workdir)
    assert retried.returncode == 0, retried.stderr
    assert "restart 1" in retried.stdout and "done" in retried.stdout


def test_a_restart_after_a_crash_is_timed_phase_by_phase(workdir: Path):
    """A crash at step 12, restarted by --restart-on-failure: the resumed training journals
    where the time from the crash seen to its first resumed step went, and procckpt status
    shows it. The phases add up to the whole."""
    done = run([*procckpt_argv(), "run", "--dir", "b", "--restart-on-failure", "--",
                *TINY, "--epochs", "2", "--save-every", "1", "--fail-at-step", "12"],
               cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    [recovery] = events(workdir / "b", "recovery")
    phases = ("backoff", "spawn", "imports", "checkpointer", "restore", "first_step")
    assert all(recovery[p] >= 0 for p in phases), recovery
    assert recovery["backoff"] >= 2.0  # the first back-off after a failure
    assert recovery["imports"] > recovery["restore"]  # python and torch, not the small state
    assert abs(sum(recovery[p] for p in phases) - recovery["total"]) < 0.1, recovery
    status = run([*procckpt_argv(), "status", "b"], cwd=workdir)
    assert "last restart: " in status.stdout and "from the end of the cycle before to the " \
        "end of the first resumed step: back-off 2." in status.stdout, status.stdout


def test_restart_count_reaches_the_command(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "10s", "--grace", "3s",
                  "--", *TINY, "--epochs", "2", "--n", "256", "--step-sleep", "0.5"],
                 cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    starts = [line for line in result.stdout.splitlines() if line.startswith("start step")]
    assert len(starts) >= 2
    assert [s.split()[-1] for s in starts] == [str(i) for i in range(len(starts))]


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
