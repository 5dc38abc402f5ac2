"""tools/gpu_check.py without a GPU: its budgets, how it runs and reports tests (on throwaway
tests of its own kind: one passes, one fails, one skips, one outlives its limit), ``--out``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
try:
    import gpu_check
finally:
    sys.path.pop(0)

THROWAWAY = '''
import time, pytest

def test_passes():
    pass

def test_fails():
    print("the line that says why: 41 != 42")
    assert 41 == 42

def test_skips():
    pytest.skip("needs a CUDA device; there is none")

def test_hangs():
    print("started the hang", flush=True)
    time.sleep(600)
'''


@pytest.mark.parametrize("quick, most", [(True, 180), (False, 360)])
def test_the_steps_fit_their_promise(quick: bool, most: int) -> None:
    steps = gpu_check.plan(sys.executable, quick)
    assert sum(s.budget for s in steps) <= most
    assert any("1GiB" in s.what for s in steps)
    assert any("8GiB" in s.what for s in steps) is not quick


@pytest.mark.skipif(gpu_check.device_line()[0], reason="with a GPU, make gpu-check runs "
                    "for real (minutes), not dry")
@pytest.mark.parametrize("args, most", [("--quick", 180), ("", 360)])
def test_without_a_gpu_it_is_a_dry_run_naming_each_step_and_its_budget(args: str,
                                                                       most: int) -> None:
    done = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={sys.executable}",
                           f"GPU_ARGS={args}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run (no CUDA device)" in done.stdout
    budgets = [float(line.split("(at most ")[1].split(" s)")[0])
               for line in done.stdout.splitlines() if "(at most " in line]
    assert len(budgets) == (3 if args else 4) and sum(budgets) <= most, done.stdout
    assert "-m pytest -p no:cacheprovider -m cuda" in done.stdout
    assert ("benchmarks/gpu_checkpoint.py --size 8GiB" in done.stdout) is not bool(args)


def test_each_test_runs_alone_with_its_limit_and_a_failure_shows_its_id_and_last_lines(
        tmp_path: Path) -> None:
    (tmp_path / "test_throwaway.py").write_text(THROWAWAY)
    ids = [f"test_throwaway.py::test_{name}" for name in ("passes", "fails", "skips", "hangs")]
    env = {**os.environ}
    started = time.monotonic()
    results = gpu_check.run_tests(sys.executable, ids, budget=120, cwd=tmp_path, env=env,
                                  jobs=4, limits=lambda nodeid: 15.0)
    assert time.monotonic() - started < 60  # the hang was stopped at its limit
    outcome = {r.nodeid.rsplit("_", 1)[1]: r for r in results}
    assert {k: r.outcome for k, r in outcome.items()} == {
        "passes": "passed", "fails": "failed", "skips": "skipped", "hangs": "timeout"}
    failed = outcome["fails"].details()
    assert failed.startswith("test_throwaway.py::test_fails: failed")
    assert "the line that says why: 41 != 42" in failed
    hung = outcome["hangs"].details()
    assert hung.startswith("test_throwaway.py::test_hangs: stopped at its limit of 15 s "
                           "(a timeout)")
    assert "TIMEOUT" in outcome["hangs"].line() and "test_hangs" in outcome["hangs"].line()
    assert gpu_check.tests_summary(results) == "1 passed, 1 failed, 1 skipped, 1 timeout"


def test_tests_left_when_the_budget_is_spent_are_named_as_not_run(tmp_path: Path) -> None:
    (tmp_path / "test_throwaway.py").write_text(THROWAWAY)
    ids = ["test_throwaway.py::test_hangs", "test_throwaway.py::test_passes"]
    results = gpu_check.run_tests(sys.executable, ids, budget=8, cwd=tmp_path,
                                  env=dict(os.environ), jobs=1, limits=lambda nodeid: 60.0)
    assert [r.outcome for r in results] == ["timeout", "not run"]
    assert "not run, the tests' budget was spent" in results[1].details()


def test_collected_ids_are_read_from_pytests_collect_only_output() -> None:
    output = ("tests/test_device_path.py::test_x[cuda]\n"
              "tests/e2e/test_frameworks.py::test_y[cuda-accelerate]\n\n"
              "2/700 tests collected (698 deselected) in 3.10s\n")
    assert gpu_check.collected(output) == ["tests/test_device_path.py::test_x[cuda]",
                                           "tests/e2e/test_frameworks.py::test_y[cuda-accelerate]"]


def test_out_holds_the_whole_log_and_the_figures(tmp_path: Path) -> None:
    log = gpu_check.Log()
    log.say("gpu-check: a line shown")
    log.keep("a test's whole output")
    gpu_check.write_out(tmp_path / "out", log, {"device": "x", "failed": ["CUDA tests"]})
    assert (tmp_path / "out" / "gpu-check.log").read_text().splitlines() == [
        "gpu-check: a line shown", "a test's whole output"]
    assert json.loads((tmp_path / "out" / "gpu-check.json").read_text())["failed"] == [
        "CUDA tests"]
