"""The supervised command: started in its own session behind a keeper (keeper.py), signalled
as a process group."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from ..errors import CommandNotFoundError

__all__ = ["Child", "die_with_parent", "exit_code_of", "start_behind_keeper"]

logger = logging.getLogger(__name__)

#: Walking the process table costs a few milliseconds; the idle launcher does it this seldom.
_MEMBERS_EVERY = 5.0
_PR_SET_PDEATHSIG = 1
#: Started in front of the command; see keeper.py.
_KEEPER = str(Path(__file__).with_name("keeper.py"))


def _find_prctl() -> Callable[..., int] | None:
    # Looked up once, here: the function runs between fork and exec, where it should do as
    # little as possible.
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None  # not Linux: no such guard


_prctl = _find_prctl()


def die_with_parent() -> None:
    """In a helper process the launcher starts (DMTCP's coordinator), or in the run that
    ``procckpt check`` starts, before exec: if its parent is killed outright (SIGKILL, the OOM
    killer), it is killed too. The command itself has the keeper for this, which also reaches
    the processes it starts."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_behind_keeper(argv: Sequence[str], env: Mapping[str, str],
                        popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
                        pass_fds: Sequence[int] = (), cwd: str | None = None,
                        ) -> tuple[subprocess.Popen[Any], int]:
    """Start ``argv`` behind a keeper; the keeper's process and the write end of its
    lifeline, which the caller holds alone and closes once the keeper exited.

    A new session: the command and everything it starts form one process group that can be
    signalled as a whole, and the terminal's Ctrl-C reaches only the launcher, which decides
    what to do with it. The keeper (keeper.py) leads that session and kills everything below
    it if the launcher dies: the read end of the lifeline is its only way to notice, since
    the write end lives in the launcher alone. ``pass_fds`` reach the command too."""
    lifeline_r, lifeline_w = os.pipe()
    try:
        process = popen([sys.executable, "-I", "-S", _KEEPER, str(lifeline_r), "--", *argv],
                        env=dict(env), cwd=cwd, start_new_session=True,
                        pass_fds=(lifeline_r, *pass_fds))
    except BaseException:
        os.close(lifeline_w)
        raise
    finally:
        os.close(lifeline_r)
    return process, lifeline_w


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class Child:
    """One run of the command. ``popen`` is a seam for unit tests."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str],
                 popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen) -> None:
        if not argv:
            raise CommandNotFoundError("no command given: put it after --, e.g. "
                                       "procckpt run -- python train.py")
        self.argv = list(argv)
        self.env = dict(env)
        self._popen_factory = popen
        self._popen: subprocess.Popen[Any] | None = None
        self._lifeline: int | None = None
        self._members: set[psutil.Process] = set()
        self._members_seen_at = float("-inf")
        #: Whether procckpt sent the running command a signal (forwarded, SIGTERM, SIGKILL):
        #: its exit code 0 is then no proof that it finished by itself.
        self.signalled = False

    @property
    def pid(self) -> int:
        assert self._popen is not None
        return self._popen.pid

    def start(self) -> None:
        exe = self.argv[0]
        resolved = shutil.which(exe, path=self.env.get("PATH")) if "/" not in exe else exe
        if resolved is None or not os.access(resolved, os.X_OK) or os.path.isdir(resolved):
            raise CommandNotFoundError(f"command not found: {exe} (check the spelling and PATH)")
        self._popen, self._lifeline = start_behind_keeper(self.argv, self.env,
                                                          self._popen_factory)

    def poll(self) -> int | None:
        """The exit code once the command has exited (128+N if killed by signal N)."""
        assert self._popen is not None
        if time.monotonic() - self._members_seen_at >= _MEMBERS_EVERY:
            self._remember_members()
        rc = self._popen.poll()
        if rc is None:
            return None
        self._close_lifeline()
        return exit_code_of(rc)

    def wait(self, timeout: float) -> int | None:
        assert self._popen is not None
        try:
            rc = self._popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        self._close_lifeline()
        return exit_code_of(rc)

    def _close_lifeline(self) -> None:
        """Once the keeper exited (or never started), the pipe has no more use."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command's whole process group."""
        assert self._popen is not None
        if self._popen.poll() is None:
            self.signalled = True
        try:
            os.killpg(self._popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> int | None:
        """SIGTERM the group, wait at most ``term_timeout``, then SIGKILL everything left,
        including descendants that moved to a session of their own. Every wait is bounded:
        a process stuck in the kernel ignores even SIGKILL."""
        assert self._popen is not None
        self._remember_members()
        if self._popen.poll() is None:
            self.signal(signal.SIGTERM)
            rc = self.wait(term_timeout)
            if rc is None:
                logger.warning("the command did not exit %.0fs after SIGTERM; sending SIGKILL",
                               term_timeout)
        self.kill_leftovers(kill_timeout)
        rc = self.wait(kill_timeout)
        if rc is None:
            logger.error("the command (pid %d) survived SIGKILL; giving up on it", self.pid)
        return rc

    def kill_leftovers(self, timeout: float = 5.0) -> None:
        """SIGKILL every process of the group and every known descendant still alive."""
        assert self._popen is not None
        self._remember_members()
        self.signal(signal.SIGKILL)
        alive = [p for p in self._members if _alive(p)]
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=timeout)

    def _remember_members(self) -> None:
        """Note the command's descendants while it lives, so that processes that left the
        group (torchrun workers, daemons) can still be cleaned up after it exits."""
        assert self._popen is not None
        self._members_seen_at = time.monotonic()
        try:
            root = psutil.Process(self._popen.pid)
            self._members.update(root.children(recursive=True))
        except psutil.Error:
            pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
