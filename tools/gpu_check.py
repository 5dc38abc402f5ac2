"""``make gpu-check``: what to run first on a machine with a GPU, in one command that fits a few
minutes of it (at most 6 on one H100 or H200, CUDA's start included; ``--quick``: at most 3).

1. every test marked ``cuda`` (the page-locked arena, the side-stream copy and the step fence,
   the frameworks' ``--cuda`` runs, sharded state through DCP on an NCCL group), each in a
   pytest of its own with its own time limit, several side by side on the one GPU;
2. ``benchmarks/gpu_checkpoint.py`` at 1 GiB of state and (not with ``--quick``) at 8 GiB,
   the second measuring the targets' figures alone;

then one table of the figures against their targets. Every failed test is printed with its id
and the last lines of its output, a test stopped at its limit is named as such, and with
``--out DIR`` the whole log (``gpu-check.log``) and the figures (``gpu-check.json``) are
written there. It exits 1 on any failure. It needs torch with CUDA, pytest and the project's
own requirements (click, PyYAML, psutil): run it with the machine's python and the source tree
(``PYTHONPATH=src``, which the Makefile sets); a framework that is not installed there skips
its tests, and the output says so. Without a CUDA device it is a dry run: it names each step
and its time budget, and exits 0.

    make gpu-check GPU_ARGS=--quick      # or: PYTHONPATH=src python3 tools/gpu_check.py --quick
    python3 tools/gpu_check.py --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: (what, target) for each ratio the GPU benchmark writes, in the table's order.
RATIOS = (
    ("ckpt step / normal step", "<= 1.05"),
    ("extra step time without overlap / D2H", "<= 1.1"),
    ("stop durable / raw write", "<= 1.15"),
    ("first / steady ckpt step", "<= 1.5"),
    ("extra step time, procckpt / dcp async_save", "< 1"),
)
REQUIRED = ("torch", "pytest", "click", "yaml", "psutil")
FRAMEWORKS = ("lightning", "transformers", "accelerate")
#: Seconds one CUDA test may take, by a part of its id; others get DEFAULT_TEST_LIMIT. The
#: end-to-end ones run a reference, a stopped run and its resume, each starting python, torch
#: and CUDA (and a framework).
TEST_LIMITS = {"tests/e2e/": 100.0}
DEFAULT_TEST_LIMIT = 45.0
#: CUDA tests run side by side: each is mostly start-up and small kernels.
JOBS = 6
#: Lines of a failed test's output printed beside its id.
TAIL_LINES = 40


@dataclass
class Step:
    """One step of the check: a command and the most seconds it may take."""

    what: str
    argv: list[str]
    budget: float


@dataclass
class TestResult:
    """How one CUDA test ended."""

    nodeid: str
    outcome: str  # passed, failed, skipped, timeout, not run
    seconds: float
    output: str

    def line(self) -> str:
        word = {"timeout": "TIMEOUT", "failed": "FAILED", "not run": "NOT RUN"}.get(
            self.outcome, self.outcome.upper())
        return f"{word:8} {self.seconds:5.0f} s  {self.nodeid}"

    def details(self) -> str:
        """What to print of a test that did not pass: why, then its output's last lines."""
        if self.outcome == "timeout":
            head = f"{self.nodeid}: stopped at its limit of {self.seconds:.0f} s (a timeout)"
        elif self.outcome == "not run":
            head = f"{self.nodeid}: not run, the tests' budget was spent"
        else:
            head = f"{self.nodeid}: {self.outcome}"
        tail = self.output.rstrip().splitlines()[-TAIL_LINES:]
        return "\n".join([head, *(f"    {line}" for line in tail)])


def plan(python: str, quick: bool) -> list[Step]:
    """The steps, each with its budget: at most 360 s together, 180 with ``quick``."""
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-m", "cuda"]
    steps = [Step("collect the CUDA tests", [*pytest, "--collect-only", "-q", "tests"], 25.0),
             Step("CUDA tests", [*pytest, "-q", "-rs", "NODEID"], 110.0)]
    bench = [python, str(REPO / "benchmarks" / "gpu_checkpoint.py")]
    steps.append(Step("GPU checkpoint, 1GiB",
                      [*bench, "--size", "1GiB", "--repeats", "3" if quick else "5"],
                      45.0 if quick else 60.0))
    if not quick:
        steps.append(Step("GPU checkpoint, 8GiB",
                          [*bench, "--size", "8GiB", "--repeats", "3", "--targets-only"], 165.0))
    return steps


