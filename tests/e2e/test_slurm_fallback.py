"""procckpt run in a Slurm job where no Slurm command can be run (inside a container): it takes
the end time from PROCCKPT_SLURM_END_TIME, checkpoints before it and exits with 75 for the job
script outside to requeue. Real processes and signals; no cluster needed, so this part of the
Slurm support is checked on machines without root too. About 30 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from procckpt.protocol.events import read_events

from ..conftest import PROGRAMS, PYTHON

TINY = [PYTHON, str(PROGRAMS / "tiny_train.py")]


def start_in_fake_job(workdir: Path, end_in: float, args: list[str]) -> subprocess.Popen[str]:
    """procckpt run with a Slurm job's environment and a PATH without any Slurm command."""
    empty = workdir / "no-slurm-here"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PROCCKPT_"))}
    env.update({"PATH": str(empty), "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2",
                "PROCCKPT_SLURM_END_TIME": str(time.time() + end_in), "PYTHONUNBUFFERED": "1"})
    return subprocess.Popen([PYTHON, "-m", "procckpt", "run", "--dir", "ckpt", *args, "--",
                             *TINY, "--epochs", "100", "--step-sleep", "0.2"],
                            cwd=workdir, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_without_scontrol_it_checkpoints_before_the_end_time_and_exits_75(workdir: Path):
    proc = start_in_fake_job(workdir, end_in=20, args=["--grace", "8s"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "procckpt: scontrol not found (inside a container?): procckpt cannot requeue " \
           "Slurm job 4242" in err
    assert ("Slurm job 4242 stopped (its time limit is near) but scontrol is not available "
            "here (inside a container?), so procckpt cannot requeue it; exiting with 75") in err
    events = list(read_events(workdir / "ckpt" / "events.jsonl"))
    trigger = [e for e in events if e["event"] == "trigger"]
    assert [e["reason"] for e in trigger] == ["deadline"]
    assert events[0]["event"] == "start" and events[0]["restart"] == 2  # SLURM_RESTART_COUNT
    # Asked for at end - grace, i.e. about 12 s after the start (python and torch take 2-4 s
    # to start here, so the bound is loose on the early side only by the start-up).
    started = events[0]["time"]
    assert 8 <= trigger[0]["time"] - started <= 14, trigger[0]["time"] - started
    assert "start step 0" in out


def test_sigterm_with_the_end_far_away_is_a_cancel(workdir: Path):
    proc = start_in_fake_job(workdir, end_in=3600, args=[])
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 3"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert ("Slurm job 4242 was stopped by SIGTERM with no time limit near and no preemption "
            "(scancel?): not requeued") in err
