"""Where a test's time goes: beside its wall-clock seconds, the processor seconds it used, its
own process's and those of the processes it started and waited for (a ``procckpt run`` and the
trainings under it). A test whose processor seconds are few of its wall seconds waits (time
limits, step sleeps, requeues); one whose are many computes or starts Python again and again.

Each pytest-xdist worker measures its tests and hands the figure over with the teardown's
report (``user_properties``); the process that prints the summary adds up the phases. What a
daemon runs for a test (a Slurm job under the session's ``slurmd``) is counted when the daemon
is waited for, at the end of the session, not in the test."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

KEY = "cpu_seconds"


def used() -> float:
    """Processor seconds (user and system) of this process and its waited-for children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Ledger:
    """The phases' seconds of each test as their reports arrive, and its processor seconds."""

    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    def add(self, nodeid: str, duration: float, properties: list[tuple[str, object]]) -> None:
        self.wall[nodeid] = self.wall.get(nodeid, 0.0) + duration
        for key, value in properties:
            if key == KEY and isinstance(value, (int, float)):
                self.cpu[nodeid] = float(value)

    def lines(self, count: int) -> list[str]:
        """The ``count`` slowest tests (all with 0), each with its wall and processor seconds,
        then the totals."""
        slowest = sorted(self.wall, key=lambda n: -self.wall[n])
        shown = slowest[:count] if count > 0 else slowest
        lines = [f"{'wall s':>8} {'cpu s':>8} {'cpu/wall':>8}  test"]
        for nodeid in shown:
            wall, cpu = self.wall[nodeid], self.cpu.get(nodeid)
            if cpu is None:
                lines.append(f"{wall:8.1f} {'-':>8} {'-':>8}  {nodeid}")
            else:
                lines.append(f"{wall:8.1f} {cpu:8.1f} {cpu / max(wall, 1e-9):8.0%}  {nodeid}")
        total_wall, total_cpu = sum(self.wall.values()), sum(self.cpu.values())
        lines.append(f"{total_wall:8.0f} {total_cpu:8.0f} "
                     f"{total_cpu / max(total_wall, 1e-9):8.0%}  all {len(self.wall)} tests")
        return lines
