"""The CRIU engine, end to end with real CRIU (4.1 or newer; CI builds 4.2 with the shared
script), real processes and real signals.

A script that knows nothing of procckpt and reads its data through ``DataLoader(num_workers=2)``
is imaged as a whole tree (the workers included): stopped by ``--time-limit`` and restored by
the next cycle, each step trained once; imaged periodically and SIGKILLed, then restored from
its newest image; restored by a fresh launcher after the first one was killed. Each ends
bit-identical to an uninterrupted run. Without a usable CRIU they skip with the reason; the
one-line refusals of ``--engine criu`` run everywhere.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch

from procckpt.launcher.engines.criu import criu_problem, find_criu
from procckpt.store import CheckpointStore

from ..conftest import PROGRAMS, PYTHON, procckpt_argv, run
from ..harness import shared
from ..harness.processes import events

# One worker runs the module, one test at a time: an image with the host's pids (the
# unprivileged test's, the host-pids test's) restores only where they are free, and the pid
# test below moves the kernel's next pid back, among the pids of any image taken beside it.
# And two trees of 670 MB dumped at once on two cores took 8 s an image (the unprivileged
# test's deadline image outlasted its 5-s grace; the launcher now waits for it).
pytestmark = pytest.mark.xdist_group("criu")

LOOP = [PYTHON, str(PROGRAMS / "worker_loop.py")]
_TOOLS, _PROBLEM = criu_problem(find_criu())


def needs_criu(test: Callable[..., None]) -> Callable[..., None]:
    return pytest.mark.skipif(_TOOLS is None, reason=f"no usable CRIU here: {_PROBLEM}")(test)


def reference(args: list[str] | None = None) -> Path:
    """worker_loop.py's uninterrupted result, made once a session (harness/shared.py)."""
    def make(where: Path) -> Path:
        out = where / "reference.pt"
        done = run([*LOOP, *(args or []), "--step-sleep", "0", "--out", str(out)], cwd=where)
        assert done.returncode == 0, done.stderr[-3000:]
        return out

    return shared.once(["worker_loop", *(args or [])], make)


def assert_same(a: Path, b: Path) -> None:
    ra, rb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    for key, value in ra["model"].items():
        assert torch.equal(value, rb["model"][key]), key
    for p, state in ra["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, rb["optimizer"]["state"][p][key]), (p, key)
    assert torch.equal(ra["draw"], rb["draw"])


def steps(text: str) -> list[int]:
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]


@needs_criu
def test_deadline_cycles_restore_the_whole_tree_each_step_once(workdir: Path):
    """96 steps of 0.25 s (24 s) against 25-s cycles: at least one stop's image, restored
    with its two workers; the steps printed go 1..96 once each, the result bit-identical. No
    --engine: auto gives CRIU a script that does not import procckpt. (With 15-s cycles, a
    loaded CI runner spent most of each on the restore and the dump, 2-9 s each for the 676 MB
    tree, and ran out of its 20 restarts.)"""
    expected = reference()
    out, ckpt = workdir / "out.pt", workdir / "ckpt"
    done = run([*procckpt_argv(), "run", "--dir", str(ckpt),
                "--time-limit", "25s", "--grace", "5s", "--",
                *LOOP, "--step-sleep", "0.25", "--out", str(out)], cwd=workdir, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "engine: criu (the command does not import procckpt and CRIU " in done.stderr
    # (the launcher's log on failure: whether an image failed, or a restore, and why)
    assert steps(done.stdout) == list(range(1, 97)), done.stderr[-6000:]
    resumes = events(ckpt, "resume")
    assert resumes and all(e["engine"] == "criu" for e in resumes), done.stderr[-3000:]
    images = events(ckpt, "checkpoint")
    assert images and all(e["reason"] == "deadline" for e in images)
    assert "criu: restoring ckpt-" in done.stderr
    assert_same(expected, out)


@needs_criu
def test_a_tree_that_ends_at_once_when_resumed_is_restored(workdir: Path):
    """A process of 200 threads whose first act after its restore is to exit (as a
    DataLoader worker imaged as its epoch ended). Were it resumed while CRIU still holds
    some of its threads, its exit would end them under CRIU, which then fails the whole
    restore ("Unable to detach"); the tree is resumed only once CRIU let go of all."""
    ckpt = workdir / "ckpt"
    image = ckpt / "checkpoints" / "ckpt-00000001"
    done = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--engine", "criu",
                "--time-limit", "8s", "--grace", "3s", "--",
                PYTHON, str(PROGRAMS / "ends_on_resume.py"), str(image)],
               cwd=workdir, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["checkpoint"] for e in events(ckpt, "resume")] == [image.name], done.stderr[-3000:]
    assert not events(ckpt, "restore-failed"), done.stderr[-3000:]
    assert done.stdout.splitlines() == ["threads started", "resumed"], done.stdout


