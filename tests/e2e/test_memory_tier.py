"""The memory tier (issue 55): a training killed as the OOM killer kills resumes from the state
it kept every few steps in the launcher's memory, not from its last checkpoint; a slot torn by
the kill is passed over; a launcher killed too leaves the store to resume from and its tier to
the next launcher's sweep; a tier that does not fit is said in one line and the run goes on;
in a group of ranks, one rank killed, the group resumes from the newest step all ranks kept."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from procckpt.protocol.slots import SLOTS, slot_files, slots_newest_first
from procckpt.store import CheckpointStore
from procckpt.training.save.tier import ENV_COPY_PAUSE

from ..conftest import assert_bit_identical, memory_cgroup, mounted_tmpfs, procckpt_argv, run
from ..harness.processes import TINY, events, reference
from .test_torchrun import DDP, assert_same_run, torchrun, uninterrupted

#: 32 steps an epoch (batch 32), 96 in all, 50 ms each.
ARGS = ["--epochs", "3", "--n", "1024", "--step-sleep", "0.05"]


def _launch(workdir: Path, ckpt: Path, out: Path, *options: str,
            env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Path]:
    err = workdir / "launcher.err"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("PROCCKPT_TOKEN", None)
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), *options, "--",
                             *TINY, *ARGS, "--out", str(out)], cwd=workdir, env=full_env,
                            text=True, stdout=subprocess.PIPE, stderr=open(err, "w"))
    return proc, err


def _training_pid(ckpt: Path) -> int:
    """The training's own process: the journal names the keeper in front of it."""
    keeper = psutil.Process(events(ckpt, "cycle")[-1]["pid"])
    deadline = time.monotonic() + 30
    while not (below := keeper.children()):
        assert time.monotonic() < deadline, "the keeper started no command"
        time.sleep(0.01)
    return below[0].pid


def _torn(tier: Path) -> bool:
    """Whether a slot is being written: its data there, its manifest not (yet)."""
    return any(files.data.exists() and not files.manifest.exists()
               for files in (slot_files(tier, i) for i in range(SLOTS)))


def _tier_root(ckpt: Path) -> Path:
    return Path(next(e["root"] for e in events(ckpt, "memory-tier") if "root" in e))


def test_a_training_killed_twice_resumes_from_the_memory_tier_bit_identical(workdir: Path):
    """SIGKILL at step 20, then again in the middle of writing a slot past step 60 (every
    slot's copy slowed by 0.1 s, once its manifest is gone): each restart resumes from a slot
    of its cycle, the newest complete one; by default, as a crash after a checkpoint of its
    cycle is."""
    expected = reference(*ARGS)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    proc, err = _launch(workdir, ckpt, out, "--interval", "off",
                        env={ENV_COPY_PAUSE: "0.1", "PROCCKPT_WARM_RESTARTS": "1"})
    kills: list[int] = []
    torn = threading.Event()
    step = 0

    def kill_when_torn() -> None:  # (the copy holds the training: no line comes meanwhile)
        deadline = time.monotonic() + 120
        while step < 90 and time.monotonic() < deadline and proc.poll() is None:
            if _torn(_tier_root(ckpt)):
                torn.set()
                os.kill(_training_pid(ckpt), signal.SIGKILL)
                kills.append(step)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=kill_when_torn)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("step "):
                continue
            step = int(line.split()[1])
            if not kills and step >= 20:
                os.kill(_training_pid(ckpt), signal.SIGKILL)
                kills.append(step)
            elif len(kills) == 1 and step >= 60 and watcher.ident is None:
                watcher.start()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if watcher.is_alive():
            watcher.join()
    stderr = err.read_text()
    assert proc.returncode == 0, stderr[-4000:]
    assert len(kills) == 2 and torn.is_set(), (kills, stderr[-3000:])
    kept = events(ckpt, "tier-kept")
    assert [k["cycle"] for k in kept] == [1, 2], kept
    # Each restart resumed from a slot its cycle wrote before the kill: without the tier the
    # first restart would start from step 0 (no checkpoint at all; by default the run would
    # have ended) and the second from the first's step. How close to the kill a slot is
    # depends on the cadence the machine's copies allow: benchmarks/memory_tier.py measures
    # the steps lost.
    assert 0 < kept[0]["step"] <= kills[0] < kept[1]["step"] <= kills[1], (kills, kept)
    assert [e["step"] for e in events(ckpt, "resume")] == [k["step"] for k in kept]
    audits = events(ckpt, "audit")  # each resume's first batch: the one its slot recorded
    assert [(a["step"], a["verdict"]) for a in audits] == [(k["step"], "same") for k in kept]
    assert "restarting at once (it saved a checkpoint in this cycle" in stderr, stderr[-3000:]
    assert_bit_identical(expected, out)
    assert not _tier_root(ckpt).exists()  # the launcher removed its tier at the end
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    line = next(x for x in status.stdout.splitlines() if x.startswith("memory tier: "))
    assert " a slot, every " in line and "of a step of" in line, line
    assert line.endswith(f"2 crashes resumed from it, the last at step {kept[-1]['step']}"), line
    # (A warm spare that touched memory in time takes some of the copies: said in the line.)
    assert re.search(r"restore \d+\.\d\ds \([\d.]+ [KMG]?B, from the memory tier"
                     r"(, [\d.]+ [KMG]?B of it into memory touched already)?\), first step ",
                     status.stdout), status.stdout


