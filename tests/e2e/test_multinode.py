"""Jobs that span two nodes of the test cluster, each node a network namespace of
its own (tests/harness/slurm_nodes.py): its own address, hostname and hosts file.

``procckpt sbatch -N 2 --ntasks-per-node 1 -- srun python ddp_train.py``: one gloo rank a
node, the launcher in the batch step on n1.

- the one-minute limit stops and requeues the job twice, then a longer one lets it finish,
  bit-identical to an uninterrupted 2-rank run (about 4 minutes);
- node n2 dies mid-run (every process of its namespace, its slurmd too, SIGKILLed): the
  launcher finds it lost, requeues the job, n2 comes back, and the job resumes from its newest
  periodic checkpoint and ends bit-identical (about 3 minutes);
- ``scancel`` checkpoints both ranks at one step and is not requeued (about 1 minute).

The module's tests share one cluster and run in one xdist worker (one two-node cluster at a
time: ``--dist loadgroup``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import PYTHON
from ..harness.slurm_cluster import FAST_TEST_TIMING, SlurmCluster, SlurmClusterError
from ..harness.slurm_nodes import netns_unavailable
from .test_slurm import Job, JobWatcher, procckpt_sbatch
from .test_srun import DDP, run_ddp_job
from .test_torchrun import SHAPE, assert_same_run, ddp_shape_reference

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("two-nodes")]

# About 2 s a step: ~96 s of training. A one-minute job gets its signal 15-45 s in, so two
# cycles cannot hold it however quick the machine: >= 3 cycles.
ARGS = [*SHAPE, "--sleep", "2.0"]
# The jobs stopped by a lost node or scancel: ~48 s of training in one ten-minute cycle.
ONE_CYCLE_ARGS = [*SHAPE, "--sleep", "1.0"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    reason = SlurmCluster.available() or netns_unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("procckpt", path=str(Path(PYTHON).parent)) is None:
        pytest.skip(f"no procckpt entry point beside {PYTHON}: pip install -e .")
    # A node that stops answering is DOWN after 60 s (300 s by default): the lost-node test
    # brings n2 back once Slurm has given it up, as a node back from a reboot would be.
    cluster = SlurmCluster(nodes=2, slurmd_timeout=60,
                           **FAST_TEST_TIMING)  # type: ignore[arg-type]
    try:
        cluster.start(tmp_path_factory.mktemp("two-nodes"))
    except SlurmClusterError as e:
        pytest.fail(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_two_node_job_is_requeued_and_resumes_bit_identically(two_nodes: SlurmCluster,
                                                                tmp_path: Path):
    job, record, reference, out = run_ddp_job(
        two_nodes, tmp_path, "two-nodes", ["-t", "1", "-N", "2", "--ntasks-per-node", "1"], ARGS)
    assert record["JobState"] == "COMPLETED", (record, job.log[-4000:])
    assert record["NodeList"] == "n[1-2]", record
    restarts = int(record["Restarts"])
    assert restarts >= 2, f"only {restarts + 1} cycles: the test needs >= 3"
    events = job.events
    assert [e["reason"] for e in events if e["event"] == "exit"] == \
        ["requeued"] * restarts + ["finished"]
    # The launcher ran on the batch node; the ranks on both nodes stopped at one step.
    assert {e["host"] for e in events if e["event"] == "start"} == {"n1"}
    assert any(e["event"] == "resume" and e["batch"] > 0 for e in events)
    assert_same_run(reference, out)


def submit(cluster: SlurmCluster, tmp_path: Path, name: str, args: list[str]) -> Job:
    job = Job(name, tmp_path / name)
    job.workdir.mkdir()
    procckpt_sbatch(cluster, job, ["-N", "2", "--ntasks-per-node", "1", *args],
                    ["srun", PYTHON, str(DDP), *ONE_CYCLE_ARGS, "--out", str(job.workdir / "out")])
    return job


def node_state(cluster: SlurmCluster, name: str) -> str:
    res = cluster.run(["scontrol", "-o", "show", "node", name], check=False)
    found = re.search(r"\bState=(\S+)", res.stdout)
    return found.group(1) if found else ""


def saved_steps(job: Job) -> list[int]:
    return [e["step"] for e in job.events if e["event"] == "checkpoint"
            and isinstance(e.get("step"), int)]


def test_a_lost_node_requeues_the_job_which_resumes_from_its_periodic_checkpoint(
        two_nodes: SlurmCluster, tmp_path: Path):
    job = submit(two_nodes, tmp_path, "lost-node", ["-t", "10", "--interval", "10s"])
    watcher = JobWatcher(two_nodes).start()
    try:
        watcher.wait("a periodic checkpoint past step 8",
                     lambda: any(step >= 8 for step in saved_steps(job)), timeout=300)
        time.sleep(2)
        saved_before = max(saved_steps(job))
        two_nodes.kill_node("n2")
        # The launcher finds n2 lost (its slurmd does not answer) and requeues the job;
        # then the node comes back, as a rebooted node would.
        watcher.wait("procckpt to find n2 lost",
                     lambda: any(e["event"] == "node-lost" for e in job.events), timeout=120)
        reference = ddp_shape_reference()  # meanwhile (or made by another test)
        # Brought back once Slurm has marked it DOWN (a slurmd back sooner would receive
        # the orders Slurm kept for the job's first run there, and end its new one).
        watcher.wait("Slurm to mark n2 DOWN", lambda: "DOWN" in node_state(two_nodes, "n2"),
                     timeout=180)
        two_nodes.start_node("n2")
        record = watcher.wait_done(job.job_id, timeout=600)
    finally:
        watcher.stop()
        two_nodes.run(["scancel", str(job.job_id)], check=False)
    assert record["JobState"] == "COMPLETED", (record, job.log[-4000:])
    assert record["Restarts"] == "1", record
    events = job.events
    # Rank 0 (on n1) reported its broken connection; rank 1 died with n2, unable to.
    assert [(e["rank"], e["node"]) for e in events if e["event"] == "rank-failed"] == [(0, "n1")]
    [lost] = [e for e in events if e["event"] == "node-lost"]
    assert len(lost["nodes"]) == 1 and lost["nodes"][0].startswith("n2 ("), lost
    assert [e["reason"] for e in events if e["event"] == "exit"] == ["requeued", "finished"]
    assert [e["ended"] for e in events if e["event"] == "cycle-end"] == ["node-lost", "finished"]
    # The second start resumed from the newest checkpoint before the loss: at most one period
    # (10 s, ~10 steps) of work was lost.
    [resume] = [e for e in events if e["event"] == "resume"]
    assert resume["step"] >= saved_before, (resume, saved_before)
    assert "requeued Slurm job" in job.log and "it lost node n2" in job.log
    assert_same_run(reference, job.workdir / "out")
    status = subprocess.run([PYTHON, "-m", "procckpt", "status", str(job.workdir / "ckpt")],
                            capture_output=True, text=True, timeout=60)
    assert "nodes lost: 1" in status.stdout and "last node lost: n2 (" in status.stdout, \
        status.stdout


def test_scancel_of_a_two_node_job_checkpoints_both_ranks_and_is_not_requeued(
        two_nodes: SlurmCluster, tmp_path: Path):
    job = submit(two_nodes, tmp_path, "cancel", ["-t", "10"])
    watcher = JobWatcher(two_nodes).start()
    try:
        watcher.wait("the training to start on both nodes",
                     lambda: "start: epoch 0, batch 0, 2 rank(s)" in job.log, timeout=300)
        time.sleep(5)
        two_nodes.scancel(job.job_id)
        record = watcher.wait_done(job.job_id, timeout=120)
        watcher.wait("procckpt's last words", lambda: "not requeued" in job.log, timeout=60)
    finally:
        watcher.stop()
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", record
    # The stop's checkpoint holds both ranks' parts (rank 1's from n2), taken at one step.
    # scancel signals the steps on both nodes at once: rank 0, which journals the checkpoint,
    # names the SIGTERM if it saw its own first, or rank 1's stop if n2's came sooner.
    saved = [e for e in job.events if e["event"] == "checkpoint"]
    assert saved and saved[-1]["reason"] in {"SIGTERM", "stop requested on another rank"}, \
        saved[-1:]
    assert any(e["event"] == "trigger" and e["action"] == "stop" and e["reason"] == "SIGTERM"
               for e in job.events), job.events
    stopped = re.findall(r"stopping after checkpoint at step (\d+)", job.log)
    assert stopped and saved[-1]["step"] == int(stopped[-1]), job.log[-4000:]
    newest = sorted((job.workdir / "ckpt" / "checkpoints").iterdir())[-1]
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == saved[-1]["step"]
    assert {"state.pt", "rank-00001.pt"} <= set(manifest["files"]), manifest["files"]
    assert [e["reason"] for e in job.events if e["event"] == "exit"] == ["checkpointed"]
