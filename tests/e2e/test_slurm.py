"""procckpt on a real single-node Slurm cluster: requeue, scancel, chains, containers.

All jobs are submitted by the module fixture, a few seconds apart, and run side by side (the
cluster has 8 CPU slots), so the module takes about as long as its slowest job: ~4 minutes.
Each test then waits for its own job. A thread polls ``scontrol show job`` every 2 s and keeps
the last record of every job, since Slurm forgets finished jobs after MinJobAge.

Cycle lengths: a one-minute job (``-t 1``) gets USR1 from ``--signal=B:USR1@15`` 15-45 s after it
starts (Slurm checks time limits every 30 s and signals up to 30 s early), or checkpoints at
end - 15 s from the end time it reads; a cycle trains at most ~40 s. The requeue round trip of
the test cluster is ~7 s (cred_expire=5; Slurm's default hold is 120 s).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.slurm_cluster import (
    FINISHED_STATES,
    MARKER_VAR,
    SlurmCluster,
    parse_scontrol_record,
)

# One worker runs the module: its fixture submits every job and computes references
# beside them, which a second copy on another worker would starve of the two CPUs.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm-jobs")]

TINY = PROGRAMS / "tiny_train.py"
POLY = EXAMPLES / "polynomial_regression.py"
# 25 epochs x 8 steps x 0.5 s: 100 s of training, more than two cycles of at most ~40 s can
# hold, so the run needs >= 3 cycles whatever the signal timing.
TRAIN_ARGS = ["--epochs", "25", "--step-sleep", "0.5"]
TRAIN_STEPS = 25 * 256 // 32
# The chain: 70 s of training over 16 one-minute tasks, more than one cycle can hold. Under a
# loaded CI runner a task's start-up took ~40 s of its minute (some trained 1 step), and 12
# tasks of 100 s of training ran out before the end.
CHAIN_ARGS = ["--epochs", "25", "--step-sleep", "0.35"]
CHAIN_TASKS = 16
# 600 epochs x 0.1 s: 60 s of training, more than one cycle of ~40 s can hold.
POLY_ARGS = ["--epochs", "600", "--sleep", "0.1"]
# Long enough never to finish within the tests.
ENDLESS_ARGS = ["--epochs", "500", "--step-sleep", "0.5"]
WAIT = 720.0  # generous bound for one test's job; the module normally takes ~4 minutes
# Seconds between the fixture's submissions: eight trainings importing torch in the same
# seconds, at the suite's start beside the other modules handed out first, made each take
# much of its first one-minute cycle to start on a loaded runner (CI: load 10-12).
STAGGER = 3.0


class JobWatcher:
    """Polls ``scontrol -o show job`` in a thread and keeps each job's last record."""

    def __init__(self, cluster: SlurmCluster, every: float = 2.0) -> None:
        self.cluster = cluster
        self.every = every
        self.records: dict[str, dict[str, str]] = {}
        #: job id -> (requeues, minutes): see lift_limit
        self._lifts: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> JobWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.every)

    def lift_limit(self, job_id: int, requeues: int, minutes: int = 10) -> JobWatcher:
        """Once the job has been requeued ``requeues`` times, give it a time limit of
        ``minutes``, as an admin would: its next cycle trains to the end.

        A one-minute cycle trains for what its minute leaves after the start-up, which a
        loaded runner stretched to most of it (CI: two ranks took ~40 s to start, and a
        two-node job needed ~12 cycles, 15 minutes). With the limit lifted the job runs the
        cycles its test is about and then finishes, on a quick machine or a slow one; its
        training must be longer than ``requeues`` cycles can hold (~45 s each).
        """
        self._lifts[str(job_id)] = (requeues, minutes)
        return self

    def poll(self) -> None:
        try:
            res = self.cluster.run(["scontrol", "-o", "show", "job"], check=False, timeout=20)
        except (subprocess.SubprocessError, OSError):
            return
        with self._lock:
            for line in res.stdout.splitlines():
                rec = parse_scontrol_record(line)
                if "JobId" in rec:
                    self.records[rec["JobId"]] = rec
        for job_id, (requeues, minutes) in list(self._lifts.items()):
            rec = self.records.get(job_id, {})
            if rec.get("JobState") in FINISHED_STATES:
                del self._lifts[job_id]
            elif rec.get("Restarts", "0").isdigit() and int(rec["Restarts"]) >= requeues:
                try:
                    res = self.cluster.run(["scontrol", "update", f"JobId={job_id}",
                                            f"TimeLimit={minutes}"], check=False, timeout=20)
                except (subprocess.SubprocessError, OSError):
                    continue  # at the next poll
                if res.returncode == 0:
                    del self._lifts[job_id]

    def tasks(self, job_id: int) -> list[dict[str, str]]:
        """The records of a job, or of every task of an array job."""
        with self._lock:
            return [r for r in self.records.values()
                    if r.get("JobId") == str(job_id) or r.get("ArrayJobId") == str(job_id)]

    def wait(self, what: str, check: Callable[[], bool], timeout: float = WAIT,
             job: Job | None = None) -> None:
        """Until ``check()``; on timeout, an error with the records, the daemons' logs and
        the end of ``job``'s output."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                output = f"\n--- the job's output ---\n{job.log[-3000:]}" if job else ""
                raise AssertionError(f"timed out waiting for {what}; last records: "
                                     f"{self.records}\n{self.cluster.log_tails(15)}{output}")
            time.sleep(1)

    def wait_done(self, job_id: int, timeout: float = WAIT) -> dict[str, str]:
        """The final record of a (non-array) job once it has finished for good."""
        def done() -> bool:
            recs = self.tasks(job_id)
            return bool(recs) and recs[0].get("JobState") in FINISHED_STATES

        self.wait(f"job {job_id} to finish", done, timeout)
        return self.tasks(job_id)[0]


@dataclass
class Job:
    name: str
    workdir: Path
    job_id: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def log(self) -> str:
        path = self.workdir / "slurm.out"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def events(self) -> list[dict]:
        return list(read_events(self.workdir / "ckpt" / "events.jsonl"))


def job_env(cluster: SlurmCluster) -> dict[str, str]:
    """The cluster's client environment with this venv first on PATH; sbatch exports it to
    the job, where `exec procckpt run` finds the entry point."""
    # Drop procckpt's own settings, but keep the cluster's marker: it lets cluster.stop() find
    # and kill what a job left behind; and the suite's PROCCKPT_WARM_RESTARTS=0 (conftest.py):
    # a spare interpreter importing torch in every cycle of every job, none of which crashes,
    # slowed the start of the ranks beside it.
    env = {k: v for k, v in cluster.env.items()
           if not k.startswith("PROCCKPT_") or k in (MARKER_VAR, "PROCCKPT_WARM_RESTARTS")}
    env["PATH"] = f"{Path(PYTHON).parent}:{env['PATH']}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def procckpt_sbatch(cluster: SlurmCluster, job: Job, args: list[str], command: list[str],
                    env: dict[str, str] | None = None) -> None:
    res = subprocess.run([PYTHON, "-m", "procckpt", "sbatch", "--parsable", "-o",
                          str(job.workdir / "slurm.out"), "--dir", str(job.workdir / "ckpt"),
                          *args, "--", *command], cwd=job.workdir,
                         env={**job_env(cluster), **(env or {})},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"procckpt sbatch failed: {res.stderr}"
    job.job_id = int(res.stdout.strip().split(";")[0])


@dataclass
class Submitted:
    cluster: SlurmCluster
    watcher: JobWatcher
    jobs: dict[str, Job]
    tiny_reference: Path
    poly_reference: Path


@pytest.fixture(scope="module")
def slurm_jobs(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("procckpt", path=str(Path(PYTHON).parent)) is None:
        pytest.skip(f"no procckpt entry point beside {PYTHON}: install the project with pip "
                    "install -e . so that job scripts can run `procckpt`")
    root = tmp_path_factory.mktemp("slurm-e2e")
    jobs = {name: Job(name, root / name) for name in
            ("cancel", "requeue", "nosignal", "budget", "chain", "warnings", "container",
                                        "extend")}
    for job in jobs.values():
        job.workdir.mkdir()
    cluster = slurm_cluster
    # The scancel job: long enough that no time limit is near when it is cancelled.
    procckpt_sbatch(cluster, jobs["cancel"], ["-t", "10"], [PYTHON, str(TINY), *ENDLESS_ARGS])
    time.sleep(STAGGER)
    procckpt_sbatch(cluster, jobs["requeue"], ["-t", "1"],
                    [PYTHON, str(TINY), *TRAIN_ARGS, "--out", str(jobs["requeue"].workdir /
                                                                  "final.pt")])
    time.sleep(STAGGER)
    procckpt_sbatch(cluster, jobs["chain"], ["-t", "1", "--chain", str(CHAIN_TASKS)],
                    [PYTHON, str(TINY), *CHAIN_ARGS, "--out", str(jobs["chain"].workdir /
                                                                  "final.pt")])
    time.sleep(STAGGER)
    procckpt_sbatch(cluster, jobs["budget"], ["-t", "1", "--max-restarts", "1"],
                    [PYTHON, str(TINY), *ENDLESS_ARGS])
    time.sleep(STAGGER)
    # A job script written by hand with no --signal at all: only the end time from Slurm
    # can make procckpt checkpoint before the limit.
    nosignal = jobs["nosignal"]
    script = ("#!/bin/bash\n#SBATCH -t 1\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
              f"exec procckpt run --dir {nosignal.workdir / 'ckpt'} -- {PYTHON} {POLY} "
              f"{' '.join(POLY_ARGS)} --out {nosignal.workdir / 'final.pt'}\n")
    nosignal.job_id = _sbatch_file(cluster, nosignal, script)
    time.sleep(STAGGER)

    # A one-minute job whose limit the test extends while it runs.
    extend = jobs["extend"]
    script = ("#!/bin/bash\n#SBATCH -t 1\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
              f"exec procckpt run --dir {extend.workdir / 'ckpt'} -- {PYTHON} {TINY} "
              f"{' '.join(ENDLESS_ARGS)}\n")
    extend.job_id = _sbatch_file(cluster, extend, script)
    time.sleep(STAGGER)
    threading.Thread(target=_extend_once_running, args=(cluster, extend), daemon=True).start()
    # Everything the start-up checks look for at once: no `exec` while the script asks for a
    # B: signal, no --open-mode=append, --no-requeue, a checkpoint dir under /tmp.
    warned = jobs["warnings"]
    local_dir = Path(tempfile.mkdtemp(prefix="procckpt-slurm-test-", dir="/tmp"))
    warned.extra["local_dir"] = local_dir
    script = ("#!/bin/bash\n#SBATCH -t 1\n#SBATCH --signal=B:USR1@15\n#SBATCH --no-requeue\n"
              f"procckpt run --dir {local_dir / 'ckpt'} -- {PYTHON} {TINY} "
              f"{' '.join(ENDLESS_ARGS)}\n")
    warned.job_id = _sbatch_file(cluster, warned, script)
    time.sleep(STAGGER)

    # Container mode through a stand-in for Pyxis' srun (see tests/harness/programs/pyxis_srun):
    # procckpt inside has no scontrol; the job script outside requeues on its exit code 75.
    container = jobs["container"]
    stub = root / "pyxis-bin"
    stub.mkdir()
    (stub / "srun").symlink_to(PROGRAMS / "pyxis_srun")
    real_srun = shutil.which("srun", path=cluster.env["PATH"])
    assert real_srun is not None
    procckpt_sbatch(cluster, container, ["-t", "1", "--container-image=pytorch.sqsh",
                                         "--container-mounts=/data:/data"],
                    [PYTHON, str(TINY), *TRAIN_ARGS, "--out", str(container.workdir / "final.pt")],
                    env={"PATH": f"{stub}:{job_env(cluster)['PATH']}",
                         "PROCCKPT_TEST_CONTAINER_PATH": str(Path(PYTHON).parent),
                         "PROCCKPT_TEST_REAL_SRUN": real_srun})

    watcher = JobWatcher(cluster)
    watcher.lift_limit(jobs["requeue"].job_id, 2).lift_limit(jobs["container"].job_id, 1)
    watcher.lift_limit(nosignal.job_id, 1).start()
    # The uninterrupted references, computed here while the jobs run.
    refs = root / "reference"
    refs.mkdir()
    tiny_ref, poly_ref = refs / "tiny.pt", refs / "poly.pt"
    for script_path, args, out in ((TINY, TRAIN_ARGS[:2], tiny_ref), (POLY, POLY_ARGS[:2] +
                                                                      ["--sleep", "0"], poly_ref)):
        ref = run([PYTHON, str(script_path), *args, "--ckpt-dir", str(refs / out.stem),
                   "--out", str(out)], cwd=refs)
        assert ref.returncode == 0, ref.stderr
    try:
        yield Submitted(cluster, watcher, jobs, tiny_ref, poly_ref)
    finally:
        ids = [str(j.job_id) for j in jobs.values() if j.job_id]
        cluster.run(["scancel", *ids], check=False)
        # Let the cancelled jobs save and exit before their directories go.
        try:
            watcher.wait("the jobs to end", lambda: all(
                r.get("JobState") in FINISHED_STATES
                for job_id in ids for r in watcher.tasks(int(job_id))), timeout=60)
        finally:
            watcher.stop()
            shutil.rmtree(local_dir, ignore_errors=True)


def _extend_once_running(cluster: SlurmCluster, job: Job) -> None:
    """As an admin would, give the job one minute more as soon as procckpt has read its end
    time (its first cycle started), well before the old limit's checkpoint at ~45 s."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if "procckpt: cycle 1: started" in job.log:
            res = cluster.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=2"],
                              check=False)
            job.extra["extended"] = res.returncode == 0 or res.stderr
            return
        time.sleep(0.2)


