"""Shared helpers of the tests (tests/README.md says which kind goes where): running a command to
its end, procckpt's argv, bit-for-bit comparison, a fresh working directory, a tmpfs, Slurm."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import cpu_time, shared

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
PROGRAMS = Path(__file__).resolve().parent / "harness" / "programs"
PYTHON = sys.executable

# Every resume of the suite's trainings is audited strictly (training/audit.py): a resume whose
# first batch is not the one the stopped run was about to train on stops with exit code 66, so
# a false alarm (or a real hole) fails the test that resumed. A test of the default says so.
os.environ.setdefault("PROCCKPT_AUDIT", "strict")

# The suite compares runs bit for bit, and torch's CPU sqrt (MKL's vector math, split between
# OpenMP threads in chunks of 2,048) sometimes gives one thread's chunk at low precision on a
# process's first call (torch 2.13.0+cpu, MKL 2024.2, on a loaded machine): two runs without
# a resume then differ from their first optimizer step. With one thread per process no two
# threads make that first call together (pytorch/pytorch#188792; docs/check.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Arrow (pyarrow 26.0.1) allocates through its bundled mimalloc 3.4.1, which registers no fork
# handlers: a DataLoader worker forked while another thread is inside that allocator can take a
# half-changed copy of it. Once in CI, under load, both workers of a loader over Parquet files
# died of SIGSEGV at their first batch. The C library's allocator forks safely (docs/resume.md).
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

# procckpt's logger stops propagating once the first Checkpointer of a process sets it up
# (procckpt/log.py). pytest's caplog hooks onto non-propagating loggers as each test starts, so
# a test whose own Checkpointer was the first of its worker saw no record of its own (CI, at
# 3f0c7d0). Set so from the start, the logger is hooked in every test, whichever runs first.
logging.getLogger("procckpt").propagate = False

# A warm restart's spare interpreter imports torch beside every run once it stepped: seconds
# of a processor for each of the suite's hundreds of runs, few of which restart at all. The
# tests of restarts after crashes (test_memory_tier.py, test_warm_restarts.py) turn it on.
os.environ.setdefault("PROCCKPT_WARM_RESTARTS", "0")

# A DataLoader's workers forked from a test process inherit what the process's earlier tests
# left unreachable; a garbage collection in a worker then runs those objects' destructors, and
# one that ends a native thread of the parent's (which the child does not have) throws
# std::system_error and aborts it. Once, in a quiet fresh-clone run (bfde18e), a worker of
# test_shuffle_buffer.py died so ("terminate called after throwing an instance of
# 'std::system_error'", its stack in a collection). So each test process collects its garbage
# before it forks, where those threads still exist; a fork for a command (subprocess) runs no
# such hook. A training script forks its workers from a process of its own.
os.register_at_fork(before=gc.collect)


QUICK = Path(__file__).parent / "quick.txt"
#: The slowest tests' seconds in a full run (``--durations``): started first, longest first.
DURATIONS = Path(__file__).parent / "durations.txt"


def _known_seconds() -> dict[str, float]:
    seconds = {}
    for line in DURATIONS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            value, nodeid = line.split(maxsplit=1)
            seconds[nodeid] = float(value)
    return seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``quick`` the tests tests/quick.txt names (``make test-quick``); under ``-m quick``
    a line that names no collected test is an error, so the list cannot drift silently.

    Then put the tests tests/durations.txt names first, longest first, the rest in their
    order. pytest-xdist hands out tests in this order (after its groups, largest first, which
    keep theirs), so a test of minutes starts while there is work for the other workers, not
    at the end.
    Deterministic: every worker must collect the same order."""
    wanted = {line.strip() for line in QUICK.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    found = set()
    for item in items:
        if item.nodeid in wanted:
            item.add_marker(pytest.mark.quick)
            found.add(item.nodeid)
    if "quick" in (config.getoption("markexpr", "") or "") and wanted - found:
        raise pytest.UsageError(f"tests/quick.txt names tests that do not exist: "
                                f"{sorted(wanted - found)}")
    known = _known_seconds()
    # (not within an xdist_group: its tests run on one worker in the order they were written)
    rank = {id(item): 0.0 if item.get_closest_marker("xdist_group")
            else -known.get(item.nodeid, 0.0) for item in items}
    items.sort(key=lambda item: rank[id(item)])  # (stable: the rest keep their order)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup``, fail a test of an ``xdist_group`` that pytest-xdist could not
    mark as one (it adds ``@group`` to the node id, which some pytest releases no longer let it
    do), before its fixtures start: every worker would run the module's fixture, and several
    Slurm clusters submitting their jobs at once starve two CPUs into time-outs."""
    if getattr(item.config.option, "loadgroup", False) and "@" not in item.nodeid \
            and item.get_closest_marker("xdist_group"):
        pytest.fail("pytest-xdist ignored this test's xdist_group: install the pytest and "
                    "pytest-xdist that pyproject.toml names (pip install -e '.[test]')",
                    pytrace=False)


#: Processor seconds at each test's start, in the process that runs it.
_started_cpu: dict[str, float] = {}
#: Each test's seconds as the reports come in, in the process that prints the summary.
_ledger = cpu_time.Ledger()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _started_cpu[nodeid] = cpu_time.used()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """The teardown's report carries the test's processor seconds, setup to teardown."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and item.nodeid in _started_cpu:
        spent = cpu_time.used() - _started_cpu.pop(item.nodeid)
        report.user_properties.append((cpu_time.KEY, round(spent, 2)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _ledger.add(report.nodeid, report.duration, report.user_properties)
    if report.when == "teardown":
        _started_cpu.pop(report.nodeid, None)  # (where it was only logged)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    """Under ``--durations=N``, the same tests' processor seconds beside their wall seconds
    (tests/README.md, "Where the time goes")."""
    count = config.getoption("durations", None)
    if count is None or not _ledger.wall:
        return
    which = f"the slowest {count} tests" if count else "the tests"
    terminalreporter.write_sep("=", f"where the time of {which} goes: processor seconds, "
                               "theirs and their processes'")
    for line in _ledger.lines(count):
        terminalreporter.write_line(line)


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """A gloo process group of this process alone."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["background", "synchronous"])
def async_save(request: pytest.FixtureRequest) -> bool:
    """Each checkpoint written by the background writer, then synchronously."""
    return request.param == "background"


#: The environment that keeps CRIU from `--engine auto` (its binary named where none is): the
#: DMTCP engine's tests use it, as auto takes DMTCP only where CRIU cannot be used.
NO_CRIU_ENV = {"PROCCKPT_CRIU": "/nonexistent/criu"}


@pytest.fixture
def without_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`procckpt run` under this test finds no CRIU (so auto picks DMTCP for plain scripts)."""
    for name, value in NO_CRIU_ENV.items():
        monkeypatch.setenv(name, value)


def procckpt_argv() -> list[str]:
    return [PYTHON, "-m", "procckpt"]


def run(argv: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """Run a command to its end, output captured as text; the test fails on a time-out."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("PROCCKPT_TOKEN", None)
    return subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def load_params(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def assert_bit_identical(a: Path, b: Path) -> None:
    import torch

    pa, pb = load_params(a), load_params(b)
    assert pa.keys() == pb.keys()
    different = [k for k in pa if not torch.equal(pa[k], pb[k])]
    assert not different, f"parameters differ: {different}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str = "4m") -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``mount`` (a file system that fills up); skips the test
    where none can be mounted (not root)."""
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session", autouse=True)
def _shared_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's workers keep what they make once (harness/shared.py)."""
    return shared.session_root(tmp_path_factory)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A throwaway single-node Slurm cluster on loopback (skips with the reason if it cannot
    run here: not root, or slurm-wlm/munge missing)."""
    from .harness.slurm_cluster import slurm_cluster_fixture

    yield from slurm_cluster_fixture(tmp_path_factory.mktemp("slurm"))



@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[list[str]]:
    """A real memory cgroup (v1, or v2 with the memory controller) below this process's own,
    limited to ``limit`` bytes; yields the prefix of a command that runs in it (a shell that
    moves itself there, then execs the command). Skips the test where none can be made (not
    root, no such hierarchy)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")]
    if v1:
        parent, limit_file = Path("/sys/fs/cgroup/memory") / v1[0].strip("/"), \
            "memory.limit_in_bytes"
    else:
        v2 = [line[3:] for line in lines if line.startswith("0::")]
        parent, limit_file = Path("/sys/fs/cgroup") / (v2[0].strip("/") if v2 else ""), \
            "memory.max"
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        if "memory" not in enabled:
            pytest.skip(f"no memory controller for the cgroups below {parent}")
    if not parent.is_dir():  # a container that sees its own cgroup as the root
        parent = Path("/sys/fs/cgroup/memory") if v1 else Path("/sys/fs/cgroup")
    group = parent / f"procckpt-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup in {parent}: {e.strerror}")
    try:
        yield ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh"]
    finally:
        for _ in range(100):  # its processes gone, it can be removed
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
