"""The runs of ``procckpt check``: the command under ``procckpt run``, one at a time, each in a
session of its own, its progress said on stderr, all of it stopped on a signal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ProcckptError, UsageError
from ..launcher.child import die_with_parent
from ..launcher.hang import descendants, stat_fields
from ..protocol.control import ENV_CHECK

__all__ = ["Run", "Runner", "CheckInterrupted", "Signalled", "signals_raise", "signals_held",
           "last_step"]

#: A run may take this long from its first step to its end ...
RUN_TIMEOUT = 900.0
#: ... and this long before it (imports, data, the model: minutes on a loaded node).
STARTUP_TIMEOUT = 1800.0
#: How often a run is looked at while it runs.
POLL = 0.2
#: Signals that end the check: its runs are stopped and its files removed first.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class CheckInterrupted(ProcckptError):
    """The check was stopped by a signal (after stopping its runs and removing its dir)."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"check stopped by {name}: its runs were stopped and their files "
                         "removed")
        self.exit_code = 128 + signum


@dataclass
class Run:
    """One run of the command in its own checkpoint dir (C runs twice there)."""

    name: str
    dir: Path
    codes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    _parsed: tuple[int, dict[int, list[dict[str, Any]]]] | None = field(
        default=None, init=False, repr=False, compare=False)

    @property
    def log(self) -> Path:
        return self.dir.parent / f"{self.name}.log"

    def where(self) -> dict[int, tuple[int, int]]:
        """step -> (epoch, batch) after it, from rank 0's trace: the steps after which a
        checkpoint can be taken."""
        return {int(e["step"]): (int(e["epoch"]), int(e["batch"]))
                for e in self._entries().get(0, []) if e.get("saves", True)}

    def epoch_of(self, step: int) -> int | None:
        """The epoch rank 0 was in after ``step`` (None if it recorded no such step)."""
        return next((int(e["epoch"]) for e in self._entries().get(0, [])
                     if int(e["step"]) == step), None)

    def unsaved(self) -> str:
        """What the script holds that no checkpoint does, as rank 0's trace describes it."""
        entries = self._entries().get(0, [])  # the last step's: held tensors settle at the 2nd
        return str(entries[-1].get("unsaved", "")) if entries else ""

    def warnings(self) -> list[str]:
        """What procckpt warned of in the script's processes, every rank, first ones first."""
        said: dict[str, None] = {}
        for path in sorted(self.dir.parent.glob(f"{self.name}.trace-warnings.*")):
            said.update(dict.fromkeys(line for line in path.read_text(
                errors="replace").splitlines() if line.strip()))
        return list(said)

    def traces(self) -> dict[int, dict[int, dict[str, int]]]:
        """rank -> step -> part -> CRC, as the training recorded them (a step recorded twice,
        by the stopped and the resumed process, keeps the later line)."""
        return {rank: {int(e["step"]): e["parts"] for e in entries}
                for rank, entries in self._entries().items()}

    def entries(self, rank: int, step: int) -> dict[str, dict[str, int]]:
        """part -> state-dict key -> CRC after ``step`` on ``rank`` (training/fingerprints.py);
        empty where the trace has none."""
        lines = [e for e in self._entries().get(rank, []) if int(e["step"]) == step]
        return dict(lines[-1].get("entries") or {}) if lines else {}

    def _entries(self) -> dict[int, list[dict[str, Any]]]:
        """Each rank's trace lines, parsed once for each size of the trace files (they grow
        while the run runs; the comparison reads them many times after)."""
        paths = sorted(self.dir.parent.glob(f"{self.name}.trace.*"))
        size = sum(p.stat().st_size for p in paths)
        if self._parsed is None or self._parsed[0] != size:
            self._parsed = (size, {int(p.name.rsplit(".", 1)[1]):
                                   [json.loads(line) for line in p.read_text().splitlines()]
                                   for p in paths})
        return self._parsed[1]


