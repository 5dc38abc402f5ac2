"""Unit tests of slurm.py: parsing what Slurm prints, the deadline, the requeue decision and
the start-up warnings, fed with ``scontrol`` output recorded from the test cluster (Slurm 22.05).
The same code runs against the real cluster in tests/e2e/test_slurm.py."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from procckpt.launcher.config import RunConfig
from procckpt.launcher.restart import Decision, StopCause
from procckpt.schedulers.slurm import (
    JobRecord,
    SlurmDeadline,
    SlurmJob,
    SlurmRequeue,
    StopKind,
    node_local_reason,
    parse_scontrol_record,
    parse_slurm_time,
    parse_time_limit,
    sbatch_directives,
    slurm_env,
    startup_warnings,
)
from procckpt.schedulers.slurm.nodes import lost_nodes

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0  # the fake wall clock


def stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%dT%H:%M:%S")


def record_line(job_id: str = "42", *, state: str = "RUNNING", end: float = NOW + 300,
                limit: str = "00:05:00", requeue: str = "1", preempt: str = "None",
                array: str = "", reason: str = "None", restarts: int = 0) -> str:
    """A line of `scontrol -o show job` as the test cluster prints it (shortened)."""
    return (f"JobId={job_id} {array}JobName=train UserId=root(0) GroupId=root(0) "
            f"MCS_label=N/A Priority=4294901759 Nice=0 Account=(null) QOS=(null) "
            f"JobState={state} Reason={reason} Dependency=(null) Requeue={requeue} "
            f"Restarts={restarts} "
            f"BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit={limit} TimeMin=N/A "
            f"SubmitTime={stamp(NOW - 10)} EligibleTime={stamp(NOW - 10)} "
            f"StartTime={stamp(end - 300)} EndTime={stamp(end)} Deadline=N/A "
            f"PreemptEligibleTime={stamp(NOW)} PreemptTime={preempt} SuspendTime=None "
            "Partition=debug NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 "
            "Command=(null) WorkDir=/work/my runs StdErr=/work/my runs/slurm.out "
            "StdIn=/dev/null StdOut=/work/my runs/slurm.out Power=")


class FakeSlurm:
    """Answers the few Slurm commands slurm.py runs, and records them."""

    def __init__(self, record: str | None = None, *, requeue_rc: int = 0,
                 requeue_err: str = "", script: str | None = None, job_file_append: str = "0",
                 tools: tuple[str, ...] = ("scontrol", "squeue")) -> None:
        self.record = record if record is not None else record_line()
        self.requeue_rc = requeue_rc
        self.requeue_err = requeue_err
        self.script = script
        self.job_file_append = job_file_append
        self.tools = tools
        self.calls: list[list[str]] = []
        #: Nodes by name: (NodeAddr, State), for ``scontrol show node`` and ``show hostnames``.
        self.nodes: dict[str, tuple[str, str]] = {}
        self.slurmd_port = 6818
        #: What ``scontrol show job`` prints once ``scontrol requeue`` has run, if it changes.
        self.record_after_requeue: str | None = None
        #: Set: ``scontrol requeue`` does its work but times out before it answers.
        self.requeue_timeout = False
        #: ``KillWait`` in ``scontrol show config``, in seconds (None: not said).
        self.kill_wait: int | None = None
        #: Set: ``scontrol show job`` answers only once it is set (a controller that is slow).
        self.answer = threading.Event()
        self.answer.set()

    def which(self, name: str) -> str | None:
        return f"/usr/bin/{name}" if name in self.tools else None

    def run(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        out, err, rc = "", "", 0
        if argv[:4] == ["scontrol", "-o", "show", "node"]:
            out = "".join(f"NodeName={name} Arch=x86_64 NodeAddr={addr} NodeHostName={name} "
                          f"State={state} Partitions=debug\n"
                          for name, (addr, state) in self.nodes.items()
                          if name in argv[4].split(","))
        elif argv[:3] == ["scontrol", "show", "hostnames"]:
            out = "\n".join(self.nodes) + "\n"
        elif argv[:3] == ["scontrol", "-o", "show"]:
            self.answer.wait(30)
            out = self.record + "\n"
        elif argv[:2] == ["scontrol", "requeue"]:
            rc, err = self.requeue_rc, self.requeue_err
            self.record = self.record_after_requeue or self.record
            if self.requeue_timeout:
                raise subprocess.TimeoutExpired(argv, 15.0)
        elif argv[:3] == ["scontrol", "write", "batch_script"]:
            out, rc = (self.script, 0) if self.script is not None else ("", 1)
        elif argv[:3] == ["scontrol", "show", "config"]:
            out = f"JobCompType             = jobcomp/none\nJobFileAppend           = " \
                  f"{self.job_file_append}\nJobRequeue              = 1\n" \
                  f"SlurmdPort              = {self.slurmd_port}\n"
            if self.kill_wait is not None:
                out += f"KillWait                = {self.kill_wait} sec\n"
        return subprocess.CompletedProcess(argv, rc, out, err)

    def requeues(self) -> list[list[str]]:
        return [c for c in self.calls if c[:2] == ["scontrol", "requeue"]]


def make_job(fake: FakeSlurm, **environ: str) -> SlurmJob:
    env = slurm_env({"SLURM_JOB_ID": "42", **environ})
    assert env is not None
    return SlurmJob(env, run=fake.run, which=fake.which)


class Clock:
    def __init__(self) -> None:
        self.wall = NOW

    def __call__(self) -> float:
        return self.wall


# -- parsing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [
    ("1", 60), ("90", 5400), ("1:30", 90), ("1:00:00", 3600), ("00:05:00", 300),
    ("2-0", 172800), ("1-2:3", 93780), ("1-02:03:04", 93784), ("UNLIMITED", None),
    ("Partition_Limit", None), ("", None),
])
def test_time_limits_in_every_sbatch_form(text: str, seconds: float | None):
    assert parse_time_limit(text) == seconds


def test_end_times_are_local_time_and_unknown_is_none():
    assert parse_slurm_time("2026-11-21T07:39:50") == datetime(2026, 11, 21, 7, 39, 50).timestamp()
    for text in ("Unknown", "None", "N/A", ""):
        assert parse_slurm_time(text) is None


def test_scontrol_records_keep_values_with_spaces():
    fields = parse_scontrol_record(record_line())
    assert fields["WorkDir"] == "/work/my runs"
    assert fields["StdOut"] == "/work/my runs/slurm.out"
    assert fields["JobState"] == "RUNNING" and fields["Power"] == ""
    record = JobRecord(fields)
    assert record.time_limit == 300 and record.end_time == pytest.approx(NOW + 300, abs=1)
    assert record.requeue_allowed is True and not record.preempted
    assert JobRecord(parse_scontrol_record(record_line(preempt=stamp(NOW)))).preempted


def test_environment_of_plain_array_and_chain_jobs():
    assert slurm_env({}) is None
    assert slurm_env({"SLURM_JOB_ID": "42", "PROCCKPT_SLURM": "off"}) is None
    plain = slurm_env({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3"})
    assert plain is not None and plain.requeue_target == "42" and plain.restart_count == 3
    assert plain.end_time is None and plain.chain_position is None
    # An array task has its own job id, but requeueing must name <array job id>_<task id>.
    task = slurm_env({"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "41",
                      "SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3",
                      "SLURM_ARRAY_TASK_MAX": "9", "PROCCKPT_SLURM_CHAIN": "1",
                      "PROCCKPT_SLURM_END_TIME": "1800000060"})
    assert task is not None and task.requeue_target == "41_5" and task.label == "Slurm job 41_5"
    assert task.chain_position == (3, 7) and task.end_time == 1800000060.0


@pytest.mark.parametrize("bad", ["inf", "nan", "1", "soon"])
def test_an_end_time_that_is_no_future_time_is_ignored_with_a_warning(bad: str, caplog):
    job = slurm_env({"SLURM_JOB_ID": "42", "SLURM_JOB_END_TIME": bad})
    assert job is not None and job.end_time is None
    assert f"ignoring SLURM_JOB_END_TIME={bad!r}" in caplog.text


# -- the deadline -----------------------------------------------------------------------------
def end_after_reads(deadline: SlurmDeadline, cycle_started: float, now: float) -> float | None:
    """The deadline's end once a read that this call starts (in a thread) has answered."""
    deadline.end(cycle_started, now)
    for _ in range(500):
        if not deadline.refreshing:
            break
        time.sleep(0.01)
    return deadline.end(cycle_started, now)


