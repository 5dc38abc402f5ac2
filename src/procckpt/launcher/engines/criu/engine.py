"""The CRIU engine: images of the whole process tree of an unmodified command (DataLoader
workers included), taken by CRIU and restored in place by the next cycle.

    cycle 1      python nsinit.py: the command in a PID namespace of its own, behind the keeper
    a request    criu dump -t ROOT --shell-job [--leave-running] -D ckpt-N/  (a thread)
    cycle n      python restore.py: criu restore --restore-detached --restore-sibling
                 --shell-job -D ckpt-N/ --inherit-fd fd[1]:<its stdout then> ...

ROOT is the namespace's init (nsinit.py), whose pid, the host's, it writes to
``criu/root.pid``: the pids inside the image are the namespace's, so a restore gets them back
on any node (CRIU makes a new namespace for them). Where no namespace can be made (CRIU's
``--unprivileged`` mode, or ``PROCCKPT_CRIU_PID_NAMESPACE=0``), the command runs with the
host's pids and ROOT is the command itself (the keeper's child); a restore then needs those
pids free, and says which one is not.

A periodic image (``--leave-running``) pauses the tree while it is written; a stop's image ends
it (CRIU kills the tree once the image is complete). The images are written straight into a
pending checkpoint of the store and committed like every checkpoint (sizes and CRC-32 in the
manifest, one rename), so a dump cut short is never restored, and an image that does not
restore gives way to the previous one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ....protocol.events import append_event
from ....store import CheckpointInfo, CheckpointStore
from .. import Confirmation, Engine
from ..images import fault_after_restore, newest_image
from .tools import CriuError, CriuTools

__all__ = ["CriuEngine", "ENV_PID_NAMESPACE", "NSINIT_SCRIPT", "RESTORE_SCRIPT"]

logger = logging.getLogger(__name__)

RESTORE_SCRIPT = str(Path(__file__).with_name("restore.py"))
NSINIT_SCRIPT = str(Path(__file__).with_name("nsinit.py"))
#: ``0`` runs the command with the host's pids (a script that reads ``/proc/<its pid>``).
ENV_PID_NAMESPACE = "PROCCKPT_CRIU_PID_NAMESPACE"
#: How long one dump may take: a base and a rate (the slowest disks seen write 20 MB/s).
DUMP_BASE_S = 120.0
DUMP_BYTES_PER_S = 20e6
#: A stop's dump that met a process of the tree ending is taken again after this long, up
#: to DUMP_TRIES times in all (see CriuEngine._dump).
SETTLE_S = 0.3
#: How long a failed dump's tree is watched for a process that ended (see _ended).
ENDED_WAIT_S = 1.0
DUMP_TRIES = 3
#: How a failed dump's error begins (the rest is CRIU's first error line).
_DUMP_FAILED = "criu dump failed: "
#: The fds of the command handed over at a restore (its stdout and stderr).
_HANDED_OVER = (1, 2)


@dataclass
class _Job:
    seq: int
    reason: str
    stop: bool
    thread: threading.Thread | None = None
    answered: bool = False
    dumped: bool = False  # criu dump finished (for a stop: the tree is gone)


@dataclass
class _Cycle:
    token: str
    restored_from: CheckpointInfo | None
    #: The command runs behind nsinit.py, which writes the root's pid once it made the
    #: namespace (or runs the command in place where it cannot).
    namespaced: bool = False
    keeper: int | None = None
    over: threading.Event = field(default_factory=threading.Event)


class CriuEngine(Engine):
    """Snapshots by CRIU; see the module docstring."""

    name = "criu"

    def __init__(self, store: CheckpointStore, tools: CriuTools) -> None:
        self.store = store
        self.tools = tools
        self.work = store.root / "criu"
        self._command: list[str] = []
        self._cycle: _Cycle | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._job: _Job | None = None
        self._confirmed: Confirmation | None = None
        self._failed_images: set[str] = set()
        #: Images whose restore failed once: tried once more before the one before them.
        self._tried_again: set[str] = set()
        self._stuck: str | None = None
        #: PID namespaces need CAP_SYS_ADMIN: root, not CRIU's --unprivileged mode.
        self.namespaces = (not tools.unprivileged
                           and os.environ.get(ENV_PID_NAMESPACE, "").strip() != "0")

    @property
    def stuck(self) -> str | None:
        """Why no image of this command will be taken: CRIU could not dump it (a resource it
        cannot image: a GPU, a socket to elsewhere). A stop whose image failed then ends the
        run in one line instead of restarting into the same failure."""
        return self._stuck

    # -- the Engine interface -------------------------------------------------------------
    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        self._command = list(argv)
        self._confirmed = None
        self._job = None
        self.work.mkdir(exist_ok=True)
        (self.work / "root.pid").unlink(missing_ok=True)
        image = self._newest_image()
        self._cycle = _Cycle(token, image)
        if image is None:
            logger.info("criu: running the command%s; CRIU %s images its whole process tree%s",
                        " in a PID namespace of its own" if self.namespaces else "",
                        self.tools.version_text, " (as this user: --unprivileged)"
                        if self.tools.unprivileged else "")
            if not self.namespaces:
                return list(argv), {}
            self._cycle.namespaced = True
            return [sys.executable, "-I", "-S", NSINIT_SCRIPT, str(self.work / "root.pid"),
                    *argv], {}
        namespaced = bool(image.manifest.get("criu", {}).get("pid_namespace"))
        taken = None if namespaced else _pids_taken(image)
        if taken is not None:
            raise CriuError(f"cannot restore {image.name} here: {taken}, and a restored process "
                            "keeps its pid; run where the image's pids are free (the node it "
                            "was taken on, once the old processes are gone), or use a new --dir "
                            "to start over")
        _make_socket_dirs(image)
        taken_from = image.manifest.get("command")
        if taken_from and taken_from != list(argv):
            logger.warning("criu: %s is an image of `%s`; it is restored as it is (the command "
                           "given now, `%s`, is not run). Use a new --dir to start the new "
                           "command", image.name, " ".join(taken_from), " ".join(argv))
        logger.info("criu: restoring %s (%.1f MB, taken %s)", image.name, image.nbytes / 1e6,
                    time.strftime("%H:%M:%S", time.localtime(image.created)))
        append_event(self.store.events_path, "resume", checkpoint=image.name, engine=self.name,
                     bytes=image.nbytes)
        inherit = []
        for fd, resource in _handed_over(image).items():
            inherit.append(f"fd[{fd}]:{resource}")
        options = [*self.tools.options, *(["--pid-namespace"] if namespaced else [])]
        return [sys.executable, "-I", "-S", RESTORE_SCRIPT, self.tools.criu, str(image.path),
                str(self.work), *options, *inherit], {}

    def child_started(self, pid: int) -> None:
        if self._cycle is not None:
            self._cycle.keeper = pid

    def writing(self, seq: int) -> bool:
        # (a dump is bounded by its timeout, DUMP_BASE_S and the bytes at DUMP_BYTES_PER_S,
        # after which it is answered with its error)
        with self._lock:
            job = self._job
            return job is not None and job.seq == seq and not job.answered

    def connected(self) -> bool:
        return self._root() is not None

    def request(self, action: str, reason: str) -> int:
        stop = action == "stop"
        with self._lock:
            self._seq += 1
            job = self._job
            if job is not None and not job.answered and (job.stop or not stop):
                return job.seq  # one image at a time; a stop waits for nothing else
            # A stop during a running image: its own image follows that one (its thread waits
            # for it), so that nothing runs past the image a stop restores.
            before = job.thread if job is not None and not job.answered else None
            job = _Job(self._seq, reason, stop)
            job.thread = threading.Thread(target=self._serve, args=(job, before),
                                          name="procckpt-criu-dump", daemon=True)
            self._job = job
        job.thread.start()
        return job.seq

    def confirmation(self, seq: int) -> Confirmation | None:
        with self._lock:
            c = self._confirmed
        if c is None or not (c.seq >= seq or c.stopping):
            return None
        return c

    def end_cycle(self) -> Confirmation | None:
        cycle = self._cycle
        if cycle is None:
            return None
        cycle.over.set()
        job = self._job
        if job is not None and job.thread is not None:
            job.thread.join(timeout=DUMP_BASE_S)
        with self._lock:
            c = self._confirmed
        return c if c is not None and c.stopping and c.checkpoint is not None else None

    def after_exit(self, exit_code: int, requested: bool, signalled: bool = False) -> str | None:
        """A command that exited 0 by itself finished (the run is marked complete); a restore
        that never brought the tree back is tried once more (what failed may not again: a
        moment's shortage, a race in CRIU), then gives way to the previous image; so does at
        once a restored tree whose root a fault ended soon after, before any image of its
        own (images.py, ``fault_after_restore``)."""
        cycle = self._cycle
        if cycle is None:
            return None
        job = self._job
        stopped = job is not None and job.stop and job.dumped
        if exit_code == 0 and not signalled and not stopped:
            self.store.mark_complete(token=cycle.token, engine=self.name)
            return None
        image = cycle.restored_from
        if image is None:
            return None  # the command's own exit: the supervisor's rules apply
        fault = self._fault_after_restore(exit_code, signalled)
        if fault is None and (self.work / "root.pid").exists():
            return None  # the restored tree's own exit or crash: the supervisor's rules apply
        append_event(self.store.events_path, "restore-failed", checkpoint=image.name,
                     exit_code=exit_code, problem=fault or "criu restore failed")
        if fault is None and image.name not in self._tried_again:
            self._tried_again.add(image.name)
            return f"restoring {image.name} failed; trying it once more"
        self._failed_images.add(image.name)
        older = self._newest_image(quiet=True)
        if older is None:
            logger.error("criu: restoring %s failed and no older image is left; the images "
                         "stay in %s (see %s/restore.log)", image.name, self.store.ckpt_root,
                         self.work)
            return None
        how = f"restoring {image.name} failed" + (f" ({fault})" if fault else "")
        return f"{how}; falling back to the previous image, {older.name}"

    def _fault_after_restore(self, exit_code: int, signalled: bool) -> str | None:
        """Why the image the cycle restored is taken for a failed restore although CRIU
        brought the tree back (it wrote the root's pid file): a fault ended the root soon
        after, before any image of this cycle was asked for. None for any other end."""
        if self._job is not None:
            return None  # an image of its own was begun: the fault is the command's
        try:
            ran_for = time.time() - (self.work / "root.pid").stat().st_mtime
        except OSError:
            return None  # the tree never came back: a restore that failed in CRIU
        fault = fault_after_restore(exit_code, signalled, ran_for)
        return None if fault is None else (
            f"the restored tree was killed by {fault} {ran_for:.0f}s after CRIU restored it, "
            "before any image of its own")

    # -- images ---------------------------------------------------------------------------
    def _newest_image(self, quiet: bool = False) -> CheckpointInfo | None:
        return newest_image(self.store, self.name, "CRIU", self._failed_images, CriuError,
                            quiet)

    def _root(self) -> int | None:
        """The root of the command's tree: the keeper's child, or the restored root."""
        cycle = self._cycle
        if cycle is None or cycle.keeper is None or cycle.over.is_set():
            return None
        if cycle.restored_from is not None or cycle.namespaced:
            try:
                root = int((self.work / "root.pid").read_text())
            except (OSError, ValueError):
                root = None
            if root is not None:
                return root if psutil.pid_exists(root) else None
            if cycle.restored_from is not None:
                return None
        try:
            children = psutil.Process(cycle.keeper).children()
            if cycle.namespaced and children and NSINIT_SCRIPT in children[0].cmdline():
                return None  # the namespace is being made: no root yet
        except psutil.Error:
            return None
        return children[0].pid if children else None

    # -- checkpoints ----------------------------------------------------------------------
    def _serve(self, job: _Job, before: threading.Thread | None = None) -> None:
        if before is not None:
            before.join()
        c = self._dump(job)
        with self._lock:
            self._confirmed = c
            job.answered = True
            error = c.error or ""
            if c.checkpoint is None and error.startswith(_DUMP_FAILED) and self._stuck is None:
                self._stuck = f"CRIU cannot image this command: {error[len(_DUMP_FAILED):]}"
        if c.checkpoint is not None:
            try:
                self.store.prune()
            except OSError as e:
                logger.warning("criu: could not delete old images: %s", e)

    def _dump(self, job: _Job) -> Confirmation:
        """Take and commit one image; its confirmation (with the error if it failed).

        CRIU refuses a tree in which a process ends while it is seized ("Zombies with threads
        are not supported": a DataLoader worker exiting at the end of an epoch, in a CI run).
        A stop's image is taken again once the tree has settled, up to :data:`DUMP_TRIES`
        times in all, while the command runs: without it the work since the last image is
        lost. A periodic one is not: the next one comes soon, and a tree whose worker was
        killed (an OOM kill) would fail on every restore of it.
        """
        for attempt in range(1, DUMP_TRIES + 1):
            try:
                return self._dump_once(job)
            except _TreeChanged as e:
                cycle = self._cycle
                if (not job.stop or attempt == DUMP_TRIES or cycle is None
                        or cycle.over.wait(SETTLE_S) or self._root() is None):
                    logger.error("criu: image failed: %s", e)
                    return Confirmation(None, None, job.stop, job.seq, str(e))
                logger.warning("criu: image failed: %s; taking it again", e)
        raise AssertionError("unreachable")

    def _dump_once(self, job: _Job) -> Confirmation:
        root = self._root()
        if root is None:
            return Confirmation(None, None, job.stop, job.seq, "the command is not running")
        started = time.monotonic()
        cycle = self._cycle
        tree = _tree(root)
        meta: dict[str, Any] = {
            "engine": self.name, "reason": job.reason, "command": self._command,
            "restored_from": cycle.restored_from.name if cycle and cycle.restored_from
            else None, "job_id": os.environ.get("SLURM_JOB_ID"),
            "criu": {"version": self.tools.version_text, "root": root,
                     "pid_namespace": _leads_a_pid_namespace(root),
                     "fds": _open_resources(root), "socket_dirs": _socket_dirs(tree)},
        }
        try:
            with self.store.begin(meta) as pending:
                nbytes = sum(p.memory_info().rss for p in tree)
                argv = [self.tools.criu, "dump", "-t", str(root), "--shell-job", "-D",
                        str(pending.path), "-W", str(self.work), "-o", "dump.log",
                        *self.tools.options]
                if not job.stop:
                    argv.append("--leave-running")
                done = subprocess.run(argv, capture_output=True, text=True,
                                      timeout=DUMP_BASE_S + nbytes / DUMP_BYTES_PER_S)
                job.dumped = done.returncode == 0
                if done.returncode != 0:
                    failed = f"{_DUMP_FAILED}{_last_error(self.work / 'dump.log')}"
                    gone = _ended(tree)
                    if gone:  # a worker's exit, or a crash (an OOM kill), during the dump
                        raise _TreeChanged(f"pid {gone[0]} of the tree ended during the "
                                           f"image ({failed})")
                    raise CriuError(failed)
                dumped = time.monotonic() - started
                for name in sorted(os.listdir(pending.path)):
                    if stat.S_ISREG(os.lstat(pending.path / name).st_mode):
                        pending.add_file(name)
                info = pending.commit()
        except _TreeChanged:
            raise
        except Exception as e:  # a failed image must not kill the supervisor
            logger.error("criu: image failed: %s", e)
            return Confirmation(None, None, job.stop, job.seq, str(e))
        seconds = time.monotonic() - started
        logger.info("criu: checkpoint %s: %.1f MB written in %.2fs (the tree paused), "
                    "committed in %.2fs (%s)", info.name, info.nbytes / 1e6, dumped,
                    seconds - dumped, job.reason)
        append_event(self.store.events_path, "checkpoint", checkpoint=info.name,
                     bytes=info.nbytes, seconds=round(seconds, 3), write_seconds=round(dumped, 3),
                     pause=round(dumped, 3), reason=job.reason, engine=self.name)
        return Confirmation(info.name, None, job.stop, job.seq, number=info.seq)


class _TreeChanged(CriuError):
    """A process of the tree ended while CRIU imaged it: no fault of the image."""


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() not in (psutil.STATUS_ZOMBIE,
                                                           psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _ended(tree: list[psutil.Process], wait: float = ENDED_WAIT_S) -> list[int]:
    """The pids of ``tree`` that ended, looked for over ``wait`` seconds: CRIU gives up the
    moment a process it has seized is killed (SIGCHLD), which may be before that process is
    gone. Looked at once, a training SIGKILLed during an interval image (a CI run, loaded)
    still passed for alive, and the failed image for one that every image would meet."""
    deadline = time.monotonic() + wait
    while True:
        gone = [proc.pid for proc in tree if not _alive(proc)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def _tree(root: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(root)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def _open_resources(root: int) -> dict[str, str]:
    """What the root's stdout and stderr are, as CRIU names them for ``--inherit-fd``: a
    file's path without its leading slash, ``pipe:[inode]``; others are left to CRIU."""
    found = {}
    for fd in _HANDED_OVER:
        try:
            target = os.readlink(f"/proc/{root}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:["):
            found[str(fd)] = target
        elif target.startswith("/") and not target.startswith("/dev/"):
            try:
                if stat.S_ISREG(os.stat(target).st_mode):
                    found[str(fd)] = target.lstrip("/")
            except OSError:
                continue
    return found


#: How long a pid of the image may still be in use (a process of the last cycle being reaped);
#: $PROCCKPT_CRIU_PID_WAIT seconds where set.
PID_WAIT_S = 10.0
ENV_PID_WAIT = "PROCCKPT_CRIU_PID_WAIT"


def _leads_a_pid_namespace(pid: int) -> bool:
    """Whether ``pid`` is the init of a PID namespace below this one (its NSpid line ends in
    1): its image then holds the namespace's pids, not the host's."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) > 1 and ids[-1] == "1"
    except OSError:
        pass
    return False


def _pids_taken(image: CheckpointInfo, wait: float | None = None) -> str | None:
    """Which of the image's pids (its processes' and threads', from ``core-PID.img``) a live
    process holds here, said as one clause; None when all are free."""
    pids = sorted(int(name[5:-4]) for name in image.manifest.get("files", {})
                  if name.startswith("core-") and name.endswith(".img") and name[5:-4].isdigit())
    if wait is None:
        try:
            wait = float(os.environ.get(ENV_PID_WAIT) or PID_WAIT_S)
        except ValueError:
            wait = PID_WAIT_S
    deadline = time.monotonic() + wait
    while True:
        taken = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        if not taken:
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    pid = taken[0]
    try:
        what = " ".join(psutil.Process(pid).cmdline())[:120] or psutil.Process(pid).name()
    except psutil.Error:
        what = "another process"
    more = f" (and {len(taken) - 1} more of its {len(pids)})" if len(taken) > 1 else ""
    return f"pid {pid} is taken by `{what}`{more}"


def _socket_dirs(tree: list[psutil.Process]) -> list[str]:
    """The folders of the unix sockets the tree has bound to a path. CRIU binds them again
    at a restore, in a folder that must exist: Python's multiprocessing (DataLoader workers
    passing tensors) binds its listeners in ``/tmp/pymp-*``, which the end of an earlier
    run, a job's cleanup of /tmp or another node does not have."""
    inodes = set()
    for proc in tree:
        try:
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        except OSError:
            continue
    folders: set[str] = set()
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
                    folders.add(os.path.dirname(fields[7]))
    except OSError:
        pass
    return sorted(folders)


def _make_socket_dirs(image: CheckpointInfo) -> None:
    for folder in image.manifest.get("criu", {}).get("socket_dirs") or []:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:
            logger.warning("criu: cannot make %s, where the image binds a socket (%s); the "
                           "restore may fail", folder, e.strerror or e)


def _handed_over(image: CheckpointInfo) -> dict[int, str]:
    """fd -> resource for the restore: each resource once (stderr to stdout's file: one)."""
    seen: dict[str, int] = {}
    for fd, resource in (image.manifest.get("criu", {}).get("fds") or {}).items():
        seen.setdefault(resource, int(fd))
    return {fd: resource for resource, fd in seen.items()}


def _last_error(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if "Error" in line and "RLIMIT_NOFILE" not in line
                 and "FAILED" not in line]
    except OSError:
        return f"no log at {log}"
    return lines[0].rstrip(".") if lines else f"see {log}"
