"""launcher/keeper.py with real processes: nothing of the command outlives the launcher or the
keeper itself, however either of them dies."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from procckpt.launcher.child import start_behind_keeper

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


@pytest.fixture
def keeper() -> Iterator[tuple[subprocess.Popen[Any], int]]:
    """The keeper in front of `sleep 600`, as the launcher starts it: the keeper and the
    write end of its lifeline."""
    proc, write = start_behind_keeper(["sleep", "600"], os.environ)
    try:
        yield proc, write
    finally:
        with_children = [proc.pid, *(p.pid for p in _below(proc.pid))]
        for pid in with_children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
        try:
            os.close(write)
        except OSError:
            pass


def _below(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _command(keeper_pid: int) -> psutil.Process:
    deadline = time.monotonic() + 30
    while True:
        found = [p for p in _below(keeper_pid) if "sleep" in " ".join(p.cmdline())]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.02)


def _gone(process: psutil.Process, within: float = 10.0) -> bool:
    """Whether ``process`` ended (a zombie counts: an orphan waits for whatever PID 1 is)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_the_command_dies_when_the_launchers_lifeline_ends(keeper):
    proc, write = keeper
    command = _command(proc.pid)
    os.close(write)  # what a launcher's death does, however it dies
    assert proc.wait(timeout=10) == 137
    assert _gone(command)


def test_a_keeper_killed_outright_takes_the_command_along(keeper):
    """SIGKILL of the keeper alone (by hand, or a launcher and its keeper killed together
    before the keeper read its lifeline's end): the training went on, orphaned, and wrote
    its checkpoints into the store that the next run was resuming from."""
    proc, _ = keeper
    command = _command(proc.pid)
    proc.kill()
    proc.wait(timeout=10)
    assert _gone(command), "the command outlived its keeper"
