"""launcher/signals.py in a process of its own, with real signals: what the launcher's handlers
leave behind once its run is over."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import PYTHON

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

AFTER_THE_RUN = """
import os, signal
from procckpt.launcher.signals import HANDLED_SIGNALS, SignalPipe
pipe = SignalPipe(HANDLED_SIGNALS)
pipe.install()
pipe.restore()  # the run ended; the process is on its way out
os.kill(os.getpid(), signal.SIG{name})
print("exited on its own")
"""


@pytest.mark.parametrize("name", ["USR1", "USR2"])
def test_a_checkpoint_signal_after_the_run_does_not_kill_the_launcher(name: str):
    """Slurm's warning signal (`--signal=B:USR1@N`) came as the training finished: the
    launcher died of it, exit code 0 lost, and Slurm recorded a job that finished as FAILED."""
    done = subprocess.run([PYTHON, "-c", AFTER_THE_RUN.format(name=name)], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "exited on its own"), done.stderr


def test_a_stop_signal_after_the_run_still_ends_the_process():
    done = subprocess.run([PYTHON, "-c", AFTER_THE_RUN.format(name="TERM")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -15, (done.stdout, done.stderr)