@needs_criu
def test_a_restore_that_failed_once_is_tried_again_before_an_older_image(workdir: Path):
    """CRIU's first restore fails at its very end, as a real one may (its pid file written,
    the tree killed): the same image is restored again, not the one before it (here, none:
    the run would have had to start over). A fault at the seam: CRIU in front of the real
    one, failing its first restore only."""
    ckpt = workdir / "ckpt"
    image = ckpt / "checkpoints" / "ckpt-00000001"
    criu = workdir / "criu"
    criu.write_text(f"""#!/bin/bash
if [ "$1" = restore ] && [ ! -e {workdir}/failed-once ]; then
    touch {workdir}/failed-once
    while [ $# -gt 0 ]; do
        case "$1" in --pidfile) pidfile=$2 ;; -W) work=$2 ;; -o) log=$2 ;; esac
        shift
    done
    echo $$ > "$pidfile"
    echo "Error (criu/cr-restore.c:1917): Unable to detach 4242: No such process" > "$work/$log"
    exit 1
fi
exec {find_criu()} "$@"
""")
    criu.chmod(0o755)
    done = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--engine", "criu",
                "--time-limit", "8s", "--grace", "3s", "--",
                PYTHON, str(PROGRAMS / "ends_on_resume.py"), str(image), "1"],
               cwd=workdir, timeout=300, env={"PROCCKPT_CRIU": str(criu)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"restoring {image.name} failed; trying it once more" in done.stderr, \
        done.stderr[-3000:]
    assert [e["checkpoint"] for e in events(ckpt, "restore-failed")] == [image.name]
    assert [e["checkpoint"] for e in events(ckpt, "resume")] == [image.name] * 2
    assert done.stdout.splitlines() == ["threads started", "resumed"], done.stdout


def _start(workdir: Path, ckpt: Path, out: Path, log: Path, *options: str,
           ) -> subprocess.Popen[str]:
    return subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--engine", "criu",
                             *options, "--", *LOOP, "--step-sleep", "0.25", "--out", str(out)],
                            cwd=workdir, text=True, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_image(proc: subprocess.Popen[str], ckpt: Path, log: Path,
                    holds: Callable[[dict], object] = lambda criu: True) -> None:
    """Until an image taken once the training stepped (its workers running: on a loaded
    machine the first image may come before they started) whose manifest's ``criu`` part
    ``holds`` something."""
    deadline = time.monotonic() + 240
    before: int | None = None
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        if before is None and steps(log.read_text()):
            before = len(events(ckpt, "checkpoint"))
        if before is not None and len(events(ckpt, "checkpoint")) > before:
            newest = CheckpointStore(ckpt).checkpoints()[0]
            if holds(newest.manifest["criu"]):
                return
            before = len(events(ckpt, "checkpoint"))
        time.sleep(0.1)


def _command(ckpt: Path) -> psutil.Process:
    """The training's main process (the one of worker_loop.py whose parent is not: its own
    PID namespace's init, or the keeper)."""
    def runs_the_loop(proc: psutil.Process) -> bool:
        return proc.cmdline()[1:2] == LOOP[1:]  # (its DataLoader workers: forks of it)

    keeper = psutil.Process(events(ckpt, "cycle")[-1]["pid"])
    for proc in keeper.children(recursive=True):
        if runs_the_loop(proc) and not runs_the_loop(proc.parent()):
            return proc
    raise AssertionError(f"no training below the keeper {keeper.pid}")


@needs_criu
def test_a_killed_training_restores_from_its_periodic_image(workdir: Path):
    """Images every 4 s while the tree runs on; the training SIGKILLed after the first, as
    the OOM killer would: under --restart-on-failure the next cycle restores the newest
    image, and the run ends bit-identical."""
    expected = reference()
    out, ckpt, log = workdir / "out.pt", workdir / "ckpt", workdir / "run.log"
    proc = _start(workdir, ckpt, out, log, "--interval", "4s", "--restart-on-failure")
    try:
        _wait_for_image(proc, ckpt, log)
        time.sleep(1)
        _command(ckpt).kill()
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert events(ckpt, "resume"), text[-3000:]
    seen = steps(text)
    assert seen[-1] == 96 and sorted(set(seen)) == list(range(1, 97)), text[-2000:]
    assert_same(expected, out)


