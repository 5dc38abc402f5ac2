"""README's demo shows a run interrupted by its time limit, restarted and finished. (How long
it takes is the machine's: 39 s on a quiet 2-core one; a fresh-clone run of the suite
in a cgroup of 1.4 CPUs, where each start took 8-11 s, took 205 s with the demo's earlier
15-s cycles. The run's timeout bounds it here.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..conftest import EXAMPLES, run


def test_demo_interrupts_restarts_and_finishes(workdir: Path):
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "TMPDIR": str(workdir)}
    result = run(["bash", str(EXAMPLES / "demo.sh")], cwd=workdir, env=env, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "asking for a checkpoint then stop (deadline)" in output
    assert "restarting (restart 1 of 20)" in output
    assert "resumed from ckpt-" in output
    assert "training finished" in output
    assert "state:          finished" in result.stdout  # procckpt status at the end
