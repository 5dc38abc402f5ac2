"""The kill campaign's short version (benchmarks/kill_campaign.py): every case killed with
SIGKILL once (the whole tree or the training alone, at random), the kill aimed at a phase
drawn at random (start-up, the first batch after a resume, training, a checkpoint's write, its
commit, its upload), resumed, and counted: no sample trained twice or never, final weights
bit-identical to an uninterrupted run. The report's 25 kills per case are in BENCHMARKS.md.

(Two kills a case took this test 550-830 s of a worker, the longest of the suite: most of it
the cases' start-ups, one after the other. One a case still reaches every case's resume; the
seed picks each case's phase and kind of kill, and the benchmark's 25 a case cover them all.
A case runs without kills once, and a second time only when a life ends other than it, to
tell a training that is not deterministic from a resume that is not exact.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ..conftest import REPO, run

pytestmark = pytest.mark.slow


def test_a_short_kill_campaign_counts_every_sample_once(workdir: Path):
    done = run([sys.executable, str(REPO / "benchmarks" / "kill_campaign.py"), "--kills", "1",
                "--seed", "1"], cwd=workdir, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 8, done.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        kills = cells[1]
        if kills.startswith("skipped"):
            continue
        # It landed, in a phase it names; more where a life needed a resume for the first
        # batch after one (a start-up kill before its first checkpoint).
        assert int(kills) >= 1, row
        assert sum(int(c) for c in cells[2:8]) == int(kills), row
        twice, never, identical = cells[-3:]
        assert (twice, never, identical) == ("0", "0", "yes"), row
    assert not re.search(r"\bNO\b", done.stdout), done.stdout
