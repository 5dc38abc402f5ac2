"""The first cycle's command of the CRIU engine, where the launcher may make PID namespaces:
``python -I -S nsinit.py ROOT_PID_FILE COMMAND...``, started behind the keeper like any
command.

    keeper -> this process (the host's pids)
                -> init: pid 1 of a new PID namespace, a session of its own
                     -> COMMAND: pid 2, a process group of its own (its workers join it)

An image of init's tree holds pids that only exist inside its namespace, so a restore gets
them back on any node, whatever runs there (``criu restore`` makes a new namespace for it).
CRIU images such a tree only when its session is led from inside, hence init's own session;
the signals the launcher sends to the keeper's process group reach this process, which
passes them to init, which passes them to COMMAND's group, as they reached it without the
namespace. Init reaps what is orphaned in the namespace and exits as COMMAND did: its code, or
128+N for signal N (pid 1 cannot die of its own signal), which this process turns back into
the signal. What COMMAND left running ends with init (the kernel kills the namespace), named
in one line first. This process writes init's pid (the host's) to ROOT_PID_FILE: the root of the
images.

Where the namespace cannot be made (no CAP_SYS_ADMIN), COMMAND is exec'd in place, with the
host's pids, as without this script. Stdlib only: it starts in milliseconds and never imports
torch. Inside the namespace ``os.getpid()`` is the namespace's pid while /proc stays the
host's, so a script that reads ``/proc/<its pid>`` reads another process there
(docs/engines.md; ``PROCCKPT_CRIU_PID_NAMESPACE=0`` runs without the namespace).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
from typing import Any

_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
#: The signals passed on (those the launcher sends to the command's process group).
_PASSED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGALRM",
           "SIGXCPU", "SIGCONT")


def main(argv: list[str]) -> int:
    pid_file, *command = argv
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWPID) != 0:
        os.execvp(command[0], command)  # no namespace here: the host's pids, as without it
    init = os.fork()
    if init == 0:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # gone with this process
        os._exit(_init(command))
    _pass_signals_to(init)
    tmp = f"{pid_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(init))
    os.replace(tmp, pid_file)
    while True:
        try:
            _, status = os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return _die_of(os.WTERMSIG(status))
    code = os.waitstatus_to_exitcode(status)
    return _die_of(code - 128) if 128 < code < 128 + signal.NSIG else code


def _init(command: list[str]) -> int:
    """Pid 1 of the namespace: COMMAND as pid 2, signals passed to its group, orphans reaped;
    COMMAND's exit code, or 128+N for signal N."""
    os.setsid()
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)
        for name in (*_PASSED, "SIGPIPE", "SIGXFSZ"):  # as the keeper gives them: the defaults
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        except OSError as e:
            print(f"procckpt: cannot run {command[0]}: {e.strerror}", file=sys.stderr,
                  flush=True)
            os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    _pass_signals_to(-child)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return 0
        if pid == child:
            _say_left_behind()
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.waitstatus_to_exitcode(status)


def _say_left_behind() -> None:
    """Name what the command left running (a daemon of its own), which ends with this init,
    as the keeper names what a command left without a namespace. /proc is the host's here:
    the processes are found by this init's host pid, and named by theirs."""
    try:
        with open("/proc/self/status") as f:
            me = next(int(line.split()[1]) for line in f if line.startswith("NSpid:"))
        with open(f"/proc/{me}/task/{me}/children") as f:
            left = [int(pid) for pid in f.read().split()]
    except (OSError, StopIteration, ValueError):
        return
    said = _keeper()["left_behind"](left)
    if said is not None:
        print(said, file=sys.stderr, flush=True)


def _keeper() -> dict[str, Any]:
    """keeper.py's names, two folders up (this script runs isolated: ``-I``, nothing on its
    path)."""
    return runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "keeper.py"))


def _pass_signals_to(target: int) -> None:
    """Each of _PASSED, when it comes, to ``target`` (a pid; a negative one: a group)."""
    def passed(signum: int, _frame: object) -> None:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass

    for name in _PASSED:
        signal.signal(getattr(signal, name), passed)


def _die_of(signum: int) -> int:
    """End this process by ``signum`` as the command ended (its exit status, for the keeper)."""
    return int(_keeper()["die_of"](signum))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