def test_a_killed_launcher_leaves_the_store_to_resume_from_and_its_tier_to_be_swept(
        workdir: Path):
    """Launcher and training SIGKILLed together after two periodic checkpoints: the tier dies
    with its launcher (its memory is swept by the next launcher on the machine), and the next
    launch resumes from the newest checkpoint of the store, bit-identical."""
    expected = reference(*ARGS)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    with mounted_tmpfs(workdir / "shm", "64m") as shm:
        env = {"PROCCKPT_MEMORY_TIER_ROOT": str(shm)}
        proc, err = _launch(workdir, ckpt, out, "--interval", "1s", env=env)
        try:
            deadline = time.monotonic() + 240
            while len(events(ckpt, "checkpoint")) < 2 or not events(ckpt, "memory-tier"):
                assert proc.poll() is None and time.monotonic() < deadline, \
                    err.read_text()[-3000:]
                time.sleep(0.05)
            training = _training_pid(ckpt)
            proc.kill()
            os.kill(training, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        left = _tier_root(ckpt)
        assert left.is_dir()  # what a killed launcher leaves behind
        # (from the store: a checkpoint committed just before the kill may not be journalled)
        newest = CheckpointStore(ckpt).checkpoints()[0].step
        assert newest is not None and newest >= max(e["step"] for e in events(ckpt, "checkpoint"))
        again = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "1s", "--",
                     *TINY, *ARGS, "--out", str(out)], cwd=workdir, env=env, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert events(ckpt, "resume")[0]["step"] == newest, again.stderr[-3000:]
        assert not left.exists(), list(shm.iterdir())
        assert list(shm.iterdir()) == []  # and its own is gone at its end
    assert_bit_identical(expected, out)


def test_a_tier_without_room_is_said_in_one_line_and_the_run_goes_on(workdir: Path):
    """A memory file system of 64 KiB cannot hold two slots of this state (35 KB)."""
    expected = reference(*ARGS)
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    with mounted_tmpfs(workdir / "shm", "64k") as shm:
        res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY, *ARGS, "--out",
                   str(out)], cwd=workdir, env={"PROCCKPT_MEMORY_TIER_ROOT": str(shm)},
                  timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "memory tier: off" in line]
    assert len(said) == 1 and "its 2 slots of " in said[0] and " KB free" in said[0], said
    assert "crash resumes from the newest checkpoint" in said[0]
    assert [e for e in events(ckpt, "memory-tier") if "off" in e]
    assert not events(ckpt, "tier-kept")
    assert_bit_identical(expected, out)


