"""A throwaway single-node Slurm cluster on loopback for end-to-end tests.

`SlurmCluster.start()` runs its own ``munged``, ``slurmctld`` and ``slurmd`` (Debian's
``slurm-wlm``/``munge`` packages, Slurm 22.05; ``.ci/install-slurm.sh`` installs them) with every
key, socket, config, state, spool, pid and log file under a fresh directory and with free ports
on 127.0.0.1, so it never touches /etc/slurm, /etc/munge or a packaged service, and two runs (or a
crashed earlier run) cannot collide. ``stop()`` cancels jobs and stops every process it started.

Tests talk to it through ordinary Slurm commands with ``cluster.env`` (``SLURM_CONF`` points at
the temp config); the helpers here wrap the few calls tests need.

Needs root: slurmd must run as root to launch jobs, and munged must run as the owner of its key.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .slurm_nodes import NetNodes, netns_unavailable

__all__ = [
    "SlurmCluster",
    "FAST_TEST_TIMING",
    "SlurmClusterError",
    "parse_scontrol_record",
    "reap_stale_clusters",
    "slurm_cluster_fixture",
]

# Environment variable set on every daemon we start (and so inherited by slurmstepd, and passed
# to jobs through `cluster.env`). Its value is "<cluster dir>:<owner pid>:<owner start time>".
# stop() uses it to find stray processes of *this* cluster; reap_stale_clusters() uses it to find
# processes of clusters whose owning test process has died without stopping them.
MARKER_VAR = "PROCCKPT_TEST_SLURM_CLUSTER"

# MUNGE's socket dir lives in /tmp, not in the caller's tmpdir: see _start_munged.
MUNGE_DIR_PARENT = "/tmp"
MUNGE_DIR_PREFIX = "procckpt-munge-"

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
# slurmctld/slurmd/munged live in /usr/sbin, which is not on every PATH.
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")

# Job states after which a job will not run again by itself (scontrol's JobState names).
FINISHED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


class SlurmClusterError(RuntimeError):
    """The test cluster could not be started, queried or stopped."""


def _which(name: str) -> str | None:
    path = shutil.which(name)
    if path:
        return path
    for d in SBIN_DIRS:
        candidate = Path(d, name)
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago.

    There is a window before the daemon binds it, but the kernel hands out ephemeral ports
    round-robin, so two clusters starting together do not get the same one in practice.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"({path}: {e.strerror})"
    return "\n".join(text.splitlines()[-lines:])


# -- /proc helpers: psutil is not guaranteed in the system Python that may run these tests ------


def _proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): with the pid, names a process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def _proc_ppids() -> dict[int, int]:
    ppids: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppids[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return ppids


def _proc_marker(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = MARKER_VAR.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def _descendants(roots: Iterable[int], ppids: Mapping[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return found


def _kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _processes_with_marker(match: Callable[[str], bool]) -> set[int]:
    """Pids whose environment carries MARKER_VAR with a value that `match` accepts, plus all
    their descendants (a job may have dropped the variable with --export=NONE)."""
    marked = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            value = _proc_marker(int(entry.name))
            if value is not None and match(value):
                marked.add(int(entry.name))
    if not marked:
        return set()
    return _descendants(marked, _proc_ppids()) - {os.getpid()}


def reap_stale_clusters() -> int:
    """SIGKILL processes of test clusters whose owning process is gone; returns how many.

    A test run that was SIGKILLed (or a crashed interpreter) skips stop(), leaving daemons and
    jobs behind. They cannot break a new cluster (own ports and dirs), but they eat CPU slots.
    """

    def owner_dead(value: str) -> bool:
        try:
            _, pid, start = value.rsplit(":", 2)
            return _proc_start_time(int(pid)) != start
        except ValueError:
            return False

    pids = _processes_with_marker(owner_dead)
    _kill_pids(pids)
    _remove_stale_munge_dirs()
    return len(pids)


def _remove_stale_munge_dirs(min_age: float = 120.0) -> None:
    """Remove MUNGE dirs (in /tmp) of clusters whose munged is gone.

    A dir younger than `min_age` is left alone: its cluster may be starting right now, before
    munged has written its pid file.
    """
    for d in Path(MUNGE_DIR_PARENT).glob(f"{MUNGE_DIR_PREFIX}*"):
        try:
            if time.time() - d.stat().st_mtime < min_age:
                continue
            pid = int((d / "munged.pid").read_text().strip())
            alive = Path(f"/proc/{pid}/cmdline").read_bytes().find(b"munged") >= 0
        except (OSError, ValueError):
            alive = False
        if not alive:
            shutil.rmtree(d, ignore_errors=True)


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one line of ``scontrol -o show job|node|partition`` into a dict.

    Values may contain spaces (``Command=``, ``WorkDir=``, ``Reason=``), so a new field starts
    only where whitespace is followed by ``Key=``.
    """
    fields: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=", line.strip()))
    text = line.strip()
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        fields[m.group(1)] = text[m.end() : end]
    return fields