def missing_modules() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def device_line() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__}: no CUDA device"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    return True, (f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
                  f"{torch.cuda.device_count()} x {', '.join(names)}, NCCL "
                  f"{'available' if nccl else 'missing'}")


def limit_of(nodeid: str) -> float:
    return next((limit for part, limit in TEST_LIMITS.items() if part in nodeid),
                DEFAULT_TEST_LIMIT)


def run_command(argv: list[str], limit: float, cwd: Path,
                env: dict[str, str]) -> tuple[int | None, str, float]:
    """(exit status or None on a timeout, output, seconds) of ``argv`` stopped at ``limit``;
    a timeout kills its whole process group (a test's training and launcher too)."""
    started = time.monotonic()
    with subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=max(limit, 0.1))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                os.killpg(proc.pid, 9)
            try:  # bounded: a process of another session may still hold the pipe
                output, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired as e:
                output = e.output.decode(errors="replace") if isinstance(
                    e.output, bytes) else (e.output or "")
            code = None
    return code, output or "", time.monotonic() - started


def outcome_of(code: int | None, output: str) -> str:
    if code is None:
        return "timeout"
    if code == 0:
        lines = [line for line in output.splitlines() if line.strip()]
        return "skipped" if lines and " skipped" in lines[-1] and " passed" not in lines[
            -1] else "passed"
    return "failed"


def run_tests(python: str, nodeids: list[str], budget: float, cwd: Path, env: dict[str, str],
              jobs: int = JOBS, limits: Callable[[str], float] = limit_of,
              on_done: Callable[[TestResult], None] | None = None) -> list[TestResult]:
    """Each test in a pytest of its own, ``jobs`` at a time, each stopped at its limit and
    none started after ``budget`` seconds (it is reported as not run)."""
    deadline = time.monotonic() + budget
    lock = threading.Lock()

    def one(nodeid: str) -> TestResult:
        left = deadline - time.monotonic()
        if left <= 1:
            result = TestResult(nodeid, "not run", 0.0, "")
        else:
            limit = min(limits(nodeid), left)
            argv = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", nodeid]
            code, output, seconds = run_command(argv, limit, cwd, env)
            result = TestResult(nodeid, outcome_of(code, output),
                                limit if code is None else seconds, output)
        if on_done is not None:
            with lock:
                on_done(result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, nodeids))


def collected(output: str) -> list[str]:
    """The node ids in ``pytest --collect-only -q``'s output."""
    return [line.strip() for line in output.splitlines() if "::" in line and " " not in
            line.strip()]


