"""procckpt run with real processes and real signals: exit codes, the signal table, the lock,
the completion marker, crash handling, and the safety of loading."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import time
import zlib
from pathlib import Path

import psutil

from procckpt.protocol.events import read_events

from ..conftest import PROGRAMS, PYTHON, procckpt_argv, run

TINY = [PYTHON, str(PROGRAMS / "tiny_train.py")]


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*procckpt_argv(), "run", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_line(proc: subprocess.Popen[str], prefix: str) -> str:
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the process ended before printing {prefix!r}: "
                         f"{proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]


def events(directory: Path) -> list[dict]:
    return list(read_events(directory / "events.jsonl"))


def test_exit_code_is_the_commands(workdir: Path):
    result = run([*procckpt_argv(), "run", "--", "sh", "-c", "exit 7"], cwd=workdir)
    assert result.returncode == 7
    assert "failed with exit code 7" in result.stderr
    killed = run([*procckpt_argv(), "run", "--dir", "k", "--", "sh", "-c", "kill -9 $$"],
                 cwd=workdir)
    assert killed.returncode == 128 + 9


def test_missing_command_exits_127_with_one_line(workdir: Path):
    result = run([*procckpt_argv(), "run", "--", "no-such-program-xyz"], cwd=workdir)
    assert result.returncode == 127
    assert result.stderr.strip().splitlines() == [
        "procckpt: error: command not found: no-such-program-xyz (check the spelling and PATH)"]


def test_command_runs_in_its_own_session_and_gets_sigint_forwarded(workdir: Path):
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGINT, lambda *a: (print('got SIGINT', flush=True), "
              "sys.exit(130)))\n"
              "print('sid', os.getsid(0), os.getpid(), flush=True)\n"
              "time.sleep(60)\n")
    proc = start(["--", PYTHON, "-c", script], workdir)
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


def test_second_run_on_same_dir_is_refused_and_finished_run_does_not_retrain(workdir: Path):
    first = start(["--dir", "c", "--", *TINY, "--epochs", "1", "--step-sleep", "0.2"], workdir)
    wait_for_line(first, "step 1")
    second = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY], cwd=workdir)
    assert second.returncode != 0
    assert f"is in use by pid {first.pid}" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    first.communicate(timeout=120)
    assert first.returncode == 0
    again = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY], cwd=workdir)
    assert again.returncode == 0
    assert "already finished" in again.stderr and "start step" not in again.stdout
    forced = run([*procckpt_argv(), "run", "--dir", "c", "--force", "--", *TINY, "--epochs", "1"],
                 cwd=workdir)
    assert forced.returncode == 0 and "start step 0" in forced.stdout
    assert list((workdir / "c").glob("previous-*/checkpoints/ckpt-*")), "old checkpoints lost"


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


def test_restart_count_reaches_the_command(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "10s", "--grace", "3s",
                  "--", *TINY, "--epochs", "2", "--n", "256", "--step-sleep", "0.5"],
                 cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr
    starts = [line for line in result.stdout.splitlines() if line.startswith("start step")]
    assert len(starts) >= 2
    assert [s.split()[-1] for s in starts] == [str(i) for i in range(len(starts))]


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


def test_command_without_checkpointer_is_stopped_with_an_explanation(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "4s", "--grace", "2s",
                  "--engine", "hooks", "--", "sleep", "30"], cwd=workdir, timeout=60)
    assert result.returncode == 124  # stopped, nothing saved (75 would mean "checkpointed")
    assert "never connected to procckpt" in result.stderr


def test_foreign_pickle_placed_as_checkpoint_is_rejected_without_running(workdir: Path):
    first = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "1"],
                cwd=workdir)
    assert first.returncode == 0
    ckpt = workdir / "c"
    (ckpt / "COMPLETE").unlink()
    marker = workdir / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Exploit())
    evil = ckpt / "checkpoints" / "ckpt-00000099"
    evil.mkdir()
    (evil / "state.pt").write_bytes(payload)
    (evil / "MANIFEST.json").write_text(
        '{"format": 1, "step": 999, "files": {"state.pt": {"bytes": %d, "crc32": %d}}}'
        % (len(payload), zlib.crc32(payload)))
    result = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "2"],
                 cwd=workdir)
    assert not marker.exists(), "the pickle ran code"
    assert result.returncode == 0, result.stderr
    assert "ckpt-00000099 is unusable: it cannot be loaded safely" in result.stderr
    assert "start step 8 restart 0" in result.stdout  # resumed from the real one


def test_damaged_newest_checkpoint_resumes_from_previous(workdir: Path):
    first = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "3",
                 "--save-every", "1"], cwd=workdir)
    assert first.returncode == 0
    ckpt = workdir / "c"
    (ckpt / "COMPLETE").unlink()
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state.pt").write_bytes(bytes(data))
    result = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "3"],
                 cwd=workdir)
    assert result.returncode == 0
    assert f"checkpoint {newest.name} is unusable: state.pt fails its checksum" in result.stderr
    assert result.stdout.splitlines()[0] == "start step 16 restart 1"  # a rerun: restart 1


def test_processes_the_command_left_running_are_named_when_killed(workdir: Path):
    # A command that starts a daemon of its own (double fork, new session) and exits.
    result = run([*procckpt_argv(), "run", "--dir", "d", "--", "sh", "-c",
                  "setsid sleep 600 & sleep 1; exit 0"], cwd=workdir)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "left 1 process running" in line]
    assert "killed now: pid " in line and "(sleep 600)" in line, line
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "600"]]
