"""README's demo shows a run interrupted by its time limit, restarted and finished,
in under two minutes on a 2-core machine."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..conftest import EXAMPLES, run


def test_demo_interrupts_restarts_and_finishes(workdir: Path):
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "TMPDIR": str(workdir)}
    started = time.monotonic()
    result = run(["bash", str(EXAMPLES / "demo.sh")], cwd=workdir, env=env, timeout=300)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "asking for a checkpoint then stop (deadline)" in output
    assert "restarting (restart 1 of 20)" in output
    assert "resumed from ckpt-" in output
    assert "training finished" in output
    assert "state:          finished" in result.stdout  # procckpt status at the end
    assert elapsed < 120, f"the demo took {elapsed:.0f}s"
