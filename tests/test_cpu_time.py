"""The suite's own account of where a test's time goes (harness/cpu_time.py, the hooks in
conftest.py): run through pytest-xdist as ``make test`` runs, a test that sleeps shows its wall
seconds and no processor seconds, one whose child process computes shows the child's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import REPO

TESTS = """
import subprocess, sys, time

def test_waits():
    time.sleep(2)

def test_computes_in_a_child():
    spin = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 2: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
"""


def test_the_summary_tells_waiting_from_computing_across_workers(tmp_path: Path):
    (tmp_path / "test_two.py").write_text(TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q",
                           "-p", "no:cacheprovider", "-n", "2", "--durations=0",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_two.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) == 4 and "test_two.py::" in fields[3]:
            rows[fields[3].split("::")[1]] = (float(fields[0]), float(fields[1]))
    assert rows.keys() == {"test_waits", "test_computes_in_a_child"}, done.stdout[-3000:]
    wall, cpu = rows["test_waits"]
    assert wall >= 2 and cpu < 1, rows
    wall, cpu = rows["test_computes_in_a_child"]
    assert wall >= 2 and cpu >= 2, rows
    assert "all 2 tests" in done.stdout
