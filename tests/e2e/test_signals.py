"""What each signal to ``procckpt run`` does, with real processes: SIGTERM and the checkpoint
signal checkpoint and stop, SIGUSR2 checkpoints and goes on, Ctrl-C saves and stops (a second
one kills), a SIGKILL of the launcher takes the command along, and a command killed by a
signal is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ..conftest import PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import TINY, events, reference, start, wait_for_line


def test_command_runs_in_its_own_session_and_gets_sigint_forwarded(workdir: Path):
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGINT, lambda *a: (print('got SIGINT', flush=True), "
              "sys.exit(130)))\n"
              "print('sid', os.getsid(0), os.getpid(), flush=True)\n"
              "time.sleep(60)\n")
    # --engine hooks: a command that saves nothing gets Ctrl-C itself (an image engine would
    # image it and stop, as for any command it can save).
    proc = start(["--engine", "hooks", "--", PYTHON, "-c", script], workdir)
    sid, pid = map(int, wait_for_line(proc, "sid").split()[1:])
    # The session is the command's own, led by procckpt's keeper (its parent; keeper.py),
    # not the launcher's.
    assert sid != os.getsid(proc.pid), "the command is not in a session of its own"
    leader = psutil.Process(sid)
    assert leader.ppid() == proc.pid
    assert any(arg.endswith("keeper.py") for arg in leader.cmdline()), leader.cmdline()
    proc.send_signal(signal.SIGINT)
    assert wait_for_line(proc, "got").strip() == "got SIGINT"
    assert proc.wait(timeout=30) == 130


def test_sigterm_checkpoints_stops_and_the_next_run_resumes(workdir: Path):
    proc = start(["--dir", "c", "--", *TINY, "--epochs", "2", "--step-sleep", "0.2"], workdir)
    wait_for_line(proc, "step 3")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "run the same command again to resume" in err
    saved = [e for e in events(workdir / "c") if e["event"] == "checkpoint"]
    assert saved and saved[-1]["reason"] == "deadline" or saved[-1]["reason"] == "SIGTERM"
    again = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "2"],
                cwd=workdir)
    assert again.returncode == 0, again.stderr
    first_line = again.stdout.splitlines()[0]
    # A rerun after a stop is a restart of the training: the launcher says the number the
    # Checkpointer counts (one more than the checkpoint's), not its own launch's 0.
    assert first_line == f"start step {saved[-1]['step']} restart 1"


def test_sigusr2_checkpoints_without_stopping(workdir: Path):
    proc = start(["--dir", "c", "--", *TINY, "--epochs", "1", "--step-sleep", "0.3"], workdir)
    wait_for_line(proc, "step 2")
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    log = events(workdir / "c")
    assert [e["reason"] for e in log if e["event"] == "checkpoint"][0] == "SIGUSR2"
    assert not [e for e in log if e["event"] == "restart"]
    assert "done" in out


def test_a_usr1_during_a_slow_start_is_answered_by_a_checkpoint(workdir: Path):
    # Slurm's B:USR1 may come a minute early, while the script still imports and sets up:
    # far longer than the 2 s grace. The stop waits for the Checkpointer's first safe point.
    train = [*TINY, "--epochs", "3", "--step-sleep", "0.05", "--start-seconds", "12"]
    proc = start(["--dir", "c", "--time-limit", "10m", "--grace", "2s", "--", *train],
                 workdir)
    deadline = time.monotonic() + 60
    while not [e for e in events(workdir / "c") if e["event"] == "cycle"]:
        assert time.monotonic() < deadline and proc.poll() is None, "no cycle began"
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)  # the command sleeps 12 s before Checkpointer()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]  # checkpointed, nothing lost
    assert "never connected" not in err and "start step 0" in out, err[-3000:]
    saved = [e for e in events(workdir / "c") if e["event"] == "checkpoint"]
    assert [e["reason"] for e in saved] == ["SIGUSR1"], saved
    again = run([*procckpt_argv(), "run", "--dir", "c", "--", *train[:-2]], cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"start step {saved[0]['step']} restart 1" in again.stdout


def test_ctrl_c_checkpoints_and_stops_and_the_rerun_resumes_exactly(workdir: Path):
    args = ["--epochs", "3", "--n", "256"]
    expected = reference(*args)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY, *args, "--out", str(out)]
    proc = subprocess.Popen([*argv, "--step-sleep", "0.2"], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "step 5")
    proc.send_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    assert "Ctrl-C (SIGINT): checkpoint at the next safe point, then stop" in err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    (saved,) = events(ckpt, "checkpoint")
    assert saved["reason"] == "SIGINT" and saved["step"] >= 5, saved
    again = run(argv, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith(f"start step {saved['step']} "), again.stdout[:200]
    assert_bit_identical(expected, out)


def test_a_second_ctrl_c_kills_at_once(workdir: Path):
    ckpt = workdir / "ckpt"
    # The validation pass holds the checkpoint off for 60 s: only the second Ctrl-C ends it.
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY,
                             "--epochs", "2", "--n", "64", "--validate-seconds", "60"],
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_line(proc, "validating")
    proc.send_signal(signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode != 0 and "second Ctrl-C (SIGINT): killing the command now" in err


def test_ctrl_c_on_a_stuck_step_says_that_no_checkpoint_was_taken(workdir: Path):
    ckpt = workdir / "ckpt"
    # A checkpoint every second, then the step after step 8 never ends: Ctrl-C's checkpoint
    # cannot come, and after the grace the command is stopped without one.
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--grace", "5s", "--interval", "1s",
            "--hang-timeout", "off", "--", *TINY, "--epochs", "2", "--n", "256"]
    proc = subprocess.Popen([*argv, "--step-sleep", "0.3", "--hang-at-step", "8"], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "step 8")
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "checkpointed after" not in err, err[-3000:]
    assert ("no checkpoint was taken after SIGINT: the command reached no safe point before it "
            "was stopped, so the work since the last checkpoint is lost; running the same "
            "command again resumes from ckpt-") in last, last
    saved = events(ckpt, "checkpoint")
    assert saved and all(e["reason"] == "interval" for e in saved), saved
    # The newest state: the last periodic checkpoint, or the memory tier's slot the launcher
    # kept once the command was stopped (the steps up to the stuck one).
    newest = max(e["step"] for e in saved + events(ckpt, "tier-kept"))
    assert last.endswith(f" (step {newest})"), (last, saved)
    again = run(argv, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith(f"start step {newest} "), again.stdout[:200]


def test_sigkill_of_the_launcher_takes_every_process_of_a_shell_command_along(workdir: Path):
    marker = f"orphan-check-{os.getpid()}"
    shell = (f"{PYTHON} {PROGRAMS / 'tiny_train.py'} --epochs 50 --step-sleep 0.2 "
             f"--ckpt-dir {marker} & setsid sleep 600 & wait")
    launcher = subprocess.Popen([*procckpt_argv(), "run", "--engine", "hooks", "--dir",
                                 str(workdir / "ckpt"), "--", "sh", "-c", shell], cwd=workdir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((workdir / "ckpt" / "control").glob("hello-*.json")):
            assert launcher.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.1)
        below = psutil.Process(launcher.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in below)
        assert "tiny_train.py" in names and "sleep 600" in names, names
        launcher.kill()  # SIGKILL: no handler, no clean-up of its own
        launcher.wait(timeout=10)
        gone, alive = psutil.wait_procs(below, timeout=10)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # The dir is free again, and nothing writes into it behind the next run's back.
    again = run([*procckpt_argv(), "run", "--engine", "hooks", "--dir", str(workdir / "ckpt"),
                 "--", *TINY, "--epochs", "1"], cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]


def test_processes_the_command_left_running_are_named_when_killed(workdir: Path):
    # A command that starts a daemon of its own (double fork, new session) and exits.
    # (--engine hooks: under the CRIU engine's PID namespace such a daemon ends with the
    # namespace's init, unnamed, and no process is left to name.)
    result = run([*procckpt_argv(), "run", "--engine", "hooks", "--dir", "d", "--", "sh", "-c",
                  "setsid sleep 600 & sleep 1; exit 0"], cwd=workdir)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "left 1 process running" in line]
    assert "killed now: pid " in line and "(sleep 600)" in line, line
    # That process, by its pid: other tests on other workers run `sleep 600` of their own.
    pid = int(line.split("killed now: pid ", 1)[1].split()[0])
    try:
        left = psutil.Process(pid)
        assert left.status() == psutil.STATUS_ZOMBIE or left.cmdline() != ["sleep", "600"], \
            f"pid {pid} (sleep 600) still runs"
    except psutil.NoSuchProcess:
        pass


def test_a_command_killed_by_a_signal_is_named_and_the_rerun_counts_as_a_restart(
        workdir: Path):
    # (Not restarted: by default a crash after a checkpoint of its cycle would be.)
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", "c", "--interval", "1s",
                             "--no-restart-on-failure", "--",
                             *TINY, "--epochs", "50", "--step-sleep", "0.2"], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "checkpoint" for e in events(workdir / "c")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        hello = json.loads(next((workdir / "c" / "control").glob("hello-*.json")).read_text())
        os.kill(hello["pid"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137, stderr[-3000:]
    assert "the command was killed by signal 9 (SIGKILL), not restarted " \
        "(--no-restart-on-failure)" in stderr, stderr[-3000:]
    assert "running the same command again resumes from ckpt-" in stderr, stderr[-3000:]
    again = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "1"],
                cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(restart 1)" in again.stderr, again.stderr[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_during_the_deadlines_stop_ends_the_run_after_its_checkpoint(
        workdir: Path, signum: int):
    """Ctrl-C (or a scheduler's SIGTERM) while the deadline's checkpoint is being taken: the
    user asked to stop, so the run ends with 75 after that checkpoint (it restarted before,
    and a SIGTERM there was dropped without a word)."""
    proc = subprocess.Popen(
        [*procckpt_argv(), "run", "--dir", "c", "--time-limit", "30s", "--grace", "8s", "--",
         *TINY, "--epochs", "4", "--step-sleep", "1.0"], cwd=workdir, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # the launcher's log: wait for the deadline's request
        said.append(line)
        if "then stop (deadline)" in line:
            break
    else:
        raise AssertionError("".join(said[-20:]))
    proc.send_signal(signum)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 75, rest
    log = events(workdir / "c")
    (kept,) = [e for e in log if e["event"] == "stop-signal"]
    assert kept["signal"] == signal.Signals(signum).name and kept["during"] == "deadline"
    assert not [e for e in log if e["event"] == "restart"], rest
    assert [e for e in log if e["event"] == "checkpoint"], rest
    assert "the run stops after it" in rest


def test_a_checkpoint_signal_after_the_training_leaves_the_code_after_it_alone(workdir: Path):
    """Slurm's ``--signal=B:USR1@...`` may come while the script exports its model after the
    loop: the training's final checkpoint is taken, so the launcher asks for none, and the
    export (longer than the grace) runs to its end."""
    script = ("import time, torch, procckpt\n"
              "model = torch.nn.Linear(2, 1)\n"
              "ckpt = procckpt.Checkpointer(model=model)\n"
              "for epoch in ckpt.epochs(2):\n    pass\n"
              "print('exporting', flush=True)\n"
              "time.sleep(6)\n"
              "print('exported', flush=True)\n")
    proc = start(["--grace", "2s", "--", PYTHON, "-c", script], workdir)
    wait_for_line(proc, "exporting")
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "exported" in out, err[-3000:]
    assert "SIGUSR1 after the training finished: nothing left to checkpoint" in err, err[-3000:]