@needs_criu
@pytest.mark.parametrize("namespace", [True, False], ids=["pid-namespace", "host-pids"])
def test_a_fresh_launcher_restores_the_image_the_killed_one_left(workdir: Path, namespace: bool):
    """The launcher and its whole tree SIGKILLed after a periodic image, and the folders of
    its workers' sockets in /tmp cleaned away (as a job's end or another node would). Then
    another process holds the pid the training had. In its own PID namespace (the default as
    root) the image holds the namespace's pids, and a new `procckpt run` restores it at once.
    With the host's pids (PROCCKPT_CRIU_PID_NAMESPACE=0), the new `procckpt run` says in one
    line which pid is in the way and exits; once it is free, it restores the image. Each run
    ends bit-identical."""
    expected = reference()
    out, ckpt, log = workdir / "out.pt", workdir / "ckpt", workdir / "run.log"
    env = {} if namespace else {"PROCCKPT_CRIU_PID_NAMESPACE": "0"}
    with mock.patch.dict(os.environ, env):
        proc = _start(workdir, ckpt, out, log, "--interval", "4s")
    try:
        # (DataLoader starts new workers each epoch: an image taken before they passed their
        # first batch has no socket folders to make again)
        _wait_for_image(proc, ckpt, log, lambda criu: criu["socket_dirs"])
        training = _command(ckpt)
        tree = psutil.Process(events(ckpt, "cycle")[-1]["pid"]).children(recursive=True)
        proc.kill()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):  # (a worker at its epoch's end)
                p.kill()
        proc.wait(timeout=60)
        psutil.wait_procs(tree, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    newest = CheckpointStore(ckpt).checkpoints()[0]
    assert newest.manifest["criu"]["pid_namespace"] is namespace, newest.manifest["criu"]
    folders = newest.manifest["criu"]["socket_dirs"]
    assert folders, newest.manifest  # (the workers' multiprocessing listeners)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    # With the host's pids: the image's highest pid (one of its threads'), as the kernel's
    # next pid goes back only to there, so that no other process of the machine lands on
    # the image's other pids. In a namespace: the pid the training had on the host.
    pids = [int(name[5:-4]) for name in newest.manifest["files"]
            if name.startswith("core-") and name.endswith(".img")]
    holder = _holding(training.pid if namespace else max(pids))
    try:
        first = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--engine", "criu", "--",
                     *LOOP, "--step-sleep", "0.25", "--out", str(out)], cwd=workdir,
                    timeout=400, env={**env, "PROCCKPT_CRIU_PID_WAIT": "1"})
    finally:
        holder.kill()
        holder.wait()
    if namespace:
        again = first
    else:
        said = [x for x in first.stderr.splitlines() if "cannot restore" in x]
        assert first.returncode != 0 and len(said) == 1, first.stderr[-3000:]
        assert f"pid {holder.pid} is taken by `sleep 600`" in said[0], said
        assert not steps(first.stdout)  # nothing trained
        again = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--engine", "criu", "--",
                     *LOOP, "--step-sleep", "0.25", "--out", str(out)], cwd=workdir,
                    timeout=400, env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "criu: restoring ckpt-" in again.stderr, again.stderr[-3000:]
    assert steps(again.stdout)[-1] == 96
    assert_same(expected, out)


@needs_criu
def test_a_command_criu_cannot_image_ends_the_run_in_one_line(workdir: Path):
    """A script holding a TCP connection to a server outside its tree, which CRIU does not
    image: the deadline's image fails, and the run ends saying why, with no restart."""
    script = workdir / "tcp.py"
    script.write_text("import socket, sys, time\n"
                      "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
                      "for i in range(1, 1000):\n"
                      "    print('step', i, flush=True)\n"
                      "    time.sleep(0.2)\n")
    with socket.create_server(("127.0.0.1", 0)) as server:
        done = run([*procckpt_argv(), "run", "--dir", str(workdir / "ckpt"), "--engine", "criu",
                    "--time-limit", "8s", "--grace", "3s", "--", PYTHON, str(script),
                    str(server.getsockname()[1])], cwd=workdir, timeout=300)
    assert done.returncode == 124, done.stderr[-3000:]
    said = [x for x in done.stderr.splitlines() if "CRIU cannot image this command: " in x]
    assert len(said) == 1 and "Connected TCP socket" in said[0], done.stderr[-3000:]
    assert "cycle 2" not in done.stderr


def _holding(pid: int) -> subprocess.Popen[bytes]:
    """A `sleep` that holds ``pid`` (root: the kernel's next pid set just below it)."""
    for _ in range(100):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        holder = subprocess.Popen(["sleep", "600"])
        if holder.pid == pid:
            return holder
        holder.kill()
        holder.wait()
        time.sleep(0.05)
    pytest.fail(f"could not make a process with pid {pid}")