def _sbatch_file(cluster: SlurmCluster, job: Job, script: str) -> int:
    """Submit a hand-written job script with plain sbatch; its output goes to slurm.out."""
    (job.workdir / "job.sh").write_text(script)
    res = subprocess.run(["sbatch", "--parsable", "-o", str(job.workdir / "slurm.out"),
                          str(job.workdir / "job.sh")], cwd=job.workdir, env=job_env(cluster),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip().split(";")[0])


def trained_steps(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+)$", log, flags=re.M)]


def cycle_starts(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^start step (\d+) restart", log, flags=re.M)]


def said(log: str) -> str:
    """procckpt's lines of a job's log, and Slurm's: what a failed assertion shows (a CI
    run's output keeps little else)."""
    return "\n".join(line for line in log.splitlines()
                     if line.startswith(("procckpt", "slurmstepd", "srun")))[-6000:]


def test_scancel_checkpoints_and_is_not_requeued(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["cancel"], slurm_jobs.watcher
    watcher.wait("the cancel job to train a few steps", lambda: len(trained_steps(job.log)) >= 4)
    slurm_jobs.cluster.scancel(job.job_id)
    record = watcher.wait_done(job.job_id, timeout=60)
    assert record["JobState"] == "CANCELLED"
    # A requeue would make it PENDING again within ~7 s on this cluster: wait longer than that.
    time.sleep(15)
    watcher.poll()
    record = watcher.tasks(job.job_id)[0]
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", record
    watcher.wait("procckpt's last words", lambda: "not requeued" in job.log, timeout=30,
                 job=job)
    assert "with no time limit near and no preemption (scancel?): not requeued" in job.log
    saved = [e for e in job.events if e["event"] == "checkpoint"]
    assert saved and saved[-1]["reason"] == "SIGTERM", saved[-1:]
    assert len(cycle_starts(job.log)) == 1


def test_scancel_while_slurmctld_does_not_answer_still_gets_procckpts_last_words(
        slurm_jobs: Submitted):
    # A busy controller can keep scontrol waiting longer than the KillWait between scancel's
    # SIGTERM and its SIGKILL. A stand-in scontrol (the real one, but `show job` answers a
    # minute late once the test says so) makes the controller that slow for this job alone.
    cluster, watcher = slurm_jobs.cluster, slurm_jobs.watcher
    job = slurm_jobs.jobs["silent"] = Job("silent", slurm_jobs.tiny_reference.parent.parent /
                                          "silent")
    job.workdir.mkdir()
    slow, shim = job.workdir / "slow", job.workdir / "bin"
    shim.mkdir()
    real = shutil.which("scontrol", path=cluster.env["PATH"])
    assert real is not None
    (shim / "scontrol").write_text(
        f'#!/bin/bash\nif [ -e {slow} ] && [ "$1 $2 $3" = "-o show job" ]; then sleep 60; fi\n'
        f'exec {real} "$@"\n')
    (shim / "scontrol").chmod(0o755)
    procckpt_sbatch(cluster, job, ["-t", "10"], [PYTHON, str(TINY), *ENDLESS_ARGS],
                    env={"PATH": f"{shim}:{job_env(cluster)['PATH']}"})
    watcher.wait("the job to train a few steps", lambda: len(trained_steps(job.log)) >= 4,
                 job=job)
    slow.touch()
    cluster.scancel(job.job_id)
    # Said at all means said before the SIGKILL, KillWait after the SIGTERM.
    watcher.wait("procckpt's last words", lambda: "not requeued" in job.log, timeout=60,
                 job=job)
    assert ("was stopped by SIGTERM with no time limit near, and Slurm did not say within its "
            "KillWait whether the job is preempted: not requeued") in job.log
    saved = [e for e in job.events if e["event"] == "checkpoint"]
    assert saved and saved[-1]["reason"] == "SIGTERM", saved[-1:]
    record = watcher.wait_done(job.job_id, timeout=60)
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", record


def test_sbatch_requeues_through_three_cycles_and_resumes_exactly(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["requeue"], slurm_jobs.watcher
    record = watcher.wait_done(job.job_id)
    assert record["JobState"] == "COMPLETED", (record, job.log[-3000:])
    restarts = int(record["Restarts"])
    assert restarts >= 2, f"only {restarts + 1} cycles: the test needs >= 3"
    assert_bit_identical(slurm_jobs.tiny_reference, job.workdir / "final.pt")
    log = job.log
    # One log for all cycles (--open-mode=append): every cycle's start (but for one whose
    # training never connected before its end, under load), every step once.
    starts = cycle_starts(log)
    unconnected = log.count("(the command never connected to procckpt)")
    assert len(starts) + unconnected == restarts + 1 and starts[0] == 0, (starts, said(log))
    assert trained_steps(log) == list(range(1, TRAIN_STEPS + 1)), said(log)
    # Each requeue said once: by procckpt's own requeue, or seen as Slurm's (a preemption).
    requeues = re.findall(r"^procckpt: (?:requeued Slurm job|Slurm job \d+ stopped .* Slurm has "
                          r"requeued it already)", log, flags=re.M)
    assert len(requeues) == restarts, "\n".join(
        line for line in log.splitlines() if "requeue" in line or "cycle" in line)
    stops = [e["reason"] for e in job.events if e["event"] == "trigger" and e["action"] == "stop"]
    # The last cycle may get its USR1 while the finished training writes its output.
    assert restarts <= len(stops) <= restarts + 1, (stops, said(log))
    assert set(stops) <= {"SIGUSR1", "deadline"}, stops

    # Where the job's time went: each requeue waited in Slurm's queue (from procckpt's
    # requeue to Slurm's next StartTime), and the parts add up to the wall time.
    status = run([*procckpt_argv(), "status", "--json", str(job.workdir / "ckpt")],
                 cwd=job.workdir)
    assert status.returncode == 0, status.stderr
    goodput = json.loads(status.stdout)["goodput"]
    assert len(goodput["cycles"]) == restarts + 1
    assert {c["launch"] for c in goodput["cycles"]} == set(range(1, restarts + 2))
    assert goodput["seconds"]["queue"] > 0, goodput
    assert abs(sum(goodput["seconds"].values()) - goodput["wall_seconds"]) \
        <= 0.03 * goodput["wall_seconds"], goodput


def test_job_script_without_signal_checkpoints_at_the_end_time_from_slurm(
        slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["nosignal"], slurm_jobs.watcher
    record = watcher.wait_done(job.job_id)
    assert record["JobState"] == "COMPLETED", (record, job.log[-3000:])
    restarts = int(record["Restarts"])
    assert restarts >= 1
    stops = [e["reason"] for e in job.events if e["event"] == "trigger" and e["action"] == "stop"]
    assert set(stops) == {"deadline"} and restarts <= len(stops) <= restarts + 1, \
        (stops, said(job.log))
    saved = [e for e in job.events if e["event"] == "checkpoint" and e["reason"] == "deadline"]
    assert len(saved) >= restarts, said(job.log)
    assert "DUE TO TIME LIMIT" not in job.log, said(job.log)  # never killed at the limit
    assert_bit_identical(slurm_jobs.poly_reference, job.workdir / "final.pt")


def test_restart_budget_exhausted_stops_with_a_clear_message(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["budget"], slurm_jobs.watcher
    record = watcher.wait_done(job.job_id)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "75:0", record
    assert record["Restarts"] == "1"
    assert (f"restart budget exhausted: Slurm job {job.job_id} has used 1 of --max-restarts 1"
            in job.log), job.log[-2000:]
    # Two cycles, as the journal has them: under load the second one's training may be
    # stopped before it printed its start (seen in CI).
    assert len([e for e in job.events if e["event"] == "cycle"]) == 2, job.log[-3000:]
    assert cycle_starts(job.log)[0] == 0, job.log[-3000:]
    assert [e for e in job.events if e["event"] == "checkpoint"][-1]["step"] > 0


def test_chain_mode_finishes_the_same_training_with_the_same_result(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["chain"], slurm_jobs.watcher

    def all_tasks_done() -> bool:
        recs = watcher.tasks(job.job_id)
        return len(recs) == CHAIN_TASKS and all(r.get("JobState") in FINISHED_STATES
                                                for r in recs)

    watcher.wait(f"all {CHAIN_TASKS} chain tasks to finish", all_tasks_done)
    recs = watcher.tasks(job.job_id)
    assert {r["JobState"] for r in recs} == {"COMPLETED"}, recs
    assert {r["Restarts"] for r in recs} == {"0"}  # a chain never requeues
    assert_bit_identical(slurm_jobs.tiny_reference, job.workdir / "final.pt")
    log = job.log
    starts = cycle_starts(log)
    assert len(starts) >= 2 and starts[0] == 0, starts
    assert trained_steps(log) == list(range(1, TRAIN_STEPS + 1))
    # Every task ran the command and trained, or (under load: Slurm's USR1 came first) was
    # stopped before the training connected; the tasks after the finish exit at once.
    ran = re.findall(r"^procckpt: cycle \d+: started", log, flags=re.M)
    unconnected = log.count("(the command never connected to procckpt)")
    assert len(starts) + unconnected == len(ran), log[-4000:]
    assert log.count("already finished") == CHAIN_TASKS - len(ran), log[-4000:]
    if "already finished" in log:  # none when the last task trained the last steps
        assert log.rindex("start step") < log.index("already finished")


def test_start_up_warns_about_setups_that_lose_work(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["warnings"], slurm_jobs.watcher
    # The warnings come before the command starts: the cycle's start means they are all out.
    # (Not the training's first line: on a loaded runner, a start-up longer than the 15-45 s
    # before Slurm's USR1 ended this job, which is not requeued, before it trained.)
    def out() -> bool:
        recs = watcher.tasks(job.job_id)
        return "procckpt: cycle 1: started" in job.log or \
            bool(recs) and recs[0].get("JobState") in FINISHED_STATES
    watcher.wait("the warnings job to start its command", out, job=job)
    slurm_jobs.cluster.scancel(job.job_id)
    watcher.wait_done(job.job_id, timeout=60)
    warnings = [line for line in job.log.splitlines() if line.startswith("procckpt: ")]
    expected = {
        "no exec": "Start procckpt with `exec procckpt run ...` in the job script",
        "truncated log": "the job script has no '#SBATCH --open-mode=append'",
        "node-local dir": f"the checkpoint dir {job.extra['local_dir'] / 'ckpt'} looks "
                          "node-local (it is under /tmp)",
        "no requeue": f"Slurm job {job.job_id} cannot be requeued (Requeue=0",
    }
    missing = [name for name, text in expected.items() if not any(text in w for w in warnings)]
    assert not missing, f"no warning for {missing}; procckpt said: {warnings}"


def test_container_mode_requeues_from_outside_the_container(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["container"], slurm_jobs.watcher
    record = watcher.wait_done(job.job_id)
    assert record["JobState"] == "COMPLETED", (record, job.log[-3000:])
    restarts = int(record["Restarts"])
    assert restarts >= 1
    assert_bit_identical(slurm_jobs.tiny_reference, job.workdir / "final.pt")
    log = job.log
    assert log.count("procckpt: scontrol not found (inside a container?)") == restarts + 1, \
        said(log)
    assert log.count("but scontrol is not available here (inside a container?), so procckpt "
                     "cannot requeue it; exiting with 75") == restarts, (restarts, said(log))
    stops = [e["reason"] for e in job.events if e["event"] == "trigger" and e["action"] == "stop"]
    # From the end time passed in from outside (the last cycle may ask once the training is
    # done, as it writes its output).
    assert set(stops) == {"deadline"} and restarts <= len(stops) <= restarts + 1, \
        (stops, said(log))
    assert trained_steps(log) == list(range(1, TRAIN_STEPS + 1)), said(log)


def test_an_extended_time_limit_moves_the_checkpoint(slurm_jobs: Submitted):
    job, watcher = slurm_jobs.jobs["extend"], slurm_jobs.watcher
    # The fixture extends the limit from 1 to 2 minutes once procckpt runs; procckpt reads the
    # end time every 10 s near the end.
    watcher.wait("the limit to be extended", lambda: "extended" in job.extra, timeout=180)
    assert job.extra["extended"] is True, job.extra["extended"]
    watcher.wait("procckpt to notice", lambda: "the end time moved by 1m00s" in job.log,
                 timeout=60)

    def stop_trigger() -> list[dict]:
        return [e for e in job.events if e["event"] == "trigger" and e["action"] == "stop"]

    watcher.wait("the checkpoint before the new limit", lambda: bool(stop_trigger()),
                 timeout=180)
    slurm_jobs.cluster.scancel(job.job_id)
    started = next(e["time"] for e in job.events if e["event"] == "start")
    trigger = stop_trigger()[0]
    assert trigger["reason"] == "deadline"
    # The old limit would have asked at ~45 s (60 s - 15 s grace); the new one at ~90 s
    # (120 s - 30 s). Job start to procckpt start takes a few seconds, hence the slack.
    assert 70 <= trigger["time"] - started <= 100, trigger["time"] - started
    # The scancel came while procckpt checkpointed for the limit: the job must not come back.
    # (scancel cancels a job that procckpt requeued first as well.)
    record = watcher.wait_done(job.job_id, timeout=120)
    assert record["JobState"] == "CANCELLED", (record, job.log[-2000:])
    if record["Restarts"] == "0":
        assert "requeued Slurm job" not in job.log, job.log[-2000:]
