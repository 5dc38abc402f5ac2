"""The throwaway Slurm cluster works, and the Slurm behaviour procckpt relies on holds.

These tests pin down facts about Slurm 22.05 that procckpt's design depends on (who gets which
signal when, what a requeue looks like, what a job can learn about its end time). Run with
``-s`` to see the measured timings.

The signal/requeue tests run on a cluster of their own whose requeue hold is 31 s: Slurm holds a
requeued job for ``cred_expire`` + 1 s (121 s by default; the suite's clusters use 6 s), and
the test asserts that relation, which FAST_TEST_TIMING relies on, with time to see the job
wait. Their jobs are submitted together by one fixture so the waits overlap: about a minute
and a half.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from .harness.processes import wait_for
from .harness.slurm_cluster import SlurmCluster, slurm_cluster_fixture

# One worker runs the module: its fixture starts a cluster and submits the jobs together.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm-signals")]

# A job program that logs, as JSON lines, when it started (with its SLURM_* environment) and
# every signal it gets. The batch script `exec`s it, so it *is* the batch process, like a
# `procckpt run` supervisor would be.
#   --on-usr1 requeue : on SIGUSR1 run `scontrol requeue $SLURM_JOB_ID`, then exit 0
#   --ignore-term     : keep running after SIGTERM (to see whether SIGKILL follows)
#   --child           : start a child in its own session (start_new_session=True, as procckpt
#                       starts training), which logs its signals too
SIGNAL_LOGGER = r'''
import argparse, json, os, signal, subprocess, sys, time

p = argparse.ArgumentParser()
p.add_argument("--log", required=True)
p.add_argument("--on-usr1", choices=["ignore", "requeue"], default="ignore")
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--child", action="store_true")
p.add_argument("--role", default="main")
a = p.parse_args()

def log(**event):
    event.update(t=time.time(), pid=os.getpid(), role=a.role)
    with open(a.log, "a") as f:
        f.write(json.dumps(event) + "\n")

pending = []  # the handler only records; the loop below acts

def on_signal(signum, frame):
    log(event="signal", sig=signal.Signals(signum).name)
    pending.append(signal.Signals(signum).name)

for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT, signal.SIGINT,
          signal.SIGHUP):
    signal.signal(s, on_signal)

env = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
log(event="start", env=env, sid=os.getsid(0))
restart = env.get("SLURM_RESTART_COUNT", "unset")
print(f"run start restart={restart}", flush=True)
if a.role == "main":
    q = subprocess.run(["squeue", "-h", "-j", env["SLURM_JOB_ID"], "-o", "%e"],
                       capture_output=True, text=True)
    log(event="squeue_end", rc=q.returncode, out=q.stdout.strip(), err=q.stderr.strip())
if a.child:
    subprocess.Popen([sys.executable, __file__, "--log", a.log, "--role", "child",
                      "--ignore-term"], start_new_session=True)

while True:
    while pending:
        sig = pending.pop(0)
        if sig == "SIGUSR1" and a.on_usr1 == "requeue":
            r = subprocess.run(["scontrol", "requeue", env["SLURM_JOB_ID"]],
                               capture_output=True, text=True)
            log(event="requeued", rc=r.returncode, err=r.stderr.strip())
            print(f"run requeued restart={restart}", flush=True)
            sys.exit(0)
        if sig == "SIGTERM" and not a.ignore_term:
            log(event="exit")
            sys.exit(0)
    time.sleep(0.1)
'''


#: The requeue hold of the signal tests' cluster: long enough to see the job held on a loaded
#: machine, far shorter than Slurm's 120 s.
SIGNAL_HOLD = 30


@pytest.fixture(scope="module")
def signal_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A cluster whose requeued jobs wait SIGNAL_HOLD + 1 s, to measure that hold."""
    yield from slurm_cluster_fixture(tmp_path_factory.mktemp("slurm-signals"),
                                     cred_expire=SIGNAL_HOLD)


@pytest.fixture(scope="module")
def signal_logger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("programs") / "signal_logger.py"
    path.write_text(SIGNAL_LOGGER)
    return path


def logger_script(program: Path, log: Path, *args: str) -> str:
    return f"#!/bin/bash\nexec {sys.executable} {program} --log {log} {' '.join(args)}\n"