def test_deadline_is_the_jobs_end_time_and_is_read_again_now_and_then(caplog):
    fake, clock = FakeSlurm(record_line(end=NOW + 600, limit="00:10:00")), Clock()
    deadline = SlurmDeadline(make_job(fake), wall=clock)
    assert deadline.job_started is None
    assert deadline.end(1000.0, 1000.0) == pytest.approx(1600.0, abs=1)
    assert deadline.limit == 600
    assert deadline.job_started == pytest.approx(NOW + 300, abs=1)  # StartTime, for goodput
    assert RunConfig().grace_for(deadline.limit) == 60
    reads = len(fake.calls)
    clock.wall += 30
    assert deadline.end(1000.0, 1030.0) == pytest.approx(1600.0, abs=1)
    assert len(fake.calls) == reads, "read again before a minute passed"
    # An admin extends the limit by 5 minutes: seen at the next read, a minute later.
    fake.record = record_line(end=NOW + 900, limit="00:15:00")
    clock.wall += 31
    with caplog.at_level(logging.INFO, logger="procckpt"):
        assert end_after_reads(deadline, 1000.0, 1061.0) == pytest.approx(1900.0, abs=1)
    assert "the end time moved by 5m00s" in caplog.text
    # Near the end it is read every 10 s.
    clock.wall = NOW + 800
    end_after_reads(deadline, 1000.0, 1800.0)
    reads = len(fake.calls)
    clock.wall += 11
    end_after_reads(deadline, 1000.0, 1811.0)
    assert len(fake.calls) == reads + 1