@pytest.mark.parametrize("criu,says", [
    ("missing", "is not an executable"),
    ("3.17", "is CRIU 3.17, which cannot image processes on kernels from 6.13"),
])
def test_engine_criu_without_a_usable_criu_is_one_line_before_training(workdir: Path,
                                                                      criu: str, says: str):
    """No CRIU, or Debian 12's 3.17 (a stand-in that says its version, as it does): one line,
    exit 2, and the command never started."""
    binary = workdir / "criu"
    if criu != "missing":
        binary.write_text(f"#!/bin/sh\necho 'Version: {criu}'\n")
        binary.chmod(0o755)
    marker = workdir / "started"
    done = run([*procckpt_argv(), "run", "--dir", str(workdir / "ckpt"), "--engine", "criu",
                "--", "touch", str(marker)], cwd=workdir, env={"PROCCKPT_CRIU": str(binary)})
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not marker.exists()


def _as_nobody(*argv: str) -> list[str]:
    """``argv`` run as the user nobody. Where the interpreter lives in root's home (pyenv in
    /root, which only root may enter), nobody gets it the way a cluster's users get a shared
    Python: readable, here through a private mount namespace with that one folder in it."""
    drop = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    real = Path(os.path.realpath(PYTHON))
    if not real.is_relative_to("/root") or len(real.parts) < 3:
        return [*drop, *argv]
    shared = Path("/root", real.parts[2])
    script = ('set -e; d=$(mktemp -d); mount --bind "$0" "$d"; '
              'mount -t tmpfs -o mode=755 none /root; mkdir "$0"; mount --move "$d" "$0"; '
              'rmdir "$d"; exec "$@" </dev/null')  # (a file of the old namespace: no image)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(shared),
            *drop, *argv]


@needs_criu
def test_a_user_other_than_root_is_imaged_with_criu_unprivileged(workdir: Path):
    """`procckpt run` as nobody, with a copy of criu that carries its file capabilities: CRIU
    runs --unprivileged, and the deadline cycles end bit-identical, each step trained once.
    The same copy without them: one line before training."""
    if os.geteuid() != 0 or not all(map(shutil.which, ("setcap", "setpriv", "unshare"))):
        pytest.skip("needs root, setcap, setpriv and unshare (libcap2-bin, util-linux) to make "
                    "a user and a criu with file capabilities")
    assert _TOOLS is not None
    expected = reference()
    home = Path(tempfile.mkdtemp(prefix="procckpt-nobody-"))  # /tmp: pytest's is root's own
    try:
        criu = home / "criu"
        shutil.copy2(_TOOLS.criu, criu)
        shutil.chown(home, "nobody", "nogroup")
        home.chmod(0o755)
        env = {**os.environ, "HOME": str(home), "PROCCKPT_CRIU": str(criu)}
        bare = subprocess.run(_as_nobody(*procckpt_argv(), "run", "--engine", "criu", "--dir",
                                         str(home / "bare"), "--", *LOOP, "--out", "x"),
                              cwd=home, env=env, capture_output=True, text=True, timeout=120)
        lines = [line for line in bare.stderr.splitlines() if line.strip()]
        assert bare.returncode == 2 and len(lines) == 1, bare.stderr[-3000:]
        assert "as a user other than root needs CRIU's capabilities" in lines[0]
        assert f"cap_checkpoint_restore,cap_sys_ptrace,cap_setpcap+eip {criu}" in lines[0]

        subprocess.run(["setcap", "cap_checkpoint_restore,cap_sys_ptrace,cap_setpcap+eip",
                        str(criu)], check=True)
        check = subprocess.run(_as_nobody(str(criu), "check", "--unprivileged"),
                               capture_output=True, text=True, timeout=60)
        if check.returncode != 0:
            pytest.skip(f"CRIU's --unprivileged mode does not work here: {check.stdout}"
                        f"{check.stderr}"[-500:])
        out, ckpt = home / "out.pt", home / "ckpt"
        done = subprocess.run(
            _as_nobody(*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "15s",
                       "--grace", "5s", "--", *LOOP, "--step-sleep", "0.25", "--out",
                       str(out)),
            cwd=home, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        assert "CRIU 4" in done.stderr and "(as this user: --unprivileged)" in done.stderr
        assert steps(done.stdout) == list(range(1, 97)), done.stdout[-2000:]
        resumes = events(ckpt, "resume")
        assert resumes and all(e["engine"] == "criu" for e in resumes), done.stderr[-3000:]
        assert out.stat().st_uid == pwd.getpwnam("nobody").pw_uid
        assert_same(expected, out)
    finally:
        shutil.rmtree(home, ignore_errors=True)