def read_events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait_for_event(log: Path, pred, timeout: float) -> list[dict]:
    """Poll the JSON-lines log until an event matches `pred`; return all events."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(log)
        if any(pred(e) for e in events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"no matching event in {log} after {timeout:.0f} s: {events}")
        time.sleep(0.5)


def signals(events: list[dict], role: str = "main") -> list[tuple[str, float]]:
    return [(e["sig"], e["t"]) for e in events if e["event"] == "signal" and e["role"] == role]


def pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.2)
    return False


def slurm_time(value: str) -> float:
    """Epoch seconds of a Slurm timestamp (``2024-01-31T12:00:00``, local time)."""
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()


# -- basic cluster ---------------------------------------------------------------------------


def test_batch_job_runs_and_writes_output(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "hello.out"
    job = slurm_cluster.sbatch(
        ["-t", "1", "-o", str(out)], "#!/bin/bash\necho hello from job $SLURM_JOB_ID\n"
    )
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=60)
    assert info["ExitCode"] == "0:0"
    assert out.read_text() == f"hello from job {job}\n"


def test_job_sees_end_time_through_squeue_not_env(
    slurm_cluster: SlurmCluster, signal_logger: Path, tmp_path: Path
) -> None:
    """22.05 exports no SLURM_JOB_END_TIME; ``squeue -h -j ID -o %e`` gives the end time."""
    log = tmp_path / "events.jsonl"
    job = slurm_cluster.sbatch(
        ["-t", "7", "-o", str(tmp_path / "out")], logger_script(signal_logger, log)
    )
    events = wait_for_event(log, lambda e: e["event"] == "squeue_end", timeout=60)
    info = slurm_cluster.job_info(job)
    slurm_cluster.scancel(job)

    start = next(e for e in events if e["event"] == "start")
    squeue = next(e for e in events if e["event"] == "squeue_end")
    version = slurm_cluster.run(["sinfo", "-V"]).stdout.split()[-1]
    print(f"\n[facts] Slurm {version}: job env has SLURM_JOB_END_TIME="
          f"{start['env'].get('SLURM_JOB_END_TIME', '(unset)')}; squeue %e -> {squeue['out']!r}; "
          f"SLURM_* names: {sorted(start['env'])}")
    if version.startswith("22."):
        # Added in a later release; procckpt must not rely on it with 22.05.
        assert "SLURM_JOB_END_TIME" not in start["env"]
    assert squeue["rc"] == 0, squeue["err"]
    # Same clock, same format as scontrol: StartTime + TimeLimit.
    assert squeue["out"] == info["EndTime"]
    assert slurm_time(info["EndTime"]) - slurm_time(info["StartTime"]) == 7 * 60


def test_scancel_sends_cont_then_term_to_every_process_then_kill(
    slurm_cluster: SlurmCluster, signal_logger: Path, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    job = slurm_cluster.sbatch(
        ["-t", "5", "-o", str(tmp_path / "out")],
        logger_script(signal_logger, log, "--ignore-term", "--child"),
    )
    events = wait_for_event(
        log, lambda e: e["event"] == "start" and e["role"] == "child", timeout=60
    )
    pids = {e["role"]: e["pid"] for e in events if e["event"] == "start"}
    t_cancel = time.time()
    slurm_cluster.scancel(job)
    for role in ("child", "main"):  # each logs its own; under load one may lag the other
        events = wait_for_event(
            log, lambda e, role=role: e.get("sig") == "SIGTERM" and e["role"] == role,
            timeout=15,
        )
    for role in ("main", "child"):
        got = signals(events, role)
        names = [name for name, _ in got]
        # Slurm sends SIGCONT (wakes a stopped job so it can handle SIGTERM), then SIGTERM; the
        # child gets them too although it is in its own session: proctrack/linuxproc signals
        # the whole process tree, and proctrack/cgroup the whole cgroup. The order the handlers
        # run in is not the order sent: when both are pending before the process is scheduled,
        # Linux runs the lower-numbered one (SIGTERM, 15) first (seen in CI), so check both.
        assert sorted(names[:2]) == ["SIGCONT", "SIGTERM"], (role, got)
        # Generous: the machine is shared and noisy.
        assert max(t for _, t in got[:2]) - t_cancel < 15
    # Both ignore SIGTERM: SIGKILL follows after KillWait.
    for role, pid in pids.items():
        assert pid_gone(pid, slurm_cluster.kill_wait + 20), f"{role} {pid} survived scancel"
    t_gone = time.time()
    info = slurm_cluster.wait_state(job, "CANCELLED", timeout=30)
    assert info["ExitCode"] == "0:9"  # killed by signal 9
    print(f"\n[facts] scancel: main got {[n for n, _ in signals(events)]} "
          f"{signals(events)[1][1] - t_cancel:.2f}s after scancel; child "
          f"{[n for n, _ in signals(events, 'child')]}; all gone after {t_gone - t_cancel:.1f}s "
          f"(KillWait={slurm_cluster.kill_wait})")


def test_array_with_throttle_runs_tasks_one_at_a_time(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = (
        "#!/bin/bash\n"
        f"echo $SLURM_ARRAY_TASK_ID start $(date +%s.%N) >> {tmp_path}/times\n"
        "sleep 3\n"
        f"echo $SLURM_ARRAY_TASK_ID end $(date +%s.%N) >> {tmp_path}/times\n"
    )
    job = slurm_cluster.sbatch(["-t", "2", "--array=1-3%1", "-o", "/dev/null"], script)
    deadline = time.monotonic() + 120
    while True:
        records = slurm_cluster.jobs_info(job)
        states = {r.get("ArrayTaskId"): r["JobState"] for r in records}
        assert sum(s == "RUNNING" for s in states.values()) <= 1, states
        if len(records) == 3 and all(s == "COMPLETED" for s in states.values()):
            break
        assert time.monotonic() < deadline, f"array {job} not done: {states}"
        time.sleep(0.3)

    spans: dict[str, list[float]] = {}
    for line in (tmp_path / "times").read_text().splitlines():
        task, _, stamp = line.split()
        spans.setdefault(task, []).append(float(stamp))
    ordered = sorted(spans.values())
    assert len(ordered) == 3
    for (_, end), (next_start, _) in zip(ordered, ordered[1:]):
        assert end <= next_start, f"array tasks overlapped: {spans}"
    gaps = [f"{b[0] - a[1]:.1f}" for a, b in zip(ordered, ordered[1:])]
    print(f"\n[facts] --array=1-3%1 ran serially; gaps between tasks (s): {gaps}")


def test_requeue_with_fast_test_timing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The fixture's short cred_expire/sched_interval make a requeued job rerun in seconds."""
    out = tmp_path / "out"
    job = slurm_cluster.sbatch(
        ["-t", "5", "--open-mode=append", "-o", str(out)],
        "#!/bin/bash\necho run restart=${SLURM_RESTART_COUNT:-unset}\nsleep 600\n",
    )
    slurm_cluster.wait_state(job, "RUNNING", timeout=60)
    # RUNNING in slurmctld comes before the script's first line: requeue only once it ran.
    deadline = time.monotonic() + 30
    while (not out.exists() or "restart=unset" not in out.read_text()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    t0 = time.monotonic()
    slurm_cluster.run(["scontrol", "requeue", str(job)])
    # Requeued, the job waits for a begin time. Its first PENDING record may still say
    # "Reason=None" (seen under load): the scheduler names the hold on its next pass.
    slurm_cluster.wait_state(job, "PENDING", timeout=30, poll=0.1)

    def held() -> dict[str, str] | None:  # the hold named, or the job pending no more
        info = slurm_cluster.job_info(job)
        return info if info["Reason"] == "BeginTime" or info["JobState"] != "PENDING" else None

    info = wait_for("the requeued job's hold to be named", held, 30)
    assert (info["JobState"], info["Restarts"], info["Reason"]) == (
        "PENDING", "1", "BeginTime"), info
    slurm_cluster.wait_state(job, "RUNNING", timeout=60)
    delay = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while "restart=1" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm_cluster.scancel(job)
    text = out.read_text()
    first, second = text.find("run restart=unset\n"), text.find("run restart=1\n")
    assert 0 <= first < second, text
    print(f"\n[facts] requeue->running with cred_expire={slurm_cluster.cred_expire}, "
          f"{slurm_cluster.scheduler_parameters}: {delay:.1f}s")


# -- --signal, the time limit, a requeue from inside the job ----------------------------------


@dataclass
class SignalJobs:
    requeue_job: int
    requeue_log: Path
    requeue_out: Path
    limit_job: int
    limit_log: Path


@pytest.fixture(scope="module")
def signal_jobs(
    signal_cluster: SlurmCluster, signal_logger: Path, tmp_path_factory
) -> SignalJobs:
    """Submit both 1-minute jobs at once so their waits overlap."""
    d = tmp_path_factory.mktemp("signal-jobs")
    cluster = signal_cluster
    requeue_job = cluster.sbatch(
        ["-t", "1", "--signal=B:USR1@40", "--open-mode=append", "-o", str(d / "requeue.out")],
        logger_script(signal_logger, d / "requeue.jsonl", "--on-usr1", "requeue"),
    )
    limit_job = cluster.sbatch(
        ["-t", "1", "--signal=B:USR1@40", "-o", str(d / "limit.out")],
        logger_script(signal_logger, d / "limit.jsonl", "--ignore-term", "--child"),
    )
    return SignalJobs(requeue_job, d / "requeue.jsonl", d / "requeue.out", limit_job,
                      d / "limit.jsonl")


@pytest.mark.slow
def test_usr1_before_limit_then_requeue_from_inside_reruns_job(
    signal_cluster: SlurmCluster, signal_jobs: SignalJobs
) -> None:
    cluster, job, log = signal_cluster, signal_jobs.requeue_job, signal_jobs.requeue_log
    events = wait_for_event(log, lambda e: e["event"] == "requeued", timeout=120)
    start = next(e for e in events if e["event"] == "start")
    usr1 = next(t for name, t in signals(events) if name == "SIGUSR1")
    requeued = next(e for e in events if e["event"] == "requeued")
    assert requeued["rc"] == 0, requeued["err"]
    assert "SLURM_RESTART_COUNT" not in start["env"]  # unset on the first run, not "0"
    # Nominal: 60 s - 40 s = 20 s after start. slurmctld checks --signal times in its
    # periodic background pass (~30 s), so USR1 comes up to ~30 s late, never early.
    after_start = usr1 - start["t"]
    assert 18 <= after_start <= 55, after_start

    info = cluster.wait_state(job, "PENDING", timeout=30, poll=0.2)
    # slurmctld may show the requeued job PENDING a moment before it sets the hold's reason
    # and time (CI saw Reason=None once): give it a few seconds.
    settled = time.monotonic() + 15
    while info.get("Reason") == "None" and time.monotonic() < settled:
        time.sleep(0.2)
        info = cluster.job_info(job)
    pending_record = {k: info[k] for k in ("JobState", "Reason", "Restarts", "EligibleTime")}
    assert (info["Restarts"], info["Reason"]) == ("1", "BeginTime")
    # The requeue hold is cred_expire + 1 s from the requeue (Slurm's default: 120 + 1).
    hold = slurm_time(info["EligibleTime"]) - requeued["t"]
    assert abs(hold - (SIGNAL_HOLD + 1)) <= 2, (hold, pending_record)

    info = cluster.wait_state(job, "RUNNING", timeout=200, poll=1)
    events = wait_for_event(
        log, lambda e: e["event"] == "start" and "SLURM_RESTART_COUNT" in e["env"], timeout=30
    )
    second = [e for e in events if e["event"] == "start"][1]
    assert second["env"]["SLURM_RESTART_COUNT"] == "1"
    rerun_delay = second["t"] - requeued["t"]
    # Calling `scontrol requeue` on itself kills the running job: SIGCONT + SIGTERM at once.
    after_requeue = [(n, round(t - requeued["t"], 2)) for n, t in signals(events)
                     if requeued["t"] <= t < second["t"]]
    cluster.scancel(job)
    out = signal_jobs.requeue_out.read_text()
    # --open-mode=append keeps the first run's output.
    assert "run start restart=unset" in out and "run start restart=1" in out, out
    print(f"\n[facts] --signal=B:USR1@40 with -t 1: USR1 {after_start:.1f}s after start "
          f"(nominal 20); signals: {[n for n, _ in signals(events)]}; "
          f"after own requeue: {after_requeue}; pending record: {pending_record}; "
          f"hold {hold:.0f}s; requeue->rerun {rerun_delay:.1f}s; rerun Restarts="
          f"{info['Restarts']}; output:\n{out}")


@pytest.mark.slow
def test_time_limit_sends_term_to_every_process_then_kill(
    signal_cluster: SlurmCluster, signal_jobs: SignalJobs
) -> None:
    cluster, job, log = signal_cluster, signal_jobs.limit_job, signal_jobs.limit_log
    info = cluster.wait_state(job, "TIMEOUT", timeout=150, poll=1)
    assert info["Reason"] == "TimeLimit"
    assert info["ExitCode"] == "0:9"  # it ignored SIGTERM, so SIGKILL after KillWait
    events = read_events(log)
    pids = {e["role"]: e["pid"] for e in events if e["event"] == "start"}
    for pid in pids.values():
        assert pid_gone(pid, 10)
    main, child = signals(events, "main"), signals(events, "child")
    start = next(e["t"] for e in events if e["event"] == "start" and e["role"] == "main")
    # B: sends USR1 to the batch process only; the time limit signals every process.
    assert "SIGUSR1" in [n for n, _ in main]
    assert "SIGUSR1" not in [n for n, _ in child]
    term_main = next(t for n, t in main if n == "SIGTERM")
    term_child = next(t for n, t in child if n == "SIGTERM")
    assert abs(term_main - term_child) < 1
    # Nominal at 60 s; enforced by the same ~30 s periodic pass, so up to ~30 s late.
    assert 58 <= term_main - start <= 100, term_main - start
    usr1 = next(t for n, t in main if n == "SIGUSR1")
    print(f"\n[facts] time limit: main got {[(n, round(t - start, 1)) for n, t in main]}, "
          f"child {[(n, round(t - start, 1)) for n, t in child]} (s after start); "
          f"USR1->TERM {term_main - usr1:.1f}s; final {info['JobState']} {info['Reason']} "
          f"ExitCode={info['ExitCode']}")
