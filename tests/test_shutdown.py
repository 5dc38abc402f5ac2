"""training/shutdown.py: a process that made a Checkpointer leaves the objects alive at its exit
to the system instead of collecting them, after every exit handler of the script's own, and
writes everything it was asked to; ``PROCCKPT_FINAL_GC=1`` keeps the collection."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from procckpt.training import shutdown

from .conftest import PYTHON

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent("""
    import atexit, gc, sys
    import torch
    import procckpt

    # Registered before the Checkpointer: runs after its handler, so it sees the freeze.
    atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
    log = open(sys.argv[2], "w")
    model = torch.nn.Linear(2, 2)
    ckpt = procckpt.Checkpointer(sys.argv[1], model=model, async_save=False)
    # Registered after it: runs before the freeze, as the script's own handlers do.
    atexit.register(lambda: log.write("closed by the script's handler\\n") and log.close())
    for step in ckpt.steps(3):
        log.write(f"step {step}\\n")
""")


def test_the_exit_leaves_the_objects_to_the_system_and_loses_no_write(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([PYTHON, str(script), str(tmp_path / "ckpt"), str(tmp_path / "log")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["frozen at exit: True"], done.stdout
    assert (tmp_path / "log").read_text() == \
        "step 0\nstep 1\nstep 2\nclosed by the script's handler\n"


def test_procckpt_final_gc_keeps_the_collection(monkeypatch: pytest.MonkeyPatch):
    registered: list[object] = []
    monkeypatch.setattr(shutdown.atexit, "register", registered.append)
    monkeypatch.setattr(shutdown, "_registered", False)
    monkeypatch.setenv("PROCCKPT_FINAL_GC", "1")
    assert not shutdown.skip_final_collection() and not registered
    monkeypatch.delenv("PROCCKPT_FINAL_GC")
    assert shutdown.skip_final_collection() and registered == [shutdown.gc.freeze]
    assert not shutdown.skip_final_collection() and len(registered) == 1  # once a process
