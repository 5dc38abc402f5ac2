"""A CRIU image restored as a cycle's command: ``python -I -S restore.py CRIU IMAGES WORK
[--unprivileged] [--pid-namespace] [fd[N]:RESOURCE ...]``, started behind the keeper like any
command.

``criu restore`` on its own waits for the tree it restored but exits 0 whatever became of it,
so the launcher would take a crash for a finished run. So this process makes itself a child
subreaper and restores detached, the tree's root as its own child (``--restore-sibling``),
in its own session and process group (``--shell-job``: those of this process, the keeper's,
so that the launcher's signals to the group reach the tree as they reached the original).
Then it waits for the root and exits as the root did: the same code, or the same signal.

An image of a PID namespace (``--pid-namespace``: its root is nsinit.py's init, which leads a
session of its own) gets a new namespace from CRIU, and the signals to the keeper's group
reach this process alone: it passes them to the root, as nsinit.py did, and takes the root's
128+N for signal N.

Each ``fd[N]:RESOURCE`` hands this process's fd N to the restored processes in place of the
file or pipe they had open as RESOURCE (their stdout and stderr: a log that grew since the
image would otherwise fail the restore, and a pipe from an earlier launcher is gone). CRIU
opens a handed pipe again through /proc, which a user other than root may not do with a pipe
of another user's (a container runtime's, a wrapper's run as root): with ``--unprivileged``
such a pipe is handed over as a pipe of this process's own, which it copies into the real one.

CRIU leaves the tree stopped (``--leave-stopped``), and this process continues it once CRIU
has let go of every thread. Resumed by CRIU, a process whose first act is to exit (a
DataLoader worker imaged as its epoch ended) may end while CRIU is still letting go of its
other threads, and CRIU then fails the whole restore ("Unable to detach ...: No such
process"); stopped, nothing runs before CRIU is done. (A process that was stopped when it
was imaged is continued too.)

Stdlib only: it must start in milliseconds and never import torch. If the restore fails, it
says so in one line and exits with 75 without the root's pid file (CRIU writes it before its
last steps, which may fail): the launcher then tries the image again, then the one before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import stat
import subprocess
import sys
import threading
from typing import Any

_PR_SET_CHILD_SUBREAPER = 36
#: Exit code when CRIU could not restore the image (EX_TEMPFAIL).
RESTORE_FAILED = 75
#: Signals the launcher sends to the process group: they reach the restored tree directly.
_THE_TREES = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGALRM",
              "SIGPIPE", "SIGXCPU")


def _last_error(log: str) -> str:
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if "Error" in line and "RLIMIT_NOFILE" not in line
                 and "FAILED" not in line]
    except OSError:
        return "no log"
    return lines[0].rstrip(".") if lines else "no error logged"


def main(argv: list[str]) -> int:
    criu, images, work, *rest = argv
    namespace = "--pid-namespace" in rest
    options = [arg for arg in rest if arg.startswith("--") and arg != "--pid-namespace"]
    inherit, relays, ends = _handed(
        [arg for arg in rest if not arg.startswith("--")], "--unprivileged" in options)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for name in _THE_TREES:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    pidfile = os.path.join(work, "root.pid")
    log = "restore.log"
    args = [criu, "restore", "--restore-detached", "--restore-sibling", "--shell-job",
            "--leave-stopped", "-D", images, "-W", work, "-o", log, "--pidfile", pidfile, *options]
    fds = []
    for spec in inherit:
        args += ["--inherit-fd", spec]
        fds.append(int(spec[3:spec.index("]")]))
    done = subprocess.run(args, pass_fds=fds, preexec_fn=_default_signals)
    for end in ends:
        os.close(end)  # the tree holds them now: the relays end when it has
    if done.returncode != 0 or not os.path.exists(pidfile):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)  # (CRIU killed what it had restored)
        print(f"procckpt: criu restore of {images} failed ({_last_error(os.path.join(work, log))})",
              file=sys.stderr, flush=True)
        return RESTORE_FAILED
    with open(pidfile) as f:
        root = int(f.read())
    _continue(root)
    if namespace:
        for name in _THE_TREES:
            if name != "SIGPIPE":
                signal.signal(getattr(signal, name), lambda signum, _: _pass(root, signum))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid != root:
            continue  # an orphan of the tree, reaped
        for relay in relays:
            relay.join(timeout=5.0)  # what the root wrote last
        code = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128
        if os.WIFSIGNALED(status) or (namespace and 128 < code < 128 + signal.NSIG):
            signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else code - 128
            return int(_keeper()["die_of"](signum))
        return code


def _keeper() -> dict[str, Any]:
    """keeper.py's names, two folders up (this script runs isolated: ``-I``, nothing on its
    path)."""
    return runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "keeper.py"))


def _continue(root: int) -> None:
    """SIGCONT to every process of the tree below ``root`` (stopped, they fork nothing), the
    root last."""
    for pid in [*_keeper()["descendants"](root), root]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _pass(root: int, signum: int) -> None:
    try:
        os.kill(root, signum)
    except ProcessLookupError:
        pass


def _handed(specs: list[str], unprivileged: bool,
            ) -> tuple[list[str], list[threading.Thread], list[int]]:
    """The ``--inherit-fd`` specs to give CRIU, the relays started, and the write ends of
    their pipes (to close once the tree holds them)."""
    given: list[str] = []
    relays: list[threading.Thread] = []
    ends: list[int] = []
    for spec in specs:
        fd = int(spec[3:spec.index("]")])
        if not (unprivileged and _foreign_pipe(fd)):
            given.append(spec)
            continue
        read, write = os.pipe()
        relay = threading.Thread(target=_copy, args=(read, fd), daemon=True)
        relay.start()
        relays.append(relay)
        ends.append(write)
        given.append(f"fd[{write}]{spec[spec.index(']') + 1:]}")
    return given, relays, ends


def _foreign_pipe(fd: int) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISFIFO(st.st_mode) and st.st_uid != os.geteuid()


def _copy(read: int, fd: int) -> None:
    """Everything that comes through ``read`` into ``fd``, until the last writer closes it
    (what ``fd`` no longer takes is dropped, so that the tree never blocks on it)."""
    while True:
        try:
            data = os.read(read, 1 << 16)
        except InterruptedError:
            continue
        if not data:
            os.close(read)
            return
        while data:
            try:
                data = data[os.write(fd, data):]
            except InterruptedError:
                continue
            except OSError:
                break


def _default_signals() -> None:
    for name in _THE_TREES:  # (criu and what it restores start with the usual dispositions)
        signal.signal(getattr(signal, name), signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