class Runner:
    """Runs the command under ``procckpt run``, one run at a time, each in a session of its
    own, and says on stderr how each went; :meth:`stop` ends the one running, with every
    process below it."""

    def __init__(self, work: Path, command: list[str]) -> None:
        self.work, self.command = work, command
        self.done = 0
        self.total: int | None = None  # known once the first run showed the epochs
        self._unsaid: list[tuple[int, str]] = []  # (run number, how it went) until then
        self._running: subprocess.Popen[bytes] | None = None

    def run(self, name: str, end: int, stop_at: int | None, what: str,
            again: Run | None = None) -> Run:
        run = again or Run(name, self.work / name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               ENV_CHECK: json.dumps({"end": end, "stop_at": stop_at,
                                      "trace": str(self.work / f"{name}.trace")})}
        for variable in ("PROCCKPT_TOKEN", "PROCCKPT_DIR", "PROCCKPT_FORCE"):
            env.pop(variable, None)
        argv = [sys.executable, "-m", "procckpt", "run", "--dir", str(run.dir), "--engine",
                "hooks", "--interval", "off", "--hang-timeout", "off", "--keep", "2",
                "--no-warm-restarts", "--",  # (each run is a launch of its own: none restarts)
                *self.command]
        before = _trace_size(run)
        started = time.monotonic()
        first_step: float | None = None
        with open(run.log, "a") as log:
            # A check killed outright takes its run along: the launcher dies with it, and
            # its keeper then kills the training.
            self._running = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=log, env=env, start_new_session=True,
                                             preexec_fn=die_with_parent)
            while (code := self._running.poll()) is None:
                time.sleep(POLL)
                now = time.monotonic()
                if first_step is None and _trace_size(run) > before:
                    first_step = now
                if first_step is None and now - started > STARTUP_TIMEOUT:
                    self.stop()
                    raise UsageError(
                        f"run {self.done + 1} of the command reached no step in "
                        f"{STARTUP_TIMEOUT:.0f}s: its start-up (imports, data, model) took "
                        f"all of it, which no --steps can shorten (see {run.log})")
                if first_step is not None and now - first_step > RUN_TIMEOUT:
                    self.stop()
                    raise UsageError(f"run {self.done + 1} of the command took over "
                                     f"{RUN_TIMEOUT:.0f}s after its first step: give fewer "
                                     f"--steps (see {run.log})")
        self._running = None
        run.codes.append(code)
        run.seconds += time.monotonic() - started
        self.done += 1
        if code not in (0, 75):
            raise UsageError(f"the command failed with exit code {code}: "
                             f"{_last_words(run.log)} (procckpt check --keep keeps its output)")
        if not run.traces():
            raise UsageError("the command reached no safe point of procckpt.Checkpointer: "
                             "check needs a script that uses it (ckpt.epochs(), batches() or "
                             "steps())")
        startup = (first_step if first_step is not None else time.monotonic()) - started
        self._unsaid.append((self.done, f"({what}): step {last_step(run)}/{end} in "
                             f"{time.monotonic() - started:.1f}s, {startup:.1f}s of it before "
                             "the first step"))
        if self.total is not None:
            self._say()
        return run

    def expect(self, total: int) -> None:
        """How many runs the check makes in all (known once the first showed the epochs)."""
        self.total = total
        self._say()

    def _say(self) -> None:
        for number, line in self._unsaid:
            print(f"procckpt check: run {number} of {self.total} {line}", file=sys.stderr,
                  flush=True)
        self._unsaid = []

    def stop(self) -> None:
        """Kill the run in progress: the launcher and every process below it (found before
        the launcher goes, since its orphans would then move elsewhere), and wait for them."""
        proc, self._running = self._running, None
        if proc is None or proc.poll() is not None:
            return
        below = descendants(proc.pid)
        for pid in (proc.pid, *below):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        until = time.monotonic() + 10
        while time.monotonic() < until and any(_alive(pid) for pid in below):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is still a running (not a zombie) process."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _trace_size(run: Run) -> int:
    """Bytes of the run's traces so far: they grow at each step."""
    return sum(p.stat().st_size for p in run.dir.parent.glob(f"{run.name}.trace.*"))


def _last_words(log: Path) -> str:
    """The command's own last line of output (not the launcher's)."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if line.strip() and not line.startswith("procckpt:")]
    return lines[-1].strip()[:200] if lines else "no output"


def last_step(run: Run) -> int:
    return max(run.traces().get(0, {0: {}}))


class Signalled(BaseException):
    """Raised by the check's signal handlers (a BaseException: no `except Exception` in
    between takes it for an error of the run)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise(signum: int, _frame: object) -> None:
    raise Signalled(signum)


def signals_raise() -> contextlib.AbstractContextManager[None]:
    """SIGTERM, SIGINT and SIGHUP end the check (its runs are in sessions of their own, so a
    Ctrl-C reaches the check alone, which stops them)."""
    return _stop_signals_handled_by(_raise)


def signals_held() -> contextlib.AbstractContextManager[None]:
    """Those signals ignored: a second Ctrl-C must not leave the runs or the dir behind."""
    return _stop_signals_handled_by(signal.SIG_IGN)


@contextlib.contextmanager
def _stop_signals_handled_by(handler: Any) -> Iterator[None]:
    before = {signum: signal.signal(signum, handler) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in before.items():
            signal.signal(signum, old)
