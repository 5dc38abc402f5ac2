"""Nodes for the test Slurm cluster, each in a network namespace of its own.

A node is a network namespace with one veth link to a bridge on the host (where slurmctld
runs), its own address, hostname (``unshare --uts``) and ``/etc/hosts`` (``unshare --mount``,
a bind mount), and its own slurmd. Jobs started by that slurmd live in the namespace too, so
ranks on two nodes talk over the bridge the way they would over a cluster's network, names
resolve through the node's hosts file, and a node can be killed (every process in its
namespace) and brought back. Path-based Unix sockets (MUNGE's) work across namespaces.

Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NetNodes", "netns_unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
    return res


def netns_unavailable() -> str | None:
    """None when network namespaces can be made here, else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "network namespaces for the nodes need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "network namespaces for the nodes need iproute2's ip and util-linux's unshare"
    probe = f"pkprobe{secrets.token_hex(3)}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class NetNodes:
    """``count`` nodes n1..nN on a bridge of their own (10.213.X.0/24; the host is .1)."""

    count: int
    controller: str  # the host's name: slurmctld runs there
    root: Path  # where the hosts files go
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: int = field(default_factory=lambda: 16 + secrets.randbelow(200))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.count + 1)]

    @property
    def bridge(self) -> str:
        return f"pkb{self.tag}"

    @property
    def host_address(self) -> str:
        return f"10.213.{self.subnet}.1"

    def address(self, name: str) -> str:
        return f"10.213.{self.subnet}.{10 + int(name[1:])}"

    def netns(self, name: str) -> str:
        return f"pk{self.tag}{name}"

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = ["127.0.0.1 localhost", f"{self.host_address} {self.controller}"]
        hosts += [f"{self.address(n)} {n}" for n in self.names]
        for name in self.names:
            ns, veth = self.netns(name), f"pkv{self.tag}{name}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.host_address)
            (self.root / f"hosts-{name}").write_text("\n".join(hosts) + "\n")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run as node ``name``: in its namespace, with its hostname and hosts file."""
        inner = (f"hostname {name} && mount --bind {self.root / f'hosts-{name}'} /etc/hosts && "
                 'exec "$@"')
        # nsenter, not `ip netns exec`: that mounts a fresh /sys, and slurmd needs the host's
        # /sys/fs/cgroup.
        return ["nsenter", f"--net=/run/netns/{self.netns(name)}", "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c", inner, "node", *argv]

    def pids(self, name: str) -> list[int]:
        res = _ip("netns", "pids", self.netns(name), check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit()]

    def kill(self, name: str) -> None:
        """The node dies: every process in its namespace (its slurmd, the job's) at once."""
        for _ in range(5):
            pids = self.pids(name)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def destroy(self) -> None:
        for name in self.names:
            self.kill(name)
            _ip("netns", "del", self.netns(name), check=False)
        _ip("link", "del", self.bridge, check=False)