def test_a_slow_controller_never_holds_the_launchers_loop():
    # scontrol may wait its whole timeout for a busy slurmctld: meanwhile the launcher must go
    # on reacting to signals, so the end time is re-read in the background.
    fake, clock = FakeSlurm(record_line(end=NOW + 600, limit="00:10:00")), Clock()
    deadline = SlurmDeadline(make_job(fake), wall=clock)
    assert deadline.end(0.0, 0.0) == pytest.approx(600.0, abs=1)
    fake.answer.clear()
    try:
        fake.record = record_line(end=NOW + 900, limit="00:15:00")
        clock.wall += 61
        started = time.monotonic()
        for _ in range(3):
            assert deadline.end(0.0, 61.0) == pytest.approx(600.0, abs=1)
        assert time.monotonic() - started < 5 and deadline.refreshing
    finally:
        fake.answer.set()
    assert end_after_reads(deadline, 0.0, 61.0) == pytest.approx(900.0, abs=1)


def test_an_ending_job_does_not_move_the_deadline():
    # scancel, a requeue and the time-limit kill all set EndTime to now while the job
    # completes; the end read while it ran must stay, or a scancel would look like a time limit.
    fake, clock = FakeSlurm(record_line(end=NOW + 600)), Clock()
    deadline = SlurmDeadline(make_job(fake), wall=clock)
    deadline.end(0.0, 0.0)
    fake.record = record_line(state="COMPLETING", end=NOW + 61)
    clock.wall += 61
    end_after_reads(deadline, 0.0, 61.0)
    assert deadline.seconds_left() == pytest.approx(539, abs=1)


