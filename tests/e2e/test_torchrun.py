"""Distributed training under ``procckpt run -- torchrun``: 2 gloo ranks on CPU.

A DDP run (replicated state) and an FSDP2 run (sharded state,
through DCP) are stopped twice in the middle of an epoch (SIGUSR1 to the launcher at a
chosen step, as `procckpt sbatch` has Slurm send before a time limit, then run again as a
requeued job) while only rank 1 reads the launcher's requests (``PROCCKPT_POLL_RANKS=1``: rank
0 learns of each stop through the all-reduce alone), and end bit-identical (torch.equal) to
uninterrupted runs: parameters, optimizer state and each rank's next random draw. A SIGTERM
sent to one worker alone stops both ranks at the same step.

Runtime: 4-8 minutes on 2 cores (each torchrun start costs 4-30 s of imports, with load).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from procckpt.protocol.events import read_events

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, procckpt_argv, run
from ..harness import shared
from ..harness.processes import cycles_stopped_at, joined, stopped_once

TORCHRUN = str(Path(PYTHON).parent / "torchrun")
DDP = EXAMPLES / "ddp_train.py"
FSDP = EXAMPLES / "fsdp_train.py"
# 3 epochs x 16 steps (512 samples, 16 per rank and step) of >= 0.9 s: >= 43 s of training.
SHAPE = ["--epochs", "3", "--train-size", "512"]
ARGS = [*SHAPE, "--sleep", "0.9"]
# Where an interrupted run is stopped: a few steps into the first and the last epoch, whatever
# the start costs (a stop is asked once the training reached the step, and lands a step or two
# later); the second stop in a resumed cycle. (A third, in the middle epoch, cost a cycle of two
# ranks, 10-15 processor seconds, and showed nothing the second does not.)
STOPS = [3, 37]


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    # --standalone: a fresh rendezvous on a free port per start, so restarts never collide.
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(script), *args]


def uninterrupted(workdir: Path, script: Path, args: list[str], name: str) -> Path:
    out = workdir / name
    result = run(torchrun(2, script, *args, "--out", str(out)), cwd=workdir,
                 env={"PROCCKPT_DIR": str(workdir / f"{name}-ckpt")})
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def assert_same_run(a: Path, b: Path, ranks: int = 2) -> None:
    """Each rank's final parameters, optimizer state and next random draw are identical."""
    for rank in range(ranks):
        ra = torch.load(f"{a}.rank{rank}.pt", weights_only=True)
        rb = torch.load(f"{b}.rank{rank}.pt", weights_only=True)
        for key in ra["model"]:
            assert torch.equal(ra["model"][key], rb["model"][key]), f"rank {rank}: {key} differs"
        assert ra["model"].keys() == rb["model"].keys()
        if "optimizer" in ra:
            for p, st in ra["optimizer"]["state"].items():
                for k, v in st.items():
                    assert torch.equal(v, rb["optimizer"]["state"][p][k]), \
                        f"rank {rank}: optimizer {p}.{k} differs"
        assert torch.equal(ra["draw"], rb["draw"]), f"rank {rank}: random stream differs"


def interrupted(workdir: Path, script: Path, args: list[str], name: str) -> tuple[Path, list]:
    out = workdir / name
    ckpt = workdir / f"{name}-ckpt"
    result = joined(cycles_stopped_at(
        ["--dir", str(ckpt), "--", *torchrun(2, script, *args, "--out", str(out))], workdir,
        ckpt, STOPS, env={"PROCCKPT_POLL_RANKS": "1"}))
    events = list(read_events(ckpt / "events.jsonl"))
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == len(STOPS), resumes
    assert all(e["batch"] > 0 for e in resumes), f"a resume at an epoch's edge: {resumes}"
    # Rank 0 (the writer) never read a request: it saved because rank 1 told it so.
    reasons = [e["reason"] for e in events if e["event"] == "checkpoint" and e["reason"] != "end"]
    assert len(reasons) == len(STOPS), reasons
    assert all(r == "stop requested on another rank" for r in reasons), reasons
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "finished"
    # Planned stops are not failures: no torchrun failure report, and one line per resume,
    # not one per rank.
    assert "ChildFailedError" not in result.stderr, result.stderr[-4000:]
    assert result.stderr.count("resumed from ckpt-") == len(resumes), result.stderr[-4000:]
    return out, events


def ddp_shape_reference() -> Path:
    """The two-rank DDP run of SHAPE, uninterrupted: made once a session (harness/shared.py)
    for this module, test_srun.py and test_multinode.py."""
    return shared.once(["torchrun-2", str(DDP), *SHAPE],
                       lambda where: uninterrupted(where, DDP, SHAPE, "reference"))


