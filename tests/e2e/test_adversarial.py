"""What a new (or hostile) user tries: a launcher killed outright, unreadable and damaged
checkpoints, links planted in the checkpoint dir, a full disk, bad values everywhere, early
exits. Real processes, signals, permissions (capabilities dropped with setpriv, since root
would bypass them) and a real tmpfs; every failure must be one line that says what to do,
and nothing may be lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from procckpt.protocol.events import read_events

from ..conftest import PROGRAMS, PYTHON, mounted_tmpfs, procckpt_argv, run

TINY = [PYTHON, str(PROGRAMS / "tiny_train.py")]
LOADER = [PYTHON, str(PROGRAMS / "loader_train.py")]
#: Run a command as root without the capabilities that bypass file permissions.
NO_DAC = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="dropping root's file-permission capabilities needs root and util-linux's setpriv")


def events(directory: Path) -> list[dict]:
    return list(read_events(directory / "events.jsonl"))


def procckpt_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("procckpt")]


def alone(workdir: Path, ckpt: Path, *args: str, prefix: list[str] | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The tiny training script run on its own (no launcher) on checkpoint dir ``ckpt``."""
    return run([*(prefix or []), *TINY, "--ckpt-dir", str(ckpt), *args], cwd=workdir,
               env=env)


def one_error_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# -- 2: the launcher killed outright ---------------------------------------------------------
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