def test_without_scontrol_the_end_time_comes_from_the_environment():
    fake, clock = FakeSlurm(tools=()), Clock()
    job = make_job(fake, PROCCKPT_SLURM_END_TIME=str(NOW + 120))
    deadline = SlurmDeadline(job, wall=clock)
    assert deadline.end(50.0, 50.0) == pytest.approx(170.0)
    assert deadline.limit == pytest.approx(120.0)  # the time left sizes the default grace
    assert fake.calls == []


def test_a_shorter_time_limit_wins_and_nothing_known_means_no_deadline(caplog):
    fake = FakeSlurm(record_line(end=NOW + 3600, limit="01:00:00"))
    deadline = SlurmDeadline(make_job(fake), local_limit=60.0, wall=Clock())
    assert deadline.end(10.0, 10.0) == pytest.approx(70.0)
    assert deadline.limit == 60.0
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        unknown = SlurmDeadline(make_job(FakeSlurm(tools=())), wall=Clock())
        assert unknown.end(0.0, 0.0) is None
    assert "cannot learn the job's end time" in caplog.text


# -- the requeue decision ---------------------------------------------------------------------
def policy_for(fake: FakeSlurm, *, end: float = NOW + 600, max_restarts: int = 20,
               local_limit: float | None = None, clock: Clock | None = None,
               **environ: str) -> SlurmRequeue:
    clock = clock or Clock()
    fake.record = fake.record if end is None else record_line(end=end)
    job = make_job(fake, **environ)
    deadline = SlurmDeadline(job, local_limit=local_limit, wall=clock)
    deadline.end(0.0, 0.0)
    return SlurmRequeue(job, deadline, RunConfig(max_restarts=max_restarts))


def test_deadline_and_checkpoint_signal_requeue_the_task_by_its_array_name():
    fake = FakeSlurm()
    policy = policy_for(fake, SLURM_ARRAY_JOB_ID="41", SLURM_ARRAY_TASK_ID="5",
                        SLURM_RESTART_COUNT="2")
    assert policy.initial_restarts == 2
    verdict = policy.after_stop(StopCause.DEADLINE, None, 2)
    assert verdict.decision is Decision.REQUEUED
    assert verdict.message == ("requeued Slurm job 41_5 (its time limit is near); restart 3 of "
                               "20 resumes from the checkpoint")
    assert fake.requeues() == [["scontrol", "requeue", "41_5"]]
    assert policy.after_stop(StopCause.SIGNAL, "SIGUSR1", 3).decision is Decision.REQUEUED


def test_sigterm_far_from_the_end_is_a_cancel_and_is_not_requeued():
    fake = FakeSlurm()
    policy = policy_for(fake)
    assert policy.classify(StopCause.SIGNAL, "SIGTERM") is StopKind.CANCEL
    verdict = policy.after_stop(StopCause.SIGNAL, "SIGTERM", 0)
    assert verdict.decision is Decision.EXIT_RETRY
    assert "no time limit near and no preemption (scancel?): not requeued" in verdict.message
    assert fake.requeues() == []
    # The command stopping by itself after a SIGTERM of its own is judged the same way.
    assert policy.classify(StopCause.CHILD, None) is StopKind.CANCEL


def record_reads(fake: FakeSlurm) -> int:
    return sum(1 for call in fake.calls if call[:3] == ["scontrol", "-o", "show"])


def test_why_the_job_stops_is_asked_while_the_checkpoint_is_written():
    fake, clock = FakeSlurm(), Clock()
    policy = policy_for(fake, clock=clock)
    reads = record_reads(fake)
    policy.deadline.stop_asked("SIGTERM")
    # Slurm's answer comes in the background, before the checkpoint is done ...
    for _ in range(200):
        if record_reads(fake) > reads:
            break
        time.sleep(0.01)
    assert record_reads(fake) == reads + 1
    # ... and the decision after it asks nothing more.
    verdict = policy.after_stop(StopCause.SIGNAL, "SIGTERM", 0)
    assert "no time limit near and no preemption (scancel?): not requeued" in verdict.message
    assert record_reads(fake) == reads + 1


