"""``procckpt run`` as PID 1 of a new PID namespace, as in a Kubernetes pod.

A real namespace (``unshare --pid --fork --mount-proc``, needs root): the pod's SIGTERM, sent
from the parent namespace as the kubelet's container runtime does, makes procckpt checkpoint
and exit 75, the code the Job manifest retries on. A signal procckpt has no handler for is
ignored, as the kernel does for any PID 1, and orphans re-parented to it are reaped.

Runtime: about 20 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from procckpt.errors import EX_TEMPFAIL
from procckpt.protocol.events import read_events

from ..conftest import PROGRAMS, PYTHON, procckpt_argv, run
from ..harness.processes import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a new PID namespace needs root and util-linux's unshare")


def _sleeps(init: psutil.Process) -> list[psutil.Process]:
    found = []
    try:
        below = init.children(recursive=True)
    except psutil.Error:  # one of them exited while the tree was walked
        return found
    for child in below:
        try:
            if child.name() == "sleep":
                found.append(child)
        except psutil.Error:
            pass
    return found


def ns_pids(pid: int) -> list[int]:
    """The process's pid in each PID namespace it belongs to, outermost first."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError("no NSpid line in /proc/PID/status")


def test_sigterm_to_pid1_checkpoints_and_exits_75(workdir: Path):
    ckpt = workdir / "ckpt"
    # The command leaves two orphans behind (each subshell exits at once, so its `sleep 2` is
    # re-parented to the namespace's PID 1, procckpt), then trains.
    train = (f"(sleep 2 &); (sleep 2 &); exec {PYTHON} {PROGRAMS / 'tiny_train.py'} "
             "--epochs 40 --step-sleep 0.05")
    argv = ["unshare", "--pid", "--fork", "--mount-proc",
            # --engine hooks: auto cannot see procckpt behind `sh -c` and might pick DMTCP.
            *procckpt_argv(), "run", "--dir", str(ckpt), "--grace", "20s", "--engine", "hooks",
            "--",
            "sh", "-c", train]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PROCCKPT_TOKEN", None)
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        init = wait_for("the namespace", lambda: psutil.Process(proc.pid).children(), 30)[0]
        assert ns_pids(init.pid)[-1] == 1, "procckpt is not PID 1 of the new namespace"
        # The two subshells run one after the other: wait until both orphans are there. They
        # are re-parented to the command's keeper (a subreaper below PID 1, see keeper.py).
        orphans = wait_for("the two orphans", lambda: _sleeps(init)[1:] and _sleeps(init), 30)
        assert len(orphans) == 2
        wait_for("training", lambda: list((ckpt / "control").glob("hello-*.json")), 60)

        # Left to the default action SIGQUIT would kill a process; PID 1 never takes it.
        init.send_signal(signal.SIGQUIT)
        # The orphans exit after 2 s; reaped, they leave the process table altogether.
        wait_for("the orphans to be reaped (they stayed zombies)",
                 lambda: not any(psutil.pid_exists(o.pid) for o in orphans), 10)
        assert init.is_running() and proc.poll() is None, "SIGQUIT killed PID 1"

        init.send_signal(signal.SIGTERM)  # what the kubelet sends when the pod is deleted
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EX_TEMPFAIL, stderr[-3000:]
    events = list(read_events(ckpt / "events.jsonl"))
    trigger = next(e for e in events if e["event"] == "trigger")
    assert trigger["reason"] == "SIGTERM" and trigger["action"] == "stop"
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert len(saved) == 1 and saved[0]["reason"] == "SIGTERM"
    assert saved[0]["time"] - trigger["time"] < 20  # within the grace
    assert events[-1]["event"] == "exit" and events[-1]["code"] == EX_TEMPFAIL

    # The next pod resumes from that checkpoint and finishes.
    again = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", PYTHON,
                 str(PROGRAMS / "tiny_train.py"), "--epochs", "40"], cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {saved[0]['checkpoint']}" in again.stderr
