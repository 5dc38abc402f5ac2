"""``make gpu-check``: what to run first on a machine with a GPU, in one command (about 8 minutes
on one H100 or H200).

1. every test marked ``cuda`` (the snapshot's side-stream copy and pinned arena, the frameworks'
   ``--cuda`` variants, sharded state through DCP on an NCCL group), with CUDA visible;
2. ``benchmarks/gpu_checkpoint.py`` at 1 GiB and 8 GiB of state, beside DCP's ``async_save``;

then one table of the figures against their targets. It needs torch with CUDA, pytest and the
project's own requirements (click, PyYAML, psutil), nothing else: run it with the machine's
python and the source tree (``PYTHONPATH=src``, which the Makefile sets); a framework that is
not installed there skips its tests, and the table says so. Without a CUDA device it is a dry
run: it says what it would run and exits 0.

    make gpu-check                 # or: PYTHONPATH=src python3 tools/gpu_check.py
    python3 tools/gpu_check.py --sizes 1GiB --out gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
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


def plan(python: str, sizes: list[str]) -> list[tuple[str, list[str], float]]:
    """(what, argv, time limit in seconds) of each step."""
    parallel = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []
    steps = [("CUDA tests", [python, "-m", "pytest", "-m", "cuda", "-q", "-rs", *parallel,
                             "-p", "no:cacheprovider", "tests"], 240.0)]
    for size in sizes:
        large = size.upper().endswith("GIB") and float(size[:-3]) > 2
        steps.append((f"GPU checkpoint, {size}",
                      [python, str(REPO / "benchmarks" / "gpu_checkpoint.py"), "--size", size,
                       "--repeats", "3" if large else "5"], 180.0 if large else 120.0))
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


def tests_summary(output: str) -> str:
    """pytest's last line ("3 passed, 4 skipped in 60s"), and why each skip was."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    last = lines[-1].strip("= ") if lines else "no output"
    skips = sorted({re.sub(r"^SKIPPED \[\d+\] ", "", line).split(": ", 1)[-1]
                    for line in lines if line.startswith("SKIPPED")})
    return last + "".join(f"\n  skipped: {why}" for why in skips)


def table(results: dict[str, dict]) -> str:
    sizes = list(results)
    rows = ["| | " + " | ".join(sizes) + " | target |",
            "|---|" + "---|" * len(sizes) + "---|"]
    for name, target in RATIOS:
        cells = [f"{r['ratios'][name]:.3f}" if name in r.get("ratios", {}) else "-"
                 for r in results.values()]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {target} |")
    rows.append("| restore onto the device, s | " + " | ".join(
        f"{r['restore']:.3f}" if "restore" in r else "-" for r in results.values()) + " | |")
    rows.append("| normal step, s | " + " | ".join(
        f"{r['medians']['normal step']:.4f}" if "medians" in r else "-"
        for r in results.values()) + " | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1GiB,8GiB", help="state sizes [1GiB,8GiB]")
    parser.add_argument("--out", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    steps = plan(sys.executable, sizes)
    missing = missing_modules()
    if missing:
        print(f"gpu-check: missing Python modules: {', '.join(missing)} (install the project's "
              "requirements into this python: pip install -e .)", file=sys.stderr)
        return 2
    cuda, device = device_line()
    print(f"gpu-check: {device}")
    frameworks = [f for f in FRAMEWORKS if importlib.util.find_spec(f) is None]
    if frameworks:
        print(f"gpu-check: not installed here, their CUDA tests skip: {', '.join(frameworks)}")
    if not cuda:
        print("gpu-check: dry run (no CUDA device); on a GPU it runs, within about 8 minutes:")
        for what, argv_, limit in steps:
            print(f"  {what} (at most {limit:.0f} s): {' '.join(argv_)}")
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    failed: list[str] = []
    results: dict[str, dict] = {}
    summary = ""
    with tempfile.TemporaryDirectory(prefix="procckpt-gpu-check-") as work:
        for what, argv_, limit in steps:
            started = time.monotonic()
            json_path = Path(work) / f"{len(results)}.json"
            if "gpu_checkpoint" in argv_[1]:
                argv_ = [*argv_, "--json", str(json_path), "--dir", work]
            print(f"gpu-check: {what}: {' '.join(argv_)}", flush=True)
            try:
                done = subprocess.run(argv_, cwd=REPO, env=env, text=True, timeout=limit,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                output, code = done.stdout, done.returncode
            except subprocess.TimeoutExpired as e:
                output = (e.stdout or b"").decode(errors="replace") if isinstance(
                    e.stdout, bytes) else (e.stdout or "")
                code = -1
                output += f"\n(stopped after {limit:.0f} s)"
            seconds = time.monotonic() - started
            if code != 0:
                failed.append(what)
            if what == "CUDA tests":
                summary = tests_summary(output)
                print(output[-6000:] if code != 0 else summary, flush=True)
            else:
                print(output.strip(), flush=True)
                size = what.rsplit(", ", 1)[1]
                results[size] = json.loads(json_path.read_text()) if json_path.exists() else {}
            print(f"gpu-check: {what}: {seconds:.0f} s, exit status {code}", flush=True)
    print()
    print(f"procckpt gpu-check: {device}")
    print(f"CUDA tests: {summary}")
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "tests": summary,
                                              "checkpoint": results}, indent=1))
    if failed:
        print(f"gpu-check: FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
