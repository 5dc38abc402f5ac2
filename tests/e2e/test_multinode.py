"""Issue 29, first part: jobs that span two nodes of the test cluster, each node a network
namespace of its own (tests/slurm_nodes.py): its own address, hostname and hosts file.

``procckpt sbatch -N 2 --ntasks-per-node 1 -- srun python ddp_train.py``: one gloo rank a
node, the launcher in the batch step on n1; the one-minute limit stops and requeues the job
until it finishes, bit-identical to an uninterrupted 2-rank run. About 5 minutes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ..conftest import PYTHON
from ..slurm_cluster import FAST_TEST_TIMING, SlurmCluster, SlurmClusterError
from ..slurm_nodes import netns_unavailable
from .test_srun import run_ddp_job
from .test_torchrun import SHAPE, assert_same_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# About 1 s a step: ~48 s of training. A one-minute job gets its signal 15-45 s in, and each
# cycle spends 10-20 s starting two ranks: >= 3 cycles.
ARGS = [*SHAPE, "--sleep", "1.0"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    reason = SlurmCluster.available() or netns_unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("procckpt", path=str(Path(PYTHON).parent)) is None:
        pytest.skip(f"no procckpt entry point beside {PYTHON}: pip install -e .")
    cluster = SlurmCluster(nodes=2, **FAST_TEST_TIMING)  # type: ignore[arg-type]
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
