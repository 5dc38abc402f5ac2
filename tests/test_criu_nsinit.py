"""nsinit.py, the CRIU engine's first command: the command in a PID namespace of its own, as
pid 2 below an init that passes the launcher's signals on, with exit codes and deaths by
signal passed back as they were; the command run in place where no namespace can be made.
Real processes and namespaces (root); tests/e2e/test_criu.py images and restores them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procckpt.launcher.engines.criu.engine import NSINIT_SCRIPT, _leads_a_pid_namespace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces need root here")

SHOW = "import os; print(os.getpid(), os.getppid(), os.getsid(0) == os.getppid(), flush=True)"


def nsinit(tmp_path: Path, *command: str, prefix: tuple[str, ...] = (),
           ) -> subprocess.Popen[str]:
    return subprocess.Popen([*prefix, sys.executable, "-I", "-S", NSINIT_SCRIPT,
                             str(tmp_path / "root.pid"), *command], text=True,
                            stdout=subprocess.PIPE, start_new_session=True)


def test_the_command_is_pid_2_of_a_namespace_whose_init_is_written_down(tmp_path: Path):
    proc = nsinit(tmp_path, sys.executable, "-c", SHOW + "\nimport time; time.sleep(30)")
    assert proc.stdout is not None
    try:
        # pid 2, child of the namespace's init (pid 1), which leads the session
        assert proc.stdout.readline().split() == ["2", "1", "True"]
        init = int((tmp_path / "root.pid").read_text())
        assert _leads_a_pid_namespace(init) and not _leads_a_pid_namespace(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("code", ["exit 3", "kill -SEGV $$", "kill -KILL $$"])
def test_the_command_ends_the_way_it_ended_inside(tmp_path: Path, code: str):
    proc = nsinit(tmp_path, "sh", "-c", code)
    expected = {"exit 3": 3, "kill -SEGV $$": -signal.SIGSEGV, "kill -KILL $$": -signal.SIGKILL}
    assert proc.wait(timeout=30) == expected[code]


def test_a_signal_to_the_group_reaches_the_command_once(tmp_path: Path):
    handler = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (print('TERM', flush=True), "
               "sys.exit(5)))\nprint('ready', flush=True)\ntime.sleep(30)\n")
    proc = nsinit(tmp_path, sys.executable, "-c", handler)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGTERM)  # as the launcher signals the keeper's group
    assert proc.wait(timeout=30) == 5
    assert proc.stdout.read() == "TERM\n"


def test_without_the_privilege_the_command_runs_in_place(tmp_path: Path):
    """Root without CAP_SYS_ADMIN cannot make a namespace: the command is exec'd in place,
    with the host's pids, and no root is written (the engine then images the command)."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop a capability")
    drop = ("setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin")
    proc = nsinit(tmp_path, sys.executable, "-c", SHOW, prefix=drop)
    assert proc.stdout is not None
    pid, _, _ = proc.stdout.readline().split()
    assert proc.wait(timeout=30) == 0
    assert int(pid) == proc.pid  # setpriv exec'd nsinit, which exec'd the command
    time.sleep(0.1)
    assert not (tmp_path / "root.pid").exists()


def test_a_daemon_the_command_left_is_named_and_ends_with_the_namespace(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-I", "-S", NSINIT_SCRIPT, str(tmp_path / "root.pid"),
                             "sh", "-c", "setsid sleep 600 & sleep 0.5; exit 0"], text=True,
                            stderr=subprocess.PIPE, start_new_session=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    (line,) = [x for x in err.splitlines() if "left 1 process running" in x]
    assert "killed now: pid " in line and "(sleep 600)" in line, line
    pid = int(line.split("killed now: pid ", 1)[1].split()[0])
    deadline = time.monotonic() + 10
    while _runs_sleep(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _runs_sleep(pid), "the daemon outlived its namespace"


def _runs_sleep(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep")
    except OSError:
        return False
