"""store/cgroups.py on cgroup trees laid out as the kernel lays them out (v1, v2): the
tightest limit over a cgroup and its ancestors, page cache not recently used counted as room.
The real kernel's files are read by test_memory_tier.py's cgroup test."""

from __future__ import annotations

from pathlib import Path

import pytest

from procckpt.store.cgroups import cgroup_room

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit
MB = 1 << 20


def _group(path: Path, limit: str, usage: int, stat: str = "") -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "limit").write_text(limit)
    (path / "usage").write_text(str(usage))
    (path / "memory.stat").write_text(stat)


def _v1(root: Path, path: Path, limit: str, usage: int, inactive: int = 0) -> None:
    _group(path, limit, usage, f"cache 1\ntotal_inactive_file {inactive}\n")
    (path / "limit").rename(path / "memory.limit_in_bytes")
    (path / "usage").rename(path / "memory.usage_in_bytes")


def _v2(path: Path, limit: str, usage: int, inactive: int = 0) -> None:
    _group(path, limit, usage, f"anon 1\ninactive_file {inactive}\n")
    (path / "limit").rename(path / "memory.max")
    (path / "usage").rename(path / "memory.current")


def test_v1_a_limit_on_the_job_counts_for_its_step_below(tmp_path: Path):
    root = tmp_path / "sys"
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/slurm/job_7\n4:memory:/slurm/job_7/step_0\n1:cpu:/\n")
    memory = root / "memory"
    _v1(root, memory, str(2 ** 63 - 4096), 9000 * MB)
    _v1(root, memory / "slurm", "9223372036854771712", 900 * MB)
    _v1(root, memory / "slurm" / "job_7", str(1000 * MB), 700 * MB, inactive=100 * MB)
    _v1(root, memory / "slurm" / "job_7" / "step_0", "9223372036854771712", 600 * MB)
    assert cgroup_room(proc, root) == 400 * MB  # 1000 - 700 + 100


def test_v2_the_tightest_limit_wins_and_max_is_none(tmp_path: Path):
    root = tmp_path / "sys"
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/c1\n")
    (root / "kubepods" / "pod1" / "c1").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    _v2(root / "kubepods", "max", 5000 * MB)
    _v2(root / "kubepods" / "pod1", str(2000 * MB), 1500 * MB)
    _v2(root / "kubepods" / "pod1" / "c1", str(1800 * MB), 1000 * MB, inactive=50 * MB)
    assert cgroup_room(proc, root) == 500 * MB  # the pod's: 2000 - 1500
    _v2(root / "kubepods" / "pod1", "max", 1500 * MB)
    assert cgroup_room(proc, root) == 850 * MB  # the container's: 1800 - 1000 + 50


def test_no_limit_or_nothing_readable_is_none(tmp_path: Path):
    root = tmp_path / "sys"
    proc = tmp_path / "cgroup"
    assert cgroup_room(proc, root) is None  # no /proc file
    proc.write_text("0::/\n")
    assert cgroup_room(proc, root) is None  # no v2 hierarchy mounted there
    (root).mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    _v2(root, "max", 100 * MB)
    assert cgroup_room(proc, root) is None


def test_a_container_that_sees_its_cgroup_as_the_root(tmp_path: Path):
    """The path names the host's hierarchy, which the container's mount does not show."""
    root = tmp_path / "sys"
    proc = tmp_path / "cgroup"
    proc.write_text("7:memory:/docker/abc\n")
    _v1(root, root / "memory", str(512 * MB), 112 * MB)
    assert cgroup_room(proc, root) == 400 * MB