def test_a_cgroup_without_room_for_the_tier_is_said_in_one_line_and_the_run_goes_on(
        workdir: Path):
    """A real memory cgroup of 900 MB (as Slurm's task/cgroup or a pod's limit sets one), a
    state of 99 MB: the training fits (635 MB at most here), its tier does not (two slots on
    /dev/shm, charged to the cgroup, and a margin of 256 MB: 466 MB, where the cgroup had
    368 MB left). Without the check the slots would take the cgroup towards its
    OOM killer. The check counts page cache not recently used as room (a checkpoint just
    written leaves it), and every limit above the cgroup too."""
    ckpt = workdir / "ckpt"
    with memory_cgroup(900 << 20) as in_cgroup:
        res = run([*in_cgroup, *procckpt_argv(),
                   "run", "--dir", str(ckpt), "--interval", "2s", "--", *TINY, "--epochs", "1",
                   "--width", "650000", "--batch-size", "4", "--step-sleep", "0.02"],
                  cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "memory tier: off" in line]
    assert len(said) == 1 and "MB, and a margin), and this process's cgroup may take " in \
        said[0], said
    assert not events(ckpt, "tier-kept") and events(ckpt, "complete")


def test_a_crash_that_repeats_at_one_step_ends_the_run_in_a_line(workdir: Path):
    """SIGSEGV at step 40 at every start (a bug): the tier keeps the steps before it, the
    restart resumes there and crashes again, and once a cycle crashes without a newer slot
    the run ends in one line. Each restart resumed nearer the crash (a process's first three
    slots are at consecutive steps, before its copies are measured): at most four."""
    ckpt = workdir / "ckpt"
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "off", "--", *TINY,
               *ARGS, "--crash-at-step", "40"], cwd=workdir, timeout=300)
    assert res.returncode == 128 + 11, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "before it saved a checkpoint in this cycle, so a restart would most likely fail " \
        "the same way: not restarted" in last, last
    kept = [k["step"] for k in events(ckpt, "tier-kept")]
    assert kept and kept == sorted(set(kept)) and 0 < kept[0] and kept[-1] < 40, kept
    assert len(events(ckpt, "restart")) == len(kept) <= 4, res.stderr[-3000:]


def _ranks(keeper_pid: int) -> dict[int, psutil.Process]:
    """The group's workers below torchrun, by rank."""
    workers = {}
    for proc in psutil.Process(keeper_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rank = proc.environ().get("RANK")
            if rank is not None and "torchrun" not in " ".join(proc.cmdline()):
                workers[int(rank)] = proc
    return workers


def _newest_slot(tier: Path, rank: int) -> int:
    slots = slots_newest_first(tier / f"rank-{rank:05d}")
    return slots[0][1]["step"] if slots else -1


@pytest.mark.slow
def test_a_group_with_one_rank_killed_resumes_from_the_newest_step_every_rank_kept(
        workdir: Path):
    """2 gloo ranks under torchrun, each keeping its part in the tier at the steps they
    agreed on; rank 1 SIGKILLed once both hold a slot past step 20: the launcher keeps the
    newest step both ranks hold intact as one group checkpoint, and the run resumes from it
    (not from step 0: no checkpoint was taken) and ends bit-identical on both ranks."""
    args = ["--epochs", "2", "--train-size", "1024", "--sleep", "0.1"]  # 64 steps
    expected = uninterrupted(workdir, DDP, args, "reference")
    ckpt, out = workdir / "ckpt", workdir / "out"
    err = workdir / "launcher.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PROCCKPT_TOKEN": ""}
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "off",
                             "--", *torchrun(2, DDP, *args, "--out", str(out))], cwd=workdir,
                            env=env, text=True, stdout=subprocess.DEVNULL,
                            stderr=open(err, "w"))
    try:
        deadline = time.monotonic() + 300
        held = -1
        while held < 20:
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
            roots = [e["root"] for e in events(ckpt, "memory-tier") if "root" in e]
            if roots:  # (rank 0's own slots, in the launcher's directory)
                held = min(_newest_slot(Path(roots[0]).parent, rank) for rank in (0, 1))
        tier = Path(roots[0]).parent
        rank1 = _ranks(events(ckpt, "cycle")[-1]["pid"])[1]
        rank1.kill()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    assert proc.returncode == 0, stderr[-4000:]
    kept = events(ckpt, "tier-kept")
    assert len(kept) == 1 and held <= kept[0]["step"] <= held + 16, (held, kept)
    assert [e["step"] for e in events(ckpt, "resume")] == [kept[0]["step"]], stderr[-3000:]
    assert not tier.exists()
    assert_same_run(expected, out)