def tests_summary(results: list[TestResult]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return ", ".join(f"{n} {what}" for what, n in counts.items()) or "no CUDA test found"


def table(results: dict[str, dict]) -> str:
    sizes = list(results)
    rows = ["| | " + " | ".join(sizes) + " | target |",
            "|---|" + "---|" * len(sizes) + "---|"]
    for name, target in RATIOS:
        cells = [f"{r['ratios'][name]:.3f}" if name in r.get("ratios", {}) else "-"
                 for r in results.values()]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {target} |")
    rows.append("| restore onto the device, s | " + " | ".join(
        f"{r['restore']:.3f}" if r.get("restore") is not None else "-"
        for r in results.values()) + " | |")
    rows.append("| normal step, s | " + " | ".join(
        f"{r['medians']['normal step']:.4f}" if "medians" in r else "-"
        for r in results.values()) + " | |")
    return "\n".join(rows)


class Log:
    """Prints what a person should see, and keeps everything for ``--out``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def keep(self, text: str) -> None:
        self.lines.append(text)


def write_out(out: Path, log: Log, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.log").write_text("\n".join(log.lines) + "\n")
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))


def dry_run(steps: list[Step], quick: bool) -> None:
    total = sum(s.budget for s in steps)
    print(f"gpu-check: dry run (no CUDA device); on a GPU it runs, within {total:.0f} s "
          f"({'--quick' if quick else 'full'}):")
    for step in steps:
        print(f"  {step.what} (at most {step.budget:.0f} s): {' '.join(step.argv)}")


def check_tests(python: str, steps: list[Step], env: dict[str, str], log: Log,
                jobs: int) -> tuple[list[TestResult], bool]:
    """Collect and run the CUDA tests; (results, whether every one passed or skipped)."""
    collect, tests = steps[0], steps[1]
    log.say(f"gpu-check: {collect.what}")
    code, output, seconds = run_command(collect.argv, collect.budget, REPO, env)
    log.keep(output)
    nodeids = collected(output)
    collect_ok = code == 0
    if not collect_ok:  # an error in some module: run what was collected all the same
        log.say(f"gpu-check: collecting the CUDA tests failed (exit status {code}, "
                f"{seconds:.0f} s):\n{output[-3000:]}")
    if not nodeids:
        return [], False
    log.say(f"gpu-check: {tests.what}: {len(nodeids)}, {jobs} at a time, at most "
            f"{tests.budget - seconds:.0f} s")

    def done(result: TestResult) -> None:
        log.say(result.line())
        log.keep(result.output)

    results = run_tests(python, nodeids, tests.budget - seconds, REPO, env, jobs,
                        on_done=done)
    bad = [r for r in results if r.outcome not in ("passed", "skipped")]
    for r in bad:
        log.say(r.details())
    skipped = sorted({line.split(": ", 1)[-1] for r in results if r.outcome == "skipped"
                      for line in r.output.splitlines() if line.startswith("SKIPPED")})
    for why in skipped:
        log.say(f"  skipped: {why}")
    return results, collect_ok and not bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the CUDA tests and 1 GiB only (at most 3 minutes)")
    parser.add_argument("--out", metavar="DIR", help="write gpu-check.log and gpu-check.json "
                        "there")
    parser.add_argument("--jobs", type=int, default=JOBS, help=f"tests side by side [{JOBS}]")
    args = parser.parse_args(argv)
    steps = plan(sys.executable, args.quick)
    missing = missing_modules()
    if missing:
        print(f"gpu-check: missing Python modules: {', '.join(missing)} (install the project's "
              "requirements into this python: pip install -e .)", file=sys.stderr)
        return 2
    cuda, device = device_line()
    log = Log()
    log.say(f"gpu-check: {device}")
    frameworks = [f for f in FRAMEWORKS if importlib.util.find_spec(f) is None]
    if frameworks:
        log.say(f"gpu-check: not installed here, their CUDA tests skip: {', '.join(frameworks)}")
    if not cuda:
        dry_run(steps, args.quick)
        return 0
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("PROCCKPT_TOKEN", None)
    results, tests_ok = check_tests(sys.executable, steps, env, log, args.jobs)
    failed = [] if tests_ok else ["CUDA tests"]
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="procckpt-gpu-check-") as work:
        for step in steps[2:]:
            size = step.what.rsplit(", ", 1)[1]
            json_path = Path(work) / f"{size}.json"
            argv_ = [*step.argv, "--json", str(json_path), "--dir", work]
            log.say(f"gpu-check: {step.what}: {' '.join(argv_)}")
            code, output, seconds = run_command(argv_, step.budget, REPO, env)
            log.say(output.strip())
            if code != 0:
                failed.append(step.what)
                log.say(f"gpu-check: {step.what}: "
                        + ("stopped at its limit of" if code is None else f"exit status {code},")
                        + f" {step.budget if code is None else seconds:.0f} s")
            else:
                log.say(f"gpu-check: {step.what}: {seconds:.0f} s")
            figures[size] = json.loads(json_path.read_text()) if json_path.exists() else {}
    total = time.monotonic() - started
    log.say("")
    log.say(f"procckpt gpu-check{' --quick' if args.quick else ''}: {device}; "
            f"{total:.0f} s")
    log.say(f"CUDA tests: {tests_summary(results)}")
    log.say(table(figures))
    if failed:
        log.say(f"gpu-check: FAILED: {', '.join(failed)}")
    if args.out:
        write_out(Path(args.out), log, {
            "device": device, "quick": args.quick, "seconds": total, "failed": failed,
            "tests": [{k: v for k, v in asdict(r).items() if k != "output"} for r in results],
            "checkpoint": figures})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