# eq=False: a running cluster is a resource, compared by identity (atexit.unregister relies on it).
@dataclass(eq=False)
class SlurmCluster:
    """One slurmctld + one slurmd (+ a private munged) on 127.0.0.1.

    Args:
        cpus: CPUs declared for the node. May exceed the real core count
            (``SlurmdParameters=config_overrides``) so several 1-CPU test jobs run at once.
        cred_expire: ``AuthInfo=cred_expire``; Slurm holds a requeued job for this long before it
            may start again (Slurm's default, used when None, is 120 s; minimum 5).
        kill_wait: ``KillWait``: seconds between SIGTERM and SIGKILL at time limit / scancel.
        min_job_age: ``MinJobAge``: seconds a finished job stays visible to ``scontrol show job``.
        scheduler_parameters: ``SchedulerParameters``, e.g. ``"sched_interval=2"``: a requeued
            job whose hold has expired waits for the next periodic pass of the main scheduler
            (every 60 s by default), since no event wakes the scheduler for it. (Measured:
            ``bf_interval`` does not shorten that wait, ``sched_interval`` does.)
        start_timeout: seconds to wait for the node to become idle.
        nodes: more than 1: nodes n1..nN, each in a network namespace of its own (its own
            address, hostname and hosts file; tests/harness/slurm_nodes.py), slurmctld on the host.
        slurmd_timeout: ``SlurmdTimeout``: a node that has not answered slurmctld's pings for
            this long is DOWN (Slurm's default, used when None, is 300 s; pings go every third
            of it).
    """

    cpus: int = 8
    cred_expire: int | None = None
    kill_wait: int = 10
    min_job_age: int = 300
    scheduler_parameters: str | None = None
    start_timeout: float = 60.0
    cluster_name: str = "procckpt"
    partition: str = "debug"
    nodes: int = 1
    slurmd_timeout: int | None = None

    root: Path | None = field(default=None, init=False)
    conf_path: Path | None = field(default=None, init=False)
    jobs_dir: Path | None = field(default=None, init=False)
    node_name: str = field(default_factory=lambda: socket.gethostname().split(".")[0], init=False)
    env: dict[str, str] = field(default_factory=dict, init=False)
    ctld_port: int = field(default=0, init=False)
    slurmd_port: int = field(default=0, init=False)
    munge_socket: Path | None = field(default=None, init=False)
    _munge_dir: Path | None = field(default=None, init=False, repr=False)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False, repr=False)
    _marker: str = field(default="", init=False, repr=False)
    _net: NetNodes | None = field(default=None, init=False, repr=False)

    # -- availability --------------------------------------------------------------------------

    @staticmethod
    def available() -> str | None:
        """None when a cluster can be started here, else the reason (for ``pytest.skip``)."""
        if not Path("/proc/self/stat").exists():
            return "the Slurm test cluster needs Linux /proc"
        if os.geteuid() != 0:
            return "the Slurm test cluster needs root (slurmd launches jobs, munged owns its key)"
        missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
        if missing:
            return (
                f"Slurm/MUNGE not installed (missing: {', '.join(missing)}); "
                "run .ci/install-slurm.sh as root"
            )
        return None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, tmpdir: Path | str) -> "SlurmCluster":
        """Start munged, slurmctld and slurmd under a new directory inside `tmpdir`.

        Returns self once ``sinfo`` reports the node idle.

        Raises:
            SlurmClusterError: not available here, or a daemon died / the node did not become
                idle within `start_timeout` (the message carries the daemon log tails).
        """
        reason = self.available()
        if reason:
            raise SlurmClusterError(reason)
        if self._procs:
            raise SlurmClusterError("cluster already started; call stop() first")
        if self.nodes > 1 and (why := netns_unavailable()):
            raise SlurmClusterError(why)
        reap_stale_clusters()

        self.root = Path(tempfile.mkdtemp(prefix="slurm-", dir=tmpdir)).resolve()
        for sub in ("state", "spool", "log", "run", "jobs"):
            (self.root / sub).mkdir()
        self.jobs_dir = self.root / "jobs"
        # Jobs run as root here, but keep the dirs usable if a test submits with --uid.
        os.chmod(self.root, 0o755)
        os.chmod(self.jobs_dir, 0o1777)
        self._marker = f"{self.root}:{os.getpid()}:{_proc_start_time(os.getpid())}"
        atexit.register(self.stop)
        try:
            self._start_munged()
            self.ctld_port, self.slurmd_port = free_port(), free_port()
            while self.slurmd_port == self.ctld_port:
                self.slurmd_port = free_port()
            if self.nodes > 1:
                self._net = NetNodes(self.nodes, self.node_name, self.root)
                self._net.create()
            self.conf_path = self._write_config()
            self.env = self._client_env()
            self._spawn(
                "slurmctld",
                [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf_path)],
            )
            for name in self.node_names:
                self.start_node(name)
            self._wait_node_idle()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def node_names(self) -> list[str]:
        return self._net.names if self._net is not None else [self.node_name]

    def start_node(self, name: str) -> None:
        """Start node ``name``'s slurmd (again, after :meth:`kill_node`)."""
        assert self.conf_path is not None
        argv = [_which("slurmd") or "slurmd", "-D", "-N", name, "-f", str(self.conf_path)]
        (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)  # type: ignore[operator]
        if self._net is None:
            self._spawn("slurmd", argv)
        else:
            self._spawn(f"slurmd-{name}", self._net.command(name, argv))

    def kill_node(self, name: str) -> None:
        """Node ``name`` dies: its slurmd and every job process on it, SIGKILLed at once."""
        if self._net is None:
            raise SlurmClusterError("only a cluster of several nodes (nodes=2) can lose one")
        self._net.kill(name)
        proc = self._procs.pop(f"slurmd-{name}", None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def node_address(self, name: str) -> str:
        return self._net.address(name) if self._net is not None else "127.0.0.1"

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_munged(self) -> None:
        # munged insists that every directory above its socket is world-searchable and not
        # group/world-writable without the sticky bit, and a unix socket path must stay under
        # 108 bytes. pytest's tmp dirs are 0700 and can be deep, so MUNGE gets its own short
        # directory in /tmp (sticky) instead of living under `tmpdir`; stop() removes it.
        assert self.root is not None
        self._munge_dir = Path(tempfile.mkdtemp(prefix=MUNGE_DIR_PREFIX, dir=MUNGE_DIR_PARENT))
        os.chmod(self._munge_dir, 0o755)
        key = self._munge_dir / "munge.key"
        # munged requires the key to be owned by the user it runs as (root here) and not
        # readable by others; a random key per cluster means no other munged can talk to us.
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        sock = self._munge_dir / "munge.socket"
        self.munge_socket = sock
        self._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={self._munge_dir / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self._munge_dir / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 15
        while not sock.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmClusterError(self._failure("munged did not create its socket in 15 s"))
            time.sleep(0.05)

    def _write_config(self) -> Path:
        assert self.root is not None
        r = self.root
        auth_info = [f"socket={self.munge_socket}"]
        if self.cred_expire is not None:
            auth_info.append(f"cred_expire={self.cred_expire}")
        lines = [
            f"ClusterName={self.cluster_name}",
            # slurmctld only runs where SlurmctldHost names the local hostname; the address in
            # parentheses keeps all traffic on loopback.
            f"SlurmctldHost={self.node_name}"
            f"({self._net.host_address if self._net is not None else '127.0.0.1'})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo={','.join(auth_info)}",
            # No cgroups: containers rarely delegate them, and the tests need signals, not limits.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            # CR_CPU without memory: test jobs need no --mem and never wait on memory.
            "SelectTypeParameters=CR_CPU",
            # Trust the CPU count below instead of what slurmd detects (2 cores on CI).
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            f"MinJobAge={self.min_job_age}",
            "InactiveLimit=0",
            "MailProg=/bin/true",
            f"StateSaveLocation={r / 'state'}",
            # %n: each node's own (several slurmd on one machine).
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        if self.scheduler_parameters:
            lines.append(f"SchedulerParameters={self.scheduler_parameters}")
        if self.slurmd_timeout is not None:
            lines.append(f"SlurmdTimeout={self.slurmd_timeout}")
        lines += [f"NodeName={name} NodeAddr={self.node_address(name)} CPUs={self.cpus} "
                  "State=UNKNOWN" for name in self.node_names]
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.node_names)} "
                     "Default=YES MaxTime=UNLIMITED State=UP")
        conf = r / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        # slurmd looks for cgroup.conf beside slurm.conf; an explicit one avoids surprises from
        # a host-wide /etc/slurm/cgroup.conf and documents that cgroups are off.
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        return conf

    def _daemon_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path) if self.conf_path else ""
        env[MARKER_VAR] = self._marker
        # Inherited SLURM_* from an enclosing real job would confuse the daemons and clients.
        for key in list(env):
            if key.startswith("SLURM_") and key != "SLURM_CONF":
                del env[key]
        return env

    def _client_env(self) -> dict[str, str]:
        env = self._daemon_env()
        path = env.get("PATH", "")
        for d in SBIN_DIRS:
            if d not in path.split(":"):
                path = f"{path}:{d}" if path else d
        env["PATH"] = path
        return env

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.root is not None
        out = open(self.root / "log" / f"{name}.stdout", "wb")
        try:
            # A new session keeps terminal ^C and pytest's process group away from the daemons;
            # stop() signals them explicitly.
            self._procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._daemon_env(),
                cwd=self.root,
                start_new_session=True,
            )
        finally:
            out.close()

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            rc = proc.poll()
            if rc is not None:
                raise SlurmClusterError(self._failure(f"{name} exited with status {rc}"))

    def _wait_node_idle(self, names: Sequence[str] | None = None) -> None:
        names = list(names or self.node_names)
        deadline = time.monotonic() + self.start_timeout
        state = ""
        while time.monotonic() < deadline:
            self._check_alive()
            res = self.run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%T"],
                           check=False)
            state = " ".join(res.stdout.split())
            states = [s.rstrip("*~#!%$@^-") for s in res.stdout.split()]
            if res.returncode == 0 and len(states) == len(names) and \
                    set(states) <= {"idle", "mixed", "allocated"}:
                return
            time.sleep(0.5)
        raise SlurmClusterError(
            self._failure(
                f"nodes {','.join(names)} not up after {self.start_timeout:.0f} s "
                f"(sinfo states: {state or 'none'})"
            )
        )

    def wait_nodes_up(self, names: Sequence[str] | None = None) -> None:
        """Wait until Slurm takes ``names`` (default: every node) as up again."""
        self._wait_node_idle(names)

    def _failure(self, what: str) -> str:
        return f"Slurm test cluster: {what}\n{self.log_tails()}"

    def log_tails(self, lines: int = 30) -> str:
        """The last lines of every daemon log, for error messages."""
        if self.root is None:
            return ""
        parts = []
        for log in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {log} ---\n{_tail(log, lines)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel jobs, stop the daemons and kill anything of this cluster that is left.

        Safe to call twice and after a failed start. Every wait is bounded.
        """
        atexit.unregister(self.stop)
        if not self._procs and not self._munge_dir:
            return
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None and self.env:
            # Cancelling first lets slurmstepd deliver SIGTERM/SIGKILL to job process groups,
            # which is tidier than killing slurmstepd under them.
            ids = self.run(["squeue", "-h", "-o", "%A"], check=False, timeout=10)
            job_ids = ids.stdout.split() if ids.returncode == 0 else []
            if job_ids:
                self.run(["scancel", "--signal=KILL", "--full", *job_ids], check=False, timeout=10)
                self.run(["scancel", *job_ids], check=False, timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    left = self.run(["squeue", "-h", "-o", "%A"], check=False, timeout=10)
                    if left.returncode != 0 or not left.stdout.strip():
                        break
                    time.sleep(0.3)
        # slurmd before slurmctld: a slurmctld that sees its node vanish may try to requeue;
        # munged last, the other two use it until they are gone.
        for name in [*(n for n in self._procs if n.startswith("slurmd")), "slurmctld", "munged"]:
            proc = self._procs.get(name)
            if proc is not None:
                self._terminate(proc)
        self._procs.clear()
        if self._net is not None:
            self._net.destroy()
            self._net = None
        # Anything still carrying our marker: slurmstepd (slurmd starts it detached, so it
        # outlives slurmd), job processes and their children.
        marker = self._marker
        if marker:
            _kill_pids(_processes_with_marker(lambda v: v == marker))
        if self._munge_dir is not None:
            shutil.rmtree(self._munge_dir, ignore_errors=True)
            self._munge_dir = None

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            # SIGKILL cannot be ignored, but a process in D state takes it late: still bounded.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    # -- client helpers ------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 30.0,
        input: str | None = None,
        cwd: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster; text output captured.

        Raises:
            SlurmClusterError: `check` and the command failed (message has stderr).
        """
        if not self.env:
            raise SlurmClusterError("cluster not started")
        res = subprocess.run(
            list(argv),
            env=self.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or self.jobs_dir,
        )
        if check and res.returncode != 0:
            raise SlurmClusterError(
                f"`{' '.join(argv)}` failed with status {res.returncode}: "
                f"{res.stderr.strip() or res.stdout.strip()}"
            )
        return res

    def sbatch(
        self,
        args: Sequence[str],
        script: str | Path,
        *,
        cwd: Path | str | None = None,
    ) -> int:
        """Submit a batch job and return its job id.

        Args:
            args: sbatch options, e.g. ``["-t", "1", "-o", str(out)]``.
            script: a `Path` to a job script, or the script text itself (given on stdin).
            cwd: the job's working directory (default: ``<cluster dir>/jobs``, so a job without
                ``-o`` does not drop ``slurm-N.out`` into the repository).
        """
        argv = [_which("sbatch") or "sbatch", "--parsable", *args]
        text: str | None = None
        if isinstance(script, Path):
            argv.append(str(script))
        else:
            text = script
        res = self.run(argv, input=text, cwd=cwd)
        # --parsable prints "jobid" or "jobid;cluster".
        return int(res.stdout.strip().split(";")[0])

    def jobs_info(self, job_id: int | str) -> list[dict[str, str]]:
        """``scontrol show job -o`` records for a job (one per task for a job array)."""
        res = self.run(["scontrol", "-o", "show", "job", str(job_id)])
        return [parse_scontrol_record(line) for line in res.stdout.splitlines() if line.strip()]

    def job_info(self, job_id: int | str) -> dict[str, str]:
        """The ``scontrol show job -o`` record of one job, as a dict of strings.

        Raises:
            SlurmClusterError: unknown job (also once it is older than `min_job_age`).
        """
        records = self.jobs_info(job_id)
        if not records:
            raise SlurmClusterError(f"scontrol shows no job {job_id}")
        return records[0]

    def job_state(self, job_id: int | str) -> str:
        """JobState of a job, e.g. ``RUNNING`` (without a ``+`` or reason suffix)."""
        return self.job_info(job_id)["JobState"].split()[0]

    def wait_state(
        self,
        job_id: int | str,
        states: str | Iterable[str],
        timeout: float,
        *,
        poll: float = 0.5,
    ) -> dict[str, str]:
        """Poll until the job's JobState is one of `states`; return its record.

        Raises:
            SlurmClusterError: not reached within `timeout` seconds, or the job finished in
                another state first (no point waiting for RUNNING after COMPLETED); the message
                holds the last record and the daemon logs.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in wanted:
                return info
            if state in FINISHED_STATES and not wanted & FINISHED_STATES:
                break
            if time.monotonic() > deadline:
                break
            self._check_alive()
            time.sleep(poll)
        raise SlurmClusterError(
            self._failure(
                f"job {job_id} is {info.get('JobState')} (reason {info.get('Reason')}), "
                f"wanted {sorted(wanted)} within {timeout:.0f} s; record: {info}"
            )
        )

    def scancel(self, job_id: int | str, *args: str) -> None:
        self.run(["scancel", *args, str(job_id)])


# Test-suite timing: a requeued job may start again 5 s + 1 after the requeue instead of 120 s,
# and the main scheduler notices it within 2 s instead of 60 s, so a requeue round trip takes
# ~7 s instead of ~150 s. Nothing procckpt does should depend on the length of that hold;
# tests/test_slurm_cluster.py measures Slurm's defaults separately.
FAST_TEST_TIMING: dict[str, object] = {"cred_expire": 5, "scheduler_parameters": "sched_interval=2"}


def slurm_cluster_fixture(
    tmpdir: Path | str | None = None, **options: object
) -> Iterator[SlurmCluster]:
    """Generator for a pytest fixture: skips when unavailable, yields a started cluster, stops it.

    `options` override `FAST_TEST_TIMING` and the `SlurmCluster` defaults (pass
    ``cred_expire=None, scheduler_parameters=None`` for Slurm's own timing). Wrap it in
    tests/conftest.py::

        @pytest.fixture(scope="session")
        def slurm_cluster(tmp_path_factory):
            yield from slurm_cluster_fixture(tmp_path_factory.mktemp("slurm"))
    """
    import pytest  # only here, so the module imports without pytest

    reason = SlurmCluster.available()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(**{**FAST_TEST_TIMING, **options})  # type: ignore[arg-type]
    cluster.start(tmpdir if tmpdir is not None else tempfile.gettempdir())
    try:
        yield cluster
    finally:
        cluster.stop()
