"""The keeper: a small process between ``procckpt run`` and the command that dies with nothing.

    procckpt run  ->  keeper (a subreaper; leader of the command's session)  ->  the command

A command that is a shell (``sh -c 'python train.py'``), torchrun or a data loader starts
processes of its own. If the launcher is killed outright (SIGKILL, the OOM killer), a
parent-death signal reaches only its direct child; everything below would live on, orphaned,
and go on training and writing into a checkpoint dir whose lock nobody holds. The keeper
closes that gap:

- it is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``), so every process the command starts,
  even one that double-forks or calls ``setsid``, stays below it instead of moving to init;
- it holds the read end of a pipe whose write end only the launcher has: when the launcher
  dies, however it dies, the pipe reads end-of-file and the keeper SIGKILLs every process
  below it, then exits;
- the command itself dies with the keeper (a parent-death signal): a keeper killed outright,
  by hand or before it read its lifeline's end, leaves no training running unwatched into a
  store that the launcher's next cycle writes too;
- otherwise it waits: it takes no part in the launcher's signals to the process group
  (SIGTERM, SIGINT, ... are the command's business), reaps what is orphaned below it, and when
  the command exits it kills what the command left behind and exits the same way (the same
  code, or the same signal), so the launcher sees the command's own exit status.

Run as ``python keeper.py FD -- COMMAND...``; it imports nothing but the standard library, so
that it starts in milliseconds and never imports torch.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: Signals the launcher sends to the whole process group: the command acts on them, the
#: keeper does not (it exits when the command does).
_IGNORED_BY_KEEPER = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT",
                      "SIGALRM", "SIGPIPE", "SIGXCPU")


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, from /proc (children of all threads)."""
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def _say_left_behind() -> None:
    """Name the processes the command left running (a daemon, a server it started), which
    are killed next: a run must not end with work silently cut short."""
    said = left_behind(descendants(os.getpid()))
    if said is not None:
        try:
            os.write(2, f"{said}\n".encode())
        except OSError:
            pass


def left_behind(pids: list[int]) -> str | None:
    """The line that names the processes ``pids`` (the host's) the command left running;
    None for none. (Also the CRIU engine's nsinit.py, for what it ends with its namespace.)"""
    if not pids:
        return None
    named = []
    for pid in pids[:5]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        named.append(f"pid {pid} ({command[:80] or '?'})")
    more = f" and {len(pids) - 5} more" if len(pids) > 5 else ""
    return (f"procckpt: the command exited and left {len(pids)} process"
            f"{'es' if len(pids) > 1 else ''} running, killed now: {', '.join(named)}{more}")


def _kill_all_below() -> None:
    """SIGKILL every process below the keeper until none is left, reaping as they die."""
    me = os.getpid()
    for _ in range(100):
        below = descendants(me)
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(block_for=0.05)


def _reap(block_for: float = 0.0) -> list[tuple[int, int]]:
    """Reap exited children (orphans re-parented here included); return (pid, status)."""
    reaped = []
    if block_for:
        select.select([], [], [], block_for)
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reaped.append((pid, status))
    return reaped


def _exit_like(status: int) -> None:
    """End the keeper the way the command ended: its exit code, or its signal."""
    if os.WIFSIGNALED(status):
        os._exit(die_of(os.WTERMSIG(status)))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def die_of(signum: int) -> int:
    """End this process by ``signum``, as the process it stands in for ended: the signal's
    default action, with no core of this process's own. Returns 128+``signum`` for a signal
    whose default action does not end a process (the caller exits with it). The CRIU
    engine's nsinit.py and restore.py end so too, loading this file by path."""
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        except (OSError, ValueError):
            pass
    os.kill(os.getpid(), signum)
    return 128 + signum


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: keeper.py FD -- COMMAND [ARGS...]\n")
        os._exit(2)
    lifeline = int(argv[0])
    command = argv[2:]
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    os.set_blocking(lifeline, False)
    wakeup_r, wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for name in _IGNORED_BY_KEEPER:
        # A handler, not SIG_IGN: the command inherits ignored signals across exec, and a
        # handled one is reset to the default there.
        signal.signal(getattr(signal, name), lambda *_: None)
    keeper = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:
        sys.stderr.write(f"procckpt: cannot start {command[0]}: {e.strerror}\n")
        os._exit(126)
    if pid == 0:  # the command: default signal handling, no keeper fds
        # Killed with the keeper: a keeper killed outright (SIGKILL by hand, or before it saw
        # its lifeline end) must not leave the command training on, unwatched, into a store
        # whose next run the launcher starts. (Checked again: it may have died before this.)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != keeper:
            os._exit(137)
        try:
            for name in (*_IGNORED_BY_KEEPER, "SIGCHLD"):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            os.close(lifeline)
            os.execvp(command[0], command)
        except OSError as e:
            sys.stderr.write(f"procckpt: cannot run {command[0]}: {e.strerror}\n")
            os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    # The launcher may have died between starting the keeper and this point. (Its pid says
    # nothing: as a container's entrypoint it is PID 1 itself.)
    if not _lifeline_open(lifeline):
        _kill_all_below()
        os._exit(137)
    while True:
        ready, _, _ = select.select([lifeline, wakeup_r], [], [])
        if lifeline in ready and not _lifeline_open(lifeline):
            _kill_all_below()  # the launcher is gone: nothing of the command may outlive it
            os._exit(137)
        if wakeup_r in ready:
            try:
                os.read(wakeup_r, 4096)
            except BlockingIOError:
                pass
        for reaped, status in _reap():
            if reaped == pid:
                _say_left_behind()
                _kill_all_below()  # what the command left behind, as procckpt always did
                _exit_like(status)


def _lifeline_open(fd: int) -> bool:
    """False once the launcher's end of the pipe is closed (it exited or was killed)."""
    try:
        return os.read(fd, 1) != b""
    except BlockingIOError:
        return True


if __name__ == "__main__":
    main(sys.argv[1:])
