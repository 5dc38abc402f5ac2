"""The Kubernetes shape: a run that spans two nodes, each with its own ``procckpt run
--nodes 2 --node-rank K`` around its own ``torchrun --nnodes 2 --node-rank K`` (what every pod
of ``procckpt k8s --nodes 2`` runs), here two launchers on this machine, on loopback, sharing
one checkpoint dir as the pods share a ReadWriteMany claim.

The leader (node 0) stops the group at each --time-limit and restarts it; the follower starts
its node's part of each cycle. Then the follower gets a SIGTERM, as a preempted pod would:
both nodes checkpoint at one step and exit 75. Both launchers started again (new pods) resume,
and the two ranks end bit-identical to an uninterrupted two-rank run. Then the same run loses
node 1 mid-cycle (every process of it killed, as when its machine dies): node 0 tells the lost
node from a bug in the script, exits 75 (a retry for Kubernetes), and the new pods resume from
the periodic checkpoint, bit-identical. About 4 minutes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import procckpt_argv
from ..harness.slurm_cluster import free_port
from .test_torchrun import DDP, SHAPE, TORCHRUN, assert_same_run, uninterrupted

# One worker runs the module, so that its uninterrupted reference is computed once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pods")]

#: The uninterrupted two-rank run (two workers importing torch, 48 quick steps) took 9-13 s
#: in quiet and loaded runs of the whole suite, where a 24-s cycle always trained.
QUIET_REFERENCE_SECONDS = 11.0


@dataclass(frozen=True)
class Reference:
    out: Path  # the uninterrupted run's weights
    pace: float  # how many times slower than quiet this machine starts two ranks now, >= 1

    def seconds(self, quiet: float) -> str:
        """``quiet`` seconds of the test's clock (a time limit, a step's sleep) at this pace."""
        return f"{quiet * self.pace:.1f}"


def launchers(workdir: Path, ckpt: Path, out: Path, *extra: str,
              sleep: str = "0.9") -> list[subprocess.Popen]:
    """Node 0's and node 1's launcher, as two pods would start them."""
    port = free_port()
    procs = []
    for node in (0, 1):
        argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--nodes", "2", "--node-rank",
                str(node), *extra, "--", TORCHRUN, "--nnodes=2", f"--node-rank={node}",
                "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                str(DDP), *SHAPE, "--sleep", sleep, "--out", str(out)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PROCCKPT_TOKEN", None)
        log = (workdir / f"node{node}.log").open("a")
        procs.append(subprocess.Popen(argv, cwd=workdir, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def journal(ckpt: Path) -> Callable[[], list[dict]]:
    """The run's events as they are now, each time it is called ([] before the dir exists)."""
    path = ckpt / "events.jsonl"
    return lambda: list(read_events(path)) if path.exists() else []


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def logs(workdir: Path) -> str:
    return "\n".join(f"--- node {n} ---\n{(workdir / f'node{n}.log').read_text()[-3000:]}"
                     for n in (0, 1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    started = time.monotonic()
    out = uninterrupted(tmp_path_factory.mktemp("pods-ref"), DDP, SHAPE, "reference")
    return Reference(out, max(1.0, (time.monotonic() - started) / QUIET_REFERENCE_SECONDS))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun and its workers start sessions of their
    own, so a process group does not hold them all)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def kill_node(launcher: subprocess.Popen) -> None:
    """Every process of a node at once, as when its machine dies: frozen first, so that none
    sees another die, then killed."""
    pids = descendants(launcher.pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in descendants(launcher.pid):  # what started meanwhile too
        os.kill(pid, signal.SIGKILL)
    launcher.wait()


def test_two_launchers_follow_one_run_and_a_sigterm_to_either_checkpoints_both(
        workdir: Path, reference: Reference):
    ckpt, out = workdir / "ckpt", workdir / "resumed"
    events = journal(ckpt)
    # Cycles of 24 s (19 s before the stop) and steps of 0.9 s on a quiet machine, both
    # stretched as the machine is slower: the ranks' start (two nodes, 15-30 s on a slowed
    # machine) always leaves a cycle time to train, and the run (43 steps' sleeps) always
    # outlasts its first cycle.
    procs = launchers(workdir, ckpt, out, "--time-limit", reference.seconds(24), "--grace",
                      "5s", "--max-restarts", "30", sleep=reference.seconds(0.9))
    # Once the leader restarted the group at its limit and the new cycle checkpointed,
    # SIGTERM node 1's launcher, as Kubernetes does to a pod it takes away.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        seen = events()
        restarted = [e for e in seen if e["event"] == "restart" and e["cause"] == "deadline"]
        if restarted and any(e["event"] == "resume" and e["time"] > restarted[0]["time"]
                             for e in seen):
            break
        time.sleep(1)
    assert all(p.poll() is None for p in procs), logs(workdir)
    assert time.monotonic() < deadline, f"no restart at the time limit\n{logs(workdir)}"
    time.sleep(3)
    procs[1].send_signal(signal.SIGTERM)
    codes = wait_all(procs, timeout=120)
    assert codes == [75, 75], logs(workdir)
    # The stop was asked for the SIGTERM; or, where it fell into the stop at the time limit
    # (a slow start leaves little of a cycle), that stop's checkpoint served it too and the
    # run ended instead of restarting.
    seen = events()
    stops = [e for e in seen if e["event"] == "trigger" and e["action"] == "stop"]
    kept = [e["signal"] for e in seen if e["event"] == "stop-signal"]
    assert stops[-1]["reason"] == "SIGTERM on node 1" or kept == ["SIGTERM on node 1"], \
        (stops, kept)
    confirmed = [e for e in events() if e["event"] == "confirmed"]
    assert confirmed and confirmed[-1]["checkpoint"], confirmed
    # Every rank's state is in the checkpoint the stop left, node 1's too.
    newest = ckpt / "checkpoints" / confirmed[-1]["checkpoint"]
    assert (newest / "rank-00001.pt").is_file(), sorted(p.name for p in newest.iterdir())
    node1 = (workdir / "node1.log").read_text()
    assert "asking node 0 for a checkpoint, then a stop of every node" in node1 or \
        "no cycle runs here; asking node 0 to stop every node" in node1, node1

    # New pods: both launchers again. Node 1 must not take node 0's old exit for its own.
    codes = wait_all(launchers(workdir, ckpt, out), timeout=300)
    assert codes == [0, 0], logs(workdir)
    assert events()[-1]["event"] == "exit" and events()[-1]["reason"] == "finished"
    assert "ChildFailedError" not in logs(workdir)
    assert_same_run(reference.out, out)


def test_a_node_lost_mid_run_is_told_from_a_bug_and_the_run_resumes_from_its_periodic_checkpoint(
        workdir: Path, reference: Reference):
    ckpt, out = workdir / "ckpt", workdir / "resumed"
    events = journal(ckpt)
    procs = launchers(workdir, ckpt, out, "--interval", "8s", "--max-restarts", "5")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if any(e["event"] == "checkpoint" for e in events()):
            break
        time.sleep(0.5)
    assert all(p.poll() is None for p in procs), logs(workdir)
    assert time.monotonic() < deadline, f"no periodic checkpoint\n{logs(workdir)}"
    time.sleep(3)
    kill_node(procs[1])
    lost_at = time.time()
    assert wait_all(procs[:1], timeout=90) == [75], logs(workdir)
    seen = events()
    lost = [e for e in seen if e["event"] == "node-lost"]
    assert len(lost) == 1 and lost[0]["nodes"][0].startswith("node 1 ("), lost
    assert lost[0]["time"] - lost_at < 40, "the loss took too long to be told"
    assert seen[-1]["event"] == "exit" and seen[-1]["code"] == 75, seen[-1]
    newest = [e for e in seen if e["event"] == "checkpoint"][-1]
    status = subprocess.run([*procckpt_argv(), "status", str(ckpt)], capture_output=True,
                            text=True, timeout=60)
    assert "last node lost: node 1 (its launcher has not been heard from" in status.stdout, \
        status.stdout

    codes = wait_all(launchers(workdir, ckpt, out), timeout=300)
    assert codes == [0, 0], logs(workdir)
    resumes = [e for e in events() if e["event"] == "resume" and e["time"] > lost_at]
    assert resumes and resumes[0]["checkpoint"] == newest["checkpoint"], (resumes, newest)
    assert events()[-1]["event"] == "exit" and events()[-1]["reason"] == "finished"
    assert_same_run(reference.out, out)