def test_a_controller_silent_until_the_kill_still_gets_procckpts_last_words():
    fake, clock = FakeSlurm(), Clock()
    fake.kill_wait = 10
    policy = policy_for(fake, clock=clock)
    assert policy.deadline.kill_wait == 10
    fake.answer.clear()
    try:
        policy.deadline.stop_asked("SIGTERM")
        clock.wall = NOW + 7.5  # the checkpoint took 7.5 s of the 10 before the SIGKILL
        started = time.monotonic()
        verdict = policy.after_stop(StopCause.SIGNAL, "SIGTERM", 0)
        assert time.monotonic() - started < 5
    finally:
        fake.answer.set()
    assert verdict.decision is Decision.EXIT_RETRY and fake.requeues() == []
    assert "Slurm did not say within its KillWait whether the job is preempted: not " \
        "requeued" in verdict.message
    # With time left before the kill, a late answer is waited for.
    fake.answer.clear()
    policy.deadline.stop_asked("SIGTERM")
    threading.Timer(0.5, fake.answer.set).start()
    clock.wall = NOW + 1
    assert policy.classify(StopCause.SIGNAL, "SIGTERM") is StopKind.CANCEL


def test_sigterm_at_the_time_limit_or_on_preemption_is_requeued():
    clock = Clock()
    fake = FakeSlurm()
    policy = policy_for(fake, end=NOW + 60, clock=clock)
    clock.wall = NOW + 75  # Slurm kills up to 30 s after the end
    assert policy.classify(StopCause.SIGNAL, "SIGTERM") is StopKind.TIME_LIMIT
    preempted = FakeSlurm()
    policy = policy_for(preempted)
    preempted.record = record_line(state="COMPLETING", preempt=stamp(NOW))
    assert policy.classify(StopCause.SIGNAL, "SIGTERM") is StopKind.PREEMPTION
    assert policy.after_stop(StopCause.SIGNAL, "SIGTERM", 0).message.startswith(
        "requeued Slurm job 42 (it is preempted)")


def test_budget_exhausted_is_not_requeued_and_says_what_to_do():
    fake = FakeSlurm()
    verdict = policy_for(fake, max_restarts=3, SLURM_RESTART_COUNT="3").after_stop(
        StopCause.DEADLINE, None, 3)
    assert verdict.decision is Decision.BUDGET_EXHAUSTED
    assert verdict.message.startswith("restart budget exhausted: Slurm job 42 has used 3 of "
                                      "--max-restarts 3 (SLURM_RESTART_COUNT)")
    assert "raise --max-restarts" in verdict.message and fake.requeues() == []


