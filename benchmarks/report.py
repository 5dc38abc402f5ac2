"""``make bench``: run every benchmark at one commit, one after the other, and write BENCHMARKS.md.

Each section of the report is one command and what it printed, so every figure says how it was
made; what the figures mean is in benchmarks/README.md, and earlier reports are in git
(``git log -p BENCHMARKS.md``). A benchmark that needs what this machine lacks (a GPU, DMTCP)
is listed as not run, with the reason.

    python benchmarks/report.py                       # every benchmark: about 80 minutes
    python benchmarks/report.py --only liveness_cost  # some of them (the others' sections go)
    python benchmarks/report.py --quick --out /tmp/b.md   # tiny sizes: does each one run?

Run it on a quiet machine: the benchmarks take their ratios within one run, but a neighbour
that comes and goes between two of them still moves their figures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


@dataclass(frozen=True)
class Benchmark:
    name: str  # the script, benchmarks/NAME.py
    title: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    needs: str | None = None  # "cuda", "dmtcp" or "moto"


BENCHMARKS = (
    Benchmark("bench", "One process: stall, request to durable, restore, memory, GIL, launcher",
              ("--repeats", "5"), ("--quick",)),
    Benchmark("liveness_cost", "Hang detection's sampler thread on a dispatch-bound loop",
              (), ("--seconds", "0.5", "--pairs", "1")),
    Benchmark("resume_cost", "A resume early and late in an epoch",
              ("--repeats", "7", "--late", "5000"),
              ("--repeats", "1", "--late", "50", "--loaders", "plain")),
    Benchmark("stream_rate", "The streaming recipe's batches per second, beside a plain DataLoader",
              ("--batches", "400", "--repeats", "5"), ("--batches", "30", "--repeats", "1")),
    Benchmark("group_checkpoint", "Process groups: 2 gloo ranks, DDP",
              ("--size", "1GiB", "--repeats", "5"), ("--size", "8MiB", "--repeats", "1")),
    Benchmark("group_checkpoint", "Process groups: 2 gloo ranks, FSDP2 through DCP",
              ("--size", "1GiB", "--repeats", "5", "--sharded"),
              ("--size", "8MiB", "--repeats", "1", "--sharded")),
    Benchmark("agreement_cost", "The ranks' agreement on checkpoints, per training step", (),
              ("--blocks", "1", "--steps", "5")),
    Benchmark("report_scale", "procckpt report and the journal's length", ("--cycles", "4000"),
              ("--cycles", "20", "--repeats", "1")),
    Benchmark("compile_restart", "A torch.compile'd model after a restart",
              ("--cycles", "3", "--time-limit", "60"), ("--cycles", "1", "--time-limit", "20")),
    Benchmark("frozen_base", "Frozen weights written once: 95% frozen, and nothing frozen",
              ("--size", "1GiB", "--repeats", "5"), ("--size", "32MiB", "--repeats", "1")),
    Benchmark("s3_store", "Checkpoints in S3 (moto's server on loopback) against the local disk",
              ("--size", "256MiB", "--repeats", "5"), ("--size", "8MiB", "--repeats", "1"),
              needs="moto"),
    Benchmark("audit_cost", "The resume audit's cost, per batch, checkpoint, resume and stop",
              ("--repeats", "7"), ("--repeats", "1", "--sizes", "1", "--state-mb", "4")),
    Benchmark("exit_cost", "A training process's exit, with and without the final collection",
              (), ("--rounds", "1", "--steps", "2")),
    Benchmark("kill_campaign", "A kill campaign that counts samples: 25 kills a case",
              ("--kills", "25"), ("--kills", "1", "--cases", "plain")),
    Benchmark("dmtcp_images", "DMTCP's process images against a raw write", (),
              ("--mb", "8", "--reps", "1"), needs="dmtcp"),
    Benchmark("gpu_checkpoint", "GPU-resident state, beside DCP async_save, 1 GiB",
              ("--size", "1GiB"), ("--size", "64MiB", "--repeats", "1"), needs="cuda"),
    Benchmark("gpu_checkpoint", "GPU-resident state, beside DCP async_save, 8 GiB",
              ("--size", "8GiB"), ("--size", "64MiB", "--repeats", "1"), needs="cuda"),
)


def missing(need: str | None) -> str | None:
    """Why a benchmark cannot run here, or None."""
    if need == "dmtcp" and shutil.which("dmtcp_launch") is None:
        return "no dmtcp_launch on PATH (docs/dmtcp.md says how to install DMTCP)"
    if need == "moto":
        import importlib.util

        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
            return "no moto server or boto3 (pip install boto3 'moto[server]')"
    if need == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device on this machine"
    return None


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip() or "?"
    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    return head + (" with uncommitted changes" if dirty else "")


def run_one(bench: Benchmark, quick: bool, work: Path) -> tuple[str, float, int]:
    """Run one benchmark in ``work`` (the disk measured); its report text, seconds, status."""
    script = HERE / f"{bench.name}.py"
    args = list(bench.quick if quick else bench.args)
    markdown = work / "tables.md"
    if bench.name == "bench":
        args += ["--markdown", str(markdown)]
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), *args], cwd=work, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.monotonic() - started
    if bench.name == "bench" and result.returncode == 0 and markdown.exists():
        text = markdown.read_text().strip()
    else:
        text = "```\n" + result.stdout.strip() + "\n```"
    return text, seconds, result.returncode


def render(sections: list[str], quick: bool, at: str, started: str) -> str:
    head = [
        "# Benchmarks",
        "",
        f"One run of every benchmark, one after the other, at commit {at}, started {started}"
        + (" (--quick: tiny sizes, the figures mean nothing)" if quick else "") + ".",
        "Written by `make bench` (`python benchmarks/report.py`); what each figure measures, the",
        "targets and what is not measured here: [benchmarks/README.md](benchmarks/README.md).",
        "Earlier reports: `git log -p BENCHMARKS.md`.",
        "",
        "Every figure is a median over interleaved repeats unless its table says otherwise; the",
        "machine is shared and noisy, so compare the ratios taken within one run, not times",
        "across runs.",
    ]
    return "\n".join(head + sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--only", type=lambda text: set(text.split(",")), default=None,
                        help="comma-separated benchmark names (e.g. bench,liveness_cost)")
    parser.add_argument("--dir", default=".", help="where the benchmarks write [.]")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if args.only is None or b.name in args.only]
    if not chosen:
        parser.error(f"--only names none of {', '.join(sorted({b.name for b in BENCHMARKS}))}")
    at = commit()  # before the run: the tree may change while it runs
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    sections, failed = [], []
    for bench in chosen:
        command = " ".join(["python", f"benchmarks/{bench.name}.py",
                            *(bench.quick if args.quick else bench.args)])
        sections += ["", f"## {bench.title}", "", f"    {command}", ""]
        why = missing(bench.needs)
        if why is not None:
            sections.append(f"Not run: {why}.")
            print(f"[report] {bench.name}: not run: {why}", flush=True)
            continue
        print(f"[report] {command}", flush=True)
        with tempfile.TemporaryDirectory(prefix="procckpt-bench-", dir=args.dir) as work:
            text, seconds, status = run_one(bench, args.quick, Path(work).resolve())
        sections.append(text)
        sections.append("")
        sections.append(f"({seconds:.0f} s" + ("" if status == 0 else f"; exit status {status}")
                        + ")")
        print(f"[report] {bench.name}: {seconds:.0f} s, exit status {status}", flush=True)
        if status != 0:
            failed.append(bench.name)
    gpu = Path(__file__).resolve().parent / "gpu-check.md"
    if any(b.needs == "cuda" for b in chosen) and missing("cuda") is not None and gpu.exists():
        sections += ["", "## make gpu-check, on a GPU", "", gpu.read_text().strip()]
    Path(args.out).write_text(render(sections, args.quick, at, started))
    print(f"[report] wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
