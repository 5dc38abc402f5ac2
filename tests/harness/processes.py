"""Helpers of the end-to-end tests that drive ``procckpt run`` and the training programs as
real processes: start one and read its output as it comes, read a run's journal, run the
tiny program alone for the uninterrupted reference, and check a one-line error."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from procckpt.protocol.control import read_json
from procckpt.protocol.events import read_events

from ..conftest import PROGRAMS, PYTHON, procckpt_argv, run
from . import shared

TINY = [PYTHON, str(PROGRAMS / "tiny_train.py")]
LOADER = [PYTHON, str(PROGRAMS / "loader_train.py")]
ASYNC = [PYTHON, str(PROGRAMS / "async_train.py")]

#: Root with the capabilities that bypass file permissions dropped (util-linux's setpriv).
NO_DAC = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="dropping root's file-permission capabilities needs root and util-linux's setpriv")


def events(directory: Path, kind: str | None = None) -> list[dict]:
    """The journal of checkpoint dir ``directory``, or its events of one kind."""
    return [e for e in read_events(directory / "events.jsonl")
            if kind is None or e.get("event") == kind]


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """``procckpt run ARGS`` in the background, its output in pipes, unbuffered."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*procckpt_argv(), "run", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(what: str, check: Callable[[], object], timeout: float = 60.0,
             proc: subprocess.Popen[str] | None = None) -> object:
    """``check()``'s first true value, asked every 20 ms for up to ``timeout`` seconds;
    fails naming ``what``, at once if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the program exited ({proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_line(proc: subprocess.Popen[str], text: str, timeout: float = 60) -> str:
    """Read ``proc``'s standard output up to the first line holding ``text``."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if text in line:
            return line
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s"
    tail = proc.stderr.read()[-2000:] if proc.stderr is not None else ""
    raise AssertionError(f"the output ended before {text!r}: {tail}")


def stopped_once(args: list[str], cwd: Path, ready: Callable[[], bool],
                 env: dict[str, str] | None = None,
                 timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``procckpt run ARGS`` (no restarts) sent SIGUSR1, checkpoint then stop, as `procckpt
    sbatch` has Slurm send it before a time limit, once ``ready()``; its output in files."""
    out, err = cwd / "stopped.out", cwd / "stopped.err"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("PROCCKPT_TOKEN", None)
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([*procckpt_argv(), "run", "--max-restarts", "0", *args],
                                cwd=cwd, env=full_env, text=True, stdout=stdout, stderr=stderr)
        try:
            deadline = time.monotonic() + timeout
            while not ready():
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, f"not ready within {timeout}s"
                time.sleep(0.1)
            proc.send_signal(signal.SIGUSR1)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(),
                                       err.read_text())


def heartbeat_step(ckpt: Path, since: float = 0.0) -> int | None:
    """The step the training of checkpoint dir ``ckpt`` last told its launcher of (rank 0's
    heartbeat, about every second), if it did so after ``since`` (wall-clock)."""
    beat = read_json(ckpt / "control", "heartbeat.json") or {}
    try:
        return int(beat["step"]) if float(beat["time"]) >= since else None
    except (KeyError, TypeError, ValueError):
        return None


def cycles_stopped_at(args: list[str], cwd: Path, local: Path, steps: list[int],
                      env: dict[str, str] | None = None, timeout: float = 600,
                      ) -> list[subprocess.CompletedProcess[str]]:
    """``procckpt run ARGS`` (ARGS with its ``--dir``) run again after each stop, as a job
    requeued after its time limit: the n-th run is sent SIGUSR1 (checkpoint, then stop) once
    its training has reached step ``steps[n]`` (the heartbeat in ``local``, the run's local
    dir), the last one trains to the end. A stop waits for the training to step, so a slow
    start (two ranks importing a framework on a loaded machine) makes a cycle longer, never
    one without a checkpoint. Each stopped run must exit 75, the last one 0."""
    results = []
    for step in steps:
        started = time.time()
        res = stopped_once(args, cwd, lambda step=step, started=started:
                           (heartbeat_step(local, started) or -1) >= step,
                           env=env, timeout=timeout)
        assert res.returncode == 75, res.stderr[-4000:]
        results.append(res)
    res = run([*procckpt_argv(), "run", *args], cwd=cwd, env=env, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return [*results, res]


def joined(runs: list[subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    """The runs of :func:`cycles_stopped_at` as one: their outputs in order, the last code."""
    return subprocess.CompletedProcess(runs[-1].args, runs[-1].returncode,
                                       "".join(r.stdout for r in runs),
                                       "".join(r.stderr for r in runs))


def reference(*args: str) -> Path:
    """The uninterrupted run's weights: the tiny program alone, no launcher; made once a
    session for these arguments (shared.py)."""
    def make(where: Path) -> Path:
        out = where / "reference.pt"
        res = run([*TINY, *args, "--ckpt-dir", str(where / "ref-ckpt"), "--out", str(out)],
                  cwd=where)
        assert res.returncode == 0, res.stderr[-3000:]
        return out

    return shared.once(["tiny", *args], make)


def alone(workdir: Path, ckpt: Path, *args: str, prefix: list[str] | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The tiny training script run on its own (no launcher) on checkpoint dir ``ckpt``."""
    return run([*(prefix or []), *TINY, "--ckpt-dir", str(ckpt), *args], cwd=workdir,
               env=env)


def procckpt_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("procckpt")]


def one_error_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The one ``error:`` line of a command that exited with ``code``, holding ``needles``."""
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def fill(directory: Path, leave: int = 0) -> None:
    """Write zeros into ``directory`` until its file system is full, then give ``leave``
    bytes back."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
        os.close(fd)