def test_without_scontrol_or_when_requeue_fails_it_exits_75_for_someone_else_to_act():
    verdict = policy_for(FakeSlurm(tools=()), end=None,
                         PROCCKPT_SLURM_END_TIME=str(NOW + 60)).after_stop(
        StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.EXIT_RETRY
    assert "scontrol is not available here" in verdict.message and "exiting with 75" in \
        verdict.message
    refused = FakeSlurm(requeue_rc=1,
                        requeue_err="Requested operation is presently disabled for job 42")
    verdict = policy_for(refused).after_stop(StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.EXIT_RETRY
    assert verdict.message.startswith("scontrol requeue 42 failed: Requested operation is "
                                      "presently disabled for job 42")


def test_a_requeue_whose_scontrol_the_requeue_itself_killed_counts_if_slurm_did_it():
    # Slurm signals every process of the job it requeues, scontrol too if it has not exited.
    killed = FakeSlurm(requeue_rc=-15)
    policy = policy_for(killed, SLURM_RESTART_COUNT="1")
    killed.record_after_requeue = record_line(state="COMPLETING", restarts=2)
    verdict = policy.after_stop(StopCause.DEADLINE, None, 1)
    assert verdict.decision is Decision.REQUEUED, verdict.message
    assert verdict.message.startswith("requeued Slurm job 42 (its time limit is near)")
    # Killed before it reached the controller: Restarts did not move, so it failed.
    early = FakeSlurm(requeue_rc=-15)
    verdict = policy_for(early, SLURM_RESTART_COUNT="1").after_stop(StopCause.DEADLINE, None, 1)
    assert verdict.decision is Decision.EXIT_RETRY
    assert verdict.message.startswith("scontrol requeue 42 failed: exit code -15")


def test_a_requeue_whose_scontrol_timed_out_counts_if_slurm_did_it():
    # A loaded controller: scontrol requeue times out, but the job was requeued (seen in CI,
    # where a cycle's "requeued" line was missing though Slurm counted the restart).
    slow = FakeSlurm()
    slow.requeue_timeout = True
    slow.record_after_requeue = record_line(state="COMPLETING", restarts=1)
    verdict = policy_for(slow).after_stop(StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.REQUEUED, verdict.message
    assert verdict.message.startswith("requeued Slurm job 42 (its time limit is near)")
    # Timed out and not done: the one line says so.
    lost = FakeSlurm()
    lost.requeue_timeout = True
    verdict = policy_for(lost).after_stop(StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.EXIT_RETRY
    assert verdict.message.startswith("scontrol requeue 42 failed: scontrol could not be run, "
                                      "or did not answer in time")


def test_a_job_cancelled_while_it_checkpointed_for_its_limit_is_not_brought_back():
    fake = FakeSlurm()
    policy = policy_for(fake)
    # What scontrol shows of a running job that scancel is ending.
    fake.record = record_line(state="COMPLETING")
    verdict = policy.after_stop(StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.EXIT_RETRY
    assert verdict.message == ("Slurm job 42 stopped (its time limit is near) and was cancelled "
                               "meanwhile (scancel?): not requeued. The checkpoint is kept: "
                               "submit the job again to resume")
    assert fake.requeues() == []
    # Ended by its time limit (the reason says so) or already requeued by Slurm: it comes back.
    fake.record = record_line(state="COMPLETING", reason="TimeLimit")
    assert policy.after_stop(StopCause.DEADLINE, None, 0).decision is Decision.REQUEUED
    assert len(fake.requeues()) == 1
    fake.record = record_line(state="PENDING", reason="BeginTime", restarts=1)
    verdict = policy.after_stop(StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.REQUEUED and len(fake.requeues()) == 1
    assert "Slurm has requeued it already" in verdict.message


def test_chain_tasks_stop_without_requeue_and_the_last_one_says_the_chain_is_used_up():
    array = {"SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_MIN": "1",
             "SLURM_ARRAY_TASK_MAX": "5", "PROCCKPT_SLURM_CHAIN": "1"}
    fake = FakeSlurm()
    middle = policy_for(fake, SLURM_ARRAY_TASK_ID="2", **array)
    assert middle.initial_restarts == 1
    verdict = middle.after_stop(StopCause.SIGNAL, "SIGUSR1", 1)
    assert verdict.decision is Decision.REQUEUED and "chain task 2 of 5" in verdict.message
    last = policy_for(fake, SLURM_ARRAY_TASK_ID="5", **array)
    verdict = last.after_stop(StopCause.DEADLINE, None, 4)
    assert verdict.decision is Decision.BUDGET_EXHAUSTED
    assert "last of 5 chain tasks" in verdict.message
    assert fake.requeues() == []


def test_a_local_time_limit_restarts_here_while_the_job_has_time():
    fake = FakeSlurm()
    policy = policy_for(fake, end=NOW + 3600, local_limit=60.0)
    verdict = policy.after_stop(StopCause.DEADLINE, None, 0)
    assert verdict.decision is Decision.RESTART_HERE and fake.requeues() == []


def test_a_stop_for_the_jobs_end_is_requeued_however_long_before_it_the_lead_asked():
    # --time-limit 900s in a job that ends in 600 s: the job's end comes first. The measured
    # lead (a slow write, a long validation) asked for the checkpoint 120 s before it, so 115 s
    # are left after it: far more than the grace, yet the job's end it was, not the local one.
    clock = Clock()
    fake = FakeSlurm()
    policy = policy_for(fake, end=NOW + 600, local_limit=900.0, clock=clock)
    clock.wall = NOW + 485
    assert policy.classify(StopCause.DEADLINE, None) is StopKind.TIME_LIMIT
    assert policy.after_stop(StopCause.DEADLINE, None, 0).decision is Decision.REQUEUED
    # The same cycle with the local limit first (it ends at 300 s) restarts here.
    local = policy_for(FakeSlurm(), end=NOW + 600, local_limit=300.0, clock=Clock())
    assert local.classify(StopCause.DEADLINE, None) is StopKind.LOCAL_LIMIT


# -- start-up warnings ------------------------------------------------------------------------
SHARED_MOUNTS = ("/dev/sda1 / ext4 rw 0 0\nnfs:/home /home nfs4 rw 0 0\n"
                 "tmpfs /scratch/ram tmpfs rw 0 0\n")
BATCH_SHELL = ["/bin/bash", "/var/spool/slurmd/job00042/slurm_script"]
STEPD = ["slurmstepd: [42.batch]"]


def warnings_for(fake: FakeSlurm, directory: str = "/home/me/ckpt", parent=STEPD,
                 **environ: str) -> list[str]:
    return startup_warnings(make_job(fake, **environ), RunConfig(dir=Path(directory)),
                            parent_cmdline=parent, mounts_text=SHARED_MOUNTS)


GOOD_SCRIPT = ("#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
               "#SBATCH --signal=B:USR1@60\nexec procckpt run -- python train.py\n")


def test_a_good_setup_gets_no_warning():
    assert warnings_for(FakeSlurm(script=GOOD_SCRIPT)) == []


def test_warns_when_the_batch_shell_gets_the_signal_instead_of_procckpt():
    script = GOOD_SCRIPT.replace("exec procckpt", "procckpt")
    (warning,) = warnings_for(FakeSlurm(script=script), parent=BATCH_SHELL)
    assert "--signal=B:USR1@60 signal instead of procckpt" in warning
    assert "`exec procckpt run ...`" in warning
    # Without a B: signal the shell gets nothing that procckpt needs.
    assert warnings_for(FakeSlurm(script=script.replace("B:USR1", "USR1")),
                        parent=BATCH_SHELL) == []


def test_warns_when_requeue_would_truncate_the_log():
    script = GOOD_SCRIPT.replace("#SBATCH --open-mode=append\n", "")
    (warning,) = warnings_for(FakeSlurm(script=script))
    assert "no '#SBATCH --open-mode=append'" in warning
    assert warnings_for(FakeSlurm(script=script, job_file_append="1")) == []


@pytest.mark.parametrize("directory, why", [
    ("/tmp/me/ckpt", "it is under /tmp"),
    ("/dev/shm/ckpt", "it is under /dev/shm"),
    ("/local/job42/ckpt", "it is under the job's temporary dir /local/job42"),
    ("/scratch/ram/ckpt", "it is on a tmpfs (memory) filesystem"),
])
def test_warns_about_node_local_checkpoint_dirs(directory: str, why: str):
    (warning,) = warnings_for(FakeSlurm(script=GOOD_SCRIPT), directory,
                              SLURM_TMPDIR="/local/job42")
    assert f"the checkpoint dir {directory} looks node-local ({why})" in warning


def test_warns_when_the_job_cannot_be_requeued_or_scontrol_is_missing():
    fake = FakeSlurm(record_line(requeue="0"), script=GOOD_SCRIPT)
    (warning,) = warnings_for(fake)
    assert warning.startswith("Slurm job 42 cannot be requeued (Requeue=0")
    (warning,) = warnings_for(FakeSlurm(tools=()))
    assert warning.startswith("scontrol not found (inside a container?)")


def test_node_local_reason_for_a_shared_dir_is_none():
    env = slurm_env({"SLURM_JOB_ID": "1", "TMPDIR": "/"})
    assert env is not None
    assert node_local_reason(Path("/home/me/ckpt"), env, SHARED_MOUNTS) is None


def test_sbatch_directives_stop_at_the_first_command():
    script = ("#!/bin/bash\n#SBATCH -t 1 -J 'my job'\n\n# a comment\n#SBATCH --mem=4G\n"
              "echo hi\n#SBATCH --ignored\n")
    assert sbatch_directives(script) == [["-t", "1", "-J", "my job"], ["--mem=4G"]]


# -- a lost node ------------------------------------------------------------------------------

@pytest.fixture
def slurmd_port():
    """A port where "slurmd" listens on 127.0.0.1 alone: 127.0.0.2 is a node whose slurmd is
    gone (connection refused), as a dead node's address is."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def nodes_fake(port: int, **nodes: tuple[str, str]) -> FakeSlurm:
    fake = FakeSlurm()
    fake.nodes, fake.slurmd_port = dict(nodes), port
    return fake


def test_a_node_slurm_calls_down_or_whose_slurmd_is_gone_is_lost(slurmd_port: int):
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1"}
    fake = nodes_fake(slurmd_port, n1=("127.0.0.1", "MIXED"), n2=("127.0.0.2", "MIXED"),
                      n3=("127.0.0.1", "DOWN+NOT_RESPONDING"))
    lost = lost_nodes(make_job(fake, **env))
    assert [n.name for n in lost] == ["n2", "n3"]
    assert "Connection refused" in lost[0].why and f"127.0.0.2:{slurmd_port}" in lost[0].why
    assert lost[1].why == "Slurm says DOWN+NOT_RESPONDING"
    # Every node there: nothing lost (the failure is the script's own).
    fake = nodes_fake(slurmd_port, n1=("127.0.0.1", "MIXED"), n2=("127.0.0.1", "MIXED*"))
    assert [n.name for n in lost_nodes(make_job(fake, **env))] == ["n2"]  # * = not responding
    fake = nodes_fake(slurmd_port, n1=("127.0.0.1", "MIXED"), n2=("127.0.0.1", "ALLOCATED"))
    assert lost_nodes(make_job(fake, **env)) == []


def test_knocks_count_only_when_this_nodes_own_slurmd_answers(slurmd_port: int):
    # This node's slurmd cannot be reached either (a container without the host's network, a
    # firewall): a refused knock on another node says nothing. Slurm's own view still counts.
    fake = nodes_fake(slurmd_port, n1=("127.0.0.3", "MIXED"), n2=("127.0.0.2", "MIXED"),
                      n3=("127.0.0.2", "DOWN"))
    job = make_job(fake, SLURM_JOB_NODELIST="n[1-3]", SLURMD_NODENAME="n1")
    assert [n.name for n in lost_nodes(job)] == ["n3"]
    # One node: the launcher's own, so alive; nothing is asked.
    fake = nodes_fake(slurmd_port, n1=("127.0.0.1", "MIXED"))
    assert lost_nodes(make_job(fake, SLURM_JOB_NODELIST="n1", SLURMD_NODENAME="n1")) == []
    assert fake.calls == []


def test_a_lost_node_requeues_the_job_within_the_budget(slurmd_port: int):
    fake = nodes_fake(slurmd_port, n1=("127.0.0.1", "MIXED"), n2=("127.0.0.2", "MIXED"))
    policy = policy_for(fake, SLURM_JOB_NODELIST="n[1-2]", SLURMD_NODENAME="n1",
                        SLURM_RESTART_COUNT="1")
    lost = policy.lost_nodes()
    verdict = policy.after_node_loss(lost, 1)
    assert verdict.decision is Decision.REQUEUED and fake.requeues() == [["scontrol", "requeue",
                                                                           "42"]]
    assert verdict.message.startswith("requeued Slurm job 42 (it lost node n2 (its slurmd at "
                                      "127.0.0.2:"), verdict.message
    verdict = policy_for(fake, max_restarts=1, SLURM_JOB_NODELIST="n[1-2]").after_node_loss(
        lost, 1)
    assert verdict.decision is Decision.BUDGET_EXHAUSTED and "it lost node n2" in verdict.message
