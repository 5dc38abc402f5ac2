"""How much more memory this process's cgroup may charge before it is OOM-killed: cgroup v2 and
v1, the tightest limit of the cgroup and of every cgroup above it.

Slurm's task/cgroup plugin and Kubernetes put a job in a cgroup with a memory limit, on clusters
with either version (v1 on many RHEL 7 and 8 nodes). A limit may be set on the job's cgroup
and not on the step's below it, so every level up to the hierarchy's root counts. Usage counts
what the kernel cannot take back: the charge less the page cache not recently used (a
checkpoint just written leaves gigabytes of cache that reclaim drops before any OOM kill).
"""

from __future__ import annotations

from pathlib import Path

from .files import format_size

__all__ = ["cgroup_room", "memory_available", "memory_short", "HEADROOM"]

#: Left free on the machine or in the cgroup beyond what procckpt itself asks for (the
#: memory tier's files and copy, a warm spare's region): the training's own growth.
HEADROOM = 256 << 20

#: A v1 limit of this or more is no limit (the kernel's "unlimited", rounded to pages).
_V1_UNLIMITED = 1 << 62


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"),
                root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the tightest memory limit over this process's cgroups leaves, or None where none
    is set (or none can be read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and (root / "cgroup.controllers").exists():  # v2, unified
            rooms += _rooms(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1's memory hierarchy
            rooms += _rooms(root / "memory", path, "memory.limit_in_bytes",
                            "memory.usage_in_bytes", "total_inactive_file")
    return min(rooms) if rooms else None


def _rooms(mount: Path, path: str, limit_file: str, usage_file: str, inactive: str
           ) -> list[int]:
    """The room under each limit from ``path``'s cgroup up to the mount's root. A container
    may see its own cgroup as the root: a path that is not under the mount is its root."""
    here = mount / path.strip("/")
    if not here.is_dir():
        here = mount
    rooms = []
    while True:
        room = _room(here, limit_file, usage_file, inactive)
        if room is not None:
            rooms.append(room)
        if here == mount or mount not in here.parents:
            return rooms
        here = here.parent


def _room(cgroup: Path, limit_file: str, usage_file: str, inactive: str) -> int | None:
    try:
        limit_text = (cgroup / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _V1_UNLIMITED:
            return None
        usage = int((cgroup / usage_file).read_text())
    except (OSError, ValueError):
        return None
    return int(limit_text) - usage + _stat(cgroup / "memory.stat", inactive)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def memory_available() -> int | None:
    """The machine's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_short(need: int) -> str | None:
    """What leaves less than ``need`` bytes of memory, in words ('the machine has 1.2 GB
    available', "this process's cgroup may take 300.0 MB more"), or None if nothing does."""
    available = memory_available()
    if available is not None and available < need:
        return f"the machine has {format_size(available)} available"
    room = cgroup_room()
    if room is not None and room < need:
        return f"this process's cgroup may take {format_size(max(room, 0))} more"
    return None