@pytest.mark.slow
def test_ddp_stopped_twice_via_one_rank_ends_bit_identical(workdir: Path):
    resumed, _ = interrupted(workdir, DDP, ARGS, "resumed")
    ckpts = sorted((workdir / "resumed-ckpt" / "checkpoints").glob("ckpt-*"))
    assert ckpts and all((c / "rank-00001.pt").is_file() for c in ckpts), \
        "rank 1's random streams are not inside the committed checkpoint"
    assert_same_run(ddp_shape_reference(), resumed)


def _worker(rank: int, marker: str) -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and \
                    p.environ().get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in p.environ():
                return p
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(workdir: Path):
    out = workdir / "signalled"
    ckpt = workdir / "ckpt"
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--",
            *torchrun(2, DDP, *ARGS, "--out", str(out))]
    # Every rank logs its stop (ranks other than 0 log only warnings unless asked).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PROCCKPT_LOG_LEVEL": "INFO"}
    env.pop("PROCCKPT_TOKEN", None)
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((ckpt / "control").glob("hello-*.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        time.sleep(2.0)  # mid-epoch
        rank1 = _worker(1, str(out))
        assert rank1 is not None, "rank 1's worker process not found"
        rank1.send_signal(signal.SIGTERM)  # to that one process only
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, stderr[-3000:]  # checkpointed, not finished: run again
    stops = re.findall(r"stopping after checkpoint at step (\d+) \(([^)]*)\)", stderr)
    assert len(stops) == 2, stderr[-3000:]
    assert stops[0][0] == stops[1][0], f"ranks stopped at different steps: {stops}"
    assert {reason for _, reason in stops} == {"SIGTERM", "stop requested on another rank"}
    assert len(list((ckpt / "checkpoints").glob("ckpt-*"))) == 1

    again = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--",
                 *torchrun(2, DDP, *SHAPE, "--out", str(out))], cwd=workdir, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt-00000001" in again.stderr
    assert_same_run(ddp_shape_reference(), out)


@pytest.mark.slow
def test_fsdp_sharded_state_through_dcp_resumes_exactly(workdir: Path):
    reference = uninterrupted(workdir, FSDP, SHAPE, "reference")
    resumed, _ = interrupted(workdir, FSDP, ARGS, "resumed")
    for ckpt in (workdir / "resumed-ckpt" / "checkpoints").glob("ckpt-*"):
        names = {p.name for p in ckpt.iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank-00001.pt"} <= names, names
    assert_same_run(reference, resumed)


@pytest.mark.parametrize("path", [
    pytest.param("twin", id="cpu-twin"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device; there is none")])])
def test_fsdp_on_the_gpu_through_dcp_resumes_exactly(workdir: Path, path: str):
    # One process (a group of one, NCCL): the GPU path of the sharded state, which the
    # two-rank test above cannot take on a machine with one GPU (NCCL wants a GPU per rank).
    # On cpu-twin: the same path with CPU state (gloo; tests/README.md).
    env = {"PROCCKPT_DEVICE_TWIN": "1"} if path == "twin" else {}
    reference, resumed = workdir / "reference", workdir / "resumed"
    done = run([PYTHON, str(FSDP), *SHAPE, "--out", str(reference)], cwd=workdir,
               env={**env, "PROCCKPT_DIR": str(workdir / "reference-ckpt")})
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = workdir / "resumed-ckpt"
    # Sized for a few GPU minutes: stopped (SIGUSR1) once a periodic checkpoint was written,
    # then resumed to the end.
    argv = ["--dir", str(ckpt), "--interval", "1s", "--", PYTHON, str(FSDP), *SHAPE,
            "--sleep", "0.1", "--out", str(resumed)]
    stopped = stopped_once(argv, workdir, lambda: any(
        e["event"] == "checkpoint" for e in read_events(ckpt / "events.jsonl")), env=env)
    assert stopped.returncode == 75, stopped.stderr[-4000:]
    done = run([*procckpt_argv(), "run", *argv], cwd=workdir, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    events = list(read_events(ckpt / "events.jsonl"))
    assert [e for e in events if e["event"] == "resume"], "the run was never interrupted"
    for checkpoint in (ckpt / "checkpoints").glob("ckpt-*"):
        assert {".metadata", "__0_0.distcp"} <= {p.name for p in checkpoint.iterdir()}
    assert_same_run(reference, resumed, ranks=1)


def test_other_world_size_is_refused_or_resharded_exactly(workdir: Path):
    ckpt = {"PROCCKPT_DIR": str(workdir / "ckpt")}
    two = run(torchrun(2, FSDP, "--epochs", "1", "--out", str(workdir / "two")), cwd=workdir,
              env=ckpt)
    assert two.returncode == 0, two.stderr[-3000:]

    refused = run([PYTHON, str(FSDP), "--epochs", "1"], cwd=workdir, env=ckpt)
    assert refused.returncode != 0
    assert "was written by 2 ranks, this run has 1" in refused.stderr
    assert "allow_reshard=True" in refused.stderr

    one = run([PYTHON, str(FSDP), "--epochs", "1", "--reshard", "--out", str(workdir / "one")],
              cwd=workdir, env=ckpt)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resharding checkpoint ckpt-00000001 from 2 to 1 ranks" in one.stderr
    full_two = torch.load(f"{workdir / 'two'}.rank0.pt", weights_only=True)["model"]
    full_one = torch.load(f"{workdir / 'one'}.rank0.pt", weights_only=True)["model"]
    assert full_two.keys() == full_one.keys()
    for key in full_two:  # each rank's shard landed in the right place of the full tensor
        assert torch.equal(full_two[key], full_one[key]), key


LEDGER = PROGRAMS / "ledger_train.py"


def ledger_counts(ledger: Path, epoch: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for path in ledger.glob("*.txt"):
        for line in path.read_text().splitlines():
            e, index = map(int, line.split())
            if e == epoch:
                counts[index] = counts.get(index, 0) + 1
    return counts


# Each direction once, each state once (two ranks cost ~35 processor seconds a case): the
# data's split is the same code for both states, and FSDP's 2-to-3 resharding is
# test_frozen_base.py's (frozen shards written by two ranks load into three).
@pytest.mark.parametrize("before,after,state", [(2, 3, "ddp"), (3, 2, "fsdp")],
                         ids=["2-to-3-ddp", "3-to-2-fsdp"])
def test_another_world_size_trains_the_rest_of_the_epoch_each_sample_once(
        workdir: Path, before: int, after: int, state: str):
    """With ``fsdp`` the model and its AdamW state are sharded: DCP reshards them."""
    ledger, ckpt = workdir / "ledger", workdir / "ckpt"
    ledger.mkdir()
    n, batch_size = 240, 2
    args = ["--samples", str(n), "--batch-size", str(batch_size), "--ledger", str(ledger),
            *(["--fsdp"] if state == "fsdp" else [])]
    # The first allocation: stopped in the middle of epoch 0 by the scheduler's signal (what
    # `procckpt sbatch` asks Slurm to send before the time limit), not restarted. The signal
    # goes once every rank has trained a few steps: a wall-clock limit would be eaten by the
    # ranks' start-up when the machine is loaded.
    lines = before * batch_size * 4

    def trained_a_few_steps() -> bool:
        return sum(len(p.read_text().splitlines()) for p in ledger.glob("*.txt")) >= lines

    first = stopped_once(["--dir", str(ckpt), "--",
                          *torchrun(before, LEDGER, *args, "--name", "first")], workdir,
                         trained_a_few_steps)
    assert first.returncode == 75, first.stderr[-3000:]
    saved = [e for e in read_events(ckpt / "events.jsonl") if e["event"] == "checkpoint"][-1]
    assert saved["epoch"] == 0 and saved["batch"] > 0, saved
    # The next allocation has another number of ranks.
    second = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *torchrun(
        after, LEDGER, *args, "--name", "second", "--step-sleep", "0")], cwd=workdir,
        timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    done = saved["batch"] * batch_size * before
    # Every sample of the interrupted epoch once; where the rest does not divide among the
    # new ranks, DistributedSampler's padding repeats as few as it needs (fewer than a rank).
    counts = ledger_counts(ledger, 0)
    assert set(counts) == set(range(n)), sorted(set(range(n)) - set(counts))
    pad = -(n - done) % after
    assert sorted(c for c in counts.values() if c != 1) == [2] * pad, counts
    # The next epoch, all in the new world size, as a DistributedSampler deals it.
    assert ledger_counts(ledger, 1) == {i: 1 for i in range(n)}
    assert (f"resuming epoch 0 with {after} ranks from a checkpoint of {before}: the samples "
            f"of it not yet trained on (after the first {done} of its order)") in second.stderr
    if state == "fsdp":  # the second run started from the weights the first one saved
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        newest = sorted((ckpt / "checkpoints").glob("ckpt-*"))
        newest = [c for c in newest if c.name == saved["checkpoint"]][0]
        dcp_to_torch_save(newest, workdir / "saved.pt")
        weights = torch.load(workdir / "saved.pt", weights_only=True)["train"]["model"]
        started = torch.load(ledger / "second-start.pt", weights_only=True)
        assert weights.keys() == started.keys()
        for key, value in weights.items():
            assert torch.equal(value, started[key]), key
        first_start = torch.load(ledger / "first-start.pt", weights_only=True)
        assert any(not torch.equal(first_start[k], started[k]) for k in started)  # trained