# -- 3: a read error is not damage -----------------------------------------------------------
@needs_setpriv
def test_an_unreadable_checkpoint_stops_the_run_and_is_not_renamed(workdir: Path):
    ckpt = workdir / "ckpt"
    first = alone(workdir, ckpt, "--epochs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    (ckpt / "COMPLETE").unlink()  # pretend training goes on, so that it must resume
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    (newest / "state.pt").chmod(0)
    result = alone(workdir, ckpt, "--epochs", "3", prefix=NO_DAC)
    line = one_error_line(result, 74, f"cannot read {newest / 'state.pt'}", "Permission denied")
    assert "nothing was renamed" in line
    assert sorted((ckpt / "checkpoints").iterdir())[-1] == newest  # no .corrupt, no fallback
    assert "step " not in result.stdout
    (newest / "state.pt").chmod(0o644)
    fixed = alone(workdir, ckpt, "--epochs", "3")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert f"resumed from {newest.name}" in fixed.stderr


# -- 4: links inside the dir, names outside the checkpoint -----------------------------------
def test_links_planted_in_the_dir_are_refused_not_followed(workdir: Path):
    ckpt = workdir / "ckpt"
    assert alone(workdir, ckpt, "--epochs", "1").returncode == 0
    (ckpt / "COMPLETE").unlink()
    precious = workdir / "precious.txt"
    precious.write_text("keep me\n")
    (ckpt / "lock").unlink()
    (ckpt / "lock").symlink_to(precious)
    result = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY], cwd=workdir)
    one_error_line(result, 2, "is a symbolic link", "remove it")
    alone_result = alone(workdir, ckpt)
    one_error_line(alone_result, 2, "is a symbolic link")
    assert precious.read_text() == "keep me\n"

    (ckpt / "lock").unlink()
    (ckpt / "events.jsonl").unlink()
    (ckpt / "events.jsonl").symlink_to(precious)
    ok = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY, "--epochs", "2"],
             cwd=workdir)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert precious.read_text() == "keep me\n"  # the journal was not appended through it


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/dev/zero"])
def test_manifest_names_outside_the_checkpoint_are_damage(workdir: Path, name: str):
    ckpt = workdir / "ckpt"
    assert alone(workdir, ckpt, "--epochs", "2").returncode == 0
    (ckpt / "COMPLETE").unlink()
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    manifest["files"][name] = {"bytes": 1 << 30, "crc32": 1}
    (newest / "MANIFEST.json").write_text(json.dumps(manifest))
    started = time.monotonic()
    result = alone(workdir, ckpt, "--epochs", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 60  # /dev/zero is not read
    assert f"checkpoint {newest.name} is unusable" in result.stderr
    assert "not a plain name" in result.stderr
    assert (newest.parent / f"{newest.name}.corrupt").is_dir()


# -- 5: a full disk --------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(workdir: Path):
    with mounted_tmpfs(workdir / "tmpfs") as mount:
        yield mount


def fill(directory: Path) -> None:
    """Write zeros into ``directory`` until its file system is full."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_full_disk_is_one_line_one_cycle_and_the_previous_checkpoint_intact(small_tmpfs):
    ckpt = small_tmpfs / "ckpt"
    proc = subprocess.Popen(
        [*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "14s", "--grace", "4s",
         "--interval", "2s", "--", *TINY, "--epochs", "50", "--step-sleep", "0.2"],
        cwd=small_tmpfs.parent, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "checkpoint" for e in events(ckpt)):
            assert proc.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.1)
        kept = sorted((ckpt / "checkpoints").glob("ckpt-*"))
        fill(small_tmpfs)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 74, stderr[-3000:]
    assert "Traceback" not in stderr and "unexpected pos" not in stderr, stderr[-3000:]
    assert f"error: no space left in {ckpt}: need " in stderr, stderr[-3000:]
    assert "could not write the checkpoint request" in stderr  # the launcher carried on
    assert "is not restarted" in stderr, stderr[-3000:]
    assert "verified intact" in stderr, stderr[-3000:]  # the launcher checked the newest one
    assert len([e for e in events(ckpt) if e["event"] == "cycle"]) == 1
    (small_tmpfs / "filler").unlink()
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=small_tmpfs.parent)
    for path in kept:  # every checkpoint from before the disk filled up is intact
        assert any(line.startswith(path.name) and line.endswith("yes")
                   for line in status.stdout.splitlines()), status.stdout


# -- 6: bad input gets one line and exit 2 ---------------------------------------------------
@pytest.mark.parametrize("yaml_text, needle", [
    ("time-limit: null\n", "time-limit in procckpt.yaml is empty"),
    ("time-limit: [1, 2]\n", "time-limit in procckpt.yaml is a list"),
    ("time-limit: .inf\n", "more than ten years"),
    ("dir: null\n", "dir in procckpt.yaml is empty"),
])
def test_bad_config_values_are_one_line(workdir: Path, yaml_text: str, needle: str):
    (workdir / "procckpt.yaml").write_text(yaml_text)
    result = run([*procckpt_argv(), "run", "--", "true"], cwd=workdir)
    one_error_line(result, 2, needle)
    assert not (workdir / "None").exists()


@pytest.mark.parametrize("args, env, needle", [
    (["--time-limit", "9" * 400], {}, "more than ten years"),
    (["--time-limit", "nan"], {}, "bad time-limit"),
    ([], {"PROCCKPT_ASYNC": "maybe"}, "bad PROCCKPT_ASYNC='maybe'"),
])
def test_bad_values_from_the_command_line_and_environment_are_one_line(
        workdir: Path, args: list[str], env: dict[str, str], needle: str):
    result = run([*procckpt_argv(), "run", *args, "--", "true"], cwd=workdir, env=env)
    one_error_line(result, 2, needle)


def test_milliseconds_are_a_duration(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "60s", "--grace",
                  "2500ms", "--", *TINY, "--epochs", "1"], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_script_alone_says_bad_input_in_one_line(workdir: Path):
    ckpt = workdir / "ckpt"
    one_error_line(alone(workdir, ckpt, env={"PROCCKPT_ASYNC": "maybe"}), 2,
                   "bad PROCCKPT_ASYNC")
    restart = alone(workdir, ckpt, "--epochs", "1", env={"PROCCKPT_RESTART": "abc"})
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "ignoring PROCCKPT_RESTART='abc'" in restart.stderr


def test_the_script_alone_on_a_dir_the_launcher_holds_is_one_line(workdir: Path):
    ckpt = workdir / "ckpt"
    launcher = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY,
                                 "--epochs", "50", "--step-sleep", "0.2"], cwd=workdir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((ckpt / "control").glob("hello-*.json")):
            assert launcher.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.1)
        one_error_line(alone(workdir, ckpt), 2, f"is in use by pid {launcher.pid}")
    finally:
        launcher.kill()
        launcher.wait()


@needs_setpriv
def test_a_dir_of_another_user_is_one_line(workdir: Path):
    theirs = workdir / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    ckpt = theirs / "ckpt"
    launched = run([*NO_DAC, *procckpt_argv(), "run", "--dir", str(ckpt), "--", "true"],
                   cwd=workdir)
    one_error_line(launched, 2, f"{ckpt}", "Permission denied")
    one_error_line(alone(workdir, ckpt, prefix=NO_DAC), 2, f"{ckpt}", "Permission denied")


def test_a_manifest_of_the_wrong_shape_falls_back_and_status_shows_it(workdir: Path):
    ckpt = workdir / "ckpt"
    assert alone(workdir, ckpt, "--epochs", "2").returncode == 0
    (ckpt / "COMPLETE").unlink()
    newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))[-1]
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    manifest["files"] = {"state.pt": "x"}
    (newest / "MANIFEST.json").write_text(json.dumps(manifest))
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert any(line.startswith(newest.name) and "malformed" in line
               for line in status.stdout.splitlines()), status.stdout
    result = alone(workdir, ckpt, "--epochs", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint {newest.name} is unusable: its manifest is malformed" in result.stderr


# -- 8: endings that say what happened -------------------------------------------------------
def test_break_out_of_the_epochs_loop_says_what_to_write(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--", *LOADER, "--epochs", "5",
                  "--break-at-step", "13"], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the ckpt.epochs() loop was left before its end" in result.stderr
    assert "call ckpt.finish() before break" in result.stderr
    assert "so the run is not marked complete and running it again" in result.stderr
    assert not (workdir / "c" / "COMPLETE").exists()


def test_a_script_that_cannot_be_checkpointed_is_told_at_the_start(workdir: Path):
    script = workdir / "plain.py"
    script.write_text("import time\nfor i in range(100):\n    print(i, flush=True)\n"
                      "    time.sleep(0.2)\n")
    env = {"PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if not (Path(p) / "dmtcp_launch").exists())}
    result = run([*procckpt_argv(), "run", "--time-limit", "6s", "--grace", "2s", "--",
                  PYTHON, str(script)], cwd=workdir, env=env)
    assert result.returncode == 124, result.stderr[-3000:]
    lines = procckpt_lines(result.stderr)
    warned = [i for i, line in enumerate(lines) if "does not import procckpt" in line]
    started = [i for i, line in enumerate(lines) if "cycle 1: started" in line]
    assert warned and started and warned[0] < started[0], lines
    assert "nothing was saved and a rerun starts from the beginning" in result.stderr
    assert "stays the one to resume" not in result.stderr


def test_a_command_killed_by_a_signal_is_named_and_the_rerun_counts_as_a_restart(
        workdir: Path):
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", "c", "--interval", "1s", "--",
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
    assert "the command was killed by signal 9 (SIGKILL)" in stderr, stderr[-3000:]
    assert "running the same command again resumes from ckpt-" in stderr, stderr[-3000:]
    again = run([*procckpt_argv(), "run", "--dir", "c", "--", *TINY, "--epochs", "1"],
                cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(restart 1)" in again.stderr, again.stderr[-3000:]


def test_a_crash_inside_the_loop_is_not_taken_for_a_break(workdir: Path):
    result = run([*TINY, "--epochs", "3", "--fail-at-step", "3", "--ckpt-dir",
                  str(workdir / "c")], cwd=workdir)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "left before its end" not in result.stderr, result.stderr[-3000:]
