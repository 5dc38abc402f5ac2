"""The benchmark's smoke run (benchmarks/bench.py): every section runs at a tiny size, prints rows.
The real numbers come from a full run (see BENCHMARKS.md), never from the test suite. ~30 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_quick_benchmark_prints_every_section(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PROCCKPT_TOKEN", None)
    md = tmp_path / "bench.md"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--dir",
                           str(tmp_path), "--markdown", str(md)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for row in ("procckpt async", "torch.save + fsync", "raw write + fsync of the same bytes",
                "raw read of the same bytes", "first async checkpoint", "writer thread",
                "helper process", "launcher CPU while idle", "launcher RSS"):
        assert row in done.stdout, row
    assert "| procckpt async |" in md.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["bench.md"], "the run cleans up after itself"


def test_the_gpu_benchmark_runs_its_code_on_the_cpu(tmp_path: Path) -> None:
    # Its figures need a GPU (BENCHMARKS.md); here every kind it times runs once, so that a
    # GPU session spends its minutes measuring, not fixing the script.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_checkpoint.py"
    env = dict(os.environ)
    env.pop("PROCCKPT_TOKEN", None)
    work, figures = tmp_path / "work", tmp_path / "figures.json"
    work.mkdir()
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--batch", "16",
                           "--size", "4MiB", "--hidden", "256", "--repeats", "1",
                           "--dir", str(work), "--json", str(figures)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for row in ("normal step", "ckpt step, overlap", "ckpt step, no overlap", "D2H",
                "stop durable / raw write", "first ckpt step / steady", "restore onto the device"):
        assert row in done.stdout, row
    assert list(work.iterdir()) == [], "the run cleans up after itself"
    # make gpu-check's table is made of what it writes.
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from gpu_check import RATIOS, table
    finally:
        sys.path.pop(0)
    rows = table({"4MiB": json.loads(figures.read_text())}).splitlines()
    for name, _ in RATIOS:
        (row,) = [r for r in rows if r.startswith(f"| {name} |")]
        float(row.split("|")[2])  # a figure in each row (on the CPU it means nothing)
    assert [r for r in rows if r.startswith("| restore onto the device, s |")]


def test_the_sampler_benchmark_prints_its_figures() -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "liveness_cost.py"
    done = subprocess.run([sys.executable, str(script), "--seconds", "0.3", "--pairs", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for row in ("step time without sampler", "step time with sampler", "ratio per pair",
                "sampler thread CPU, share of a core"):
        assert row in done.stdout, row


def test_make_bench_writes_one_report_with_each_command_and_its_output(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "report.py"
    out = tmp_path / "BENCHMARKS.md"
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, str(script), "--quick", "--only",
                           "liveness_cost,report_scale,gpu_checkpoint", "--out", str(out),
                           "--dir", str(work)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = out.read_text()
    assert "at commit " in report and "(--quick" in report
    for command in ("python benchmarks/liveness_cost.py --seconds 0.5 --pairs 1",
                    "python benchmarks/report_scale.py --cycles 20 --repeats 1"):
        assert f"    {command}\n" in report, command
    assert "step time with sampler" in report  # what the script printed, under its command
    if not torch_cuda():
        assert report.count("Not run: no CUDA device on this machine.") == 2
    assert list(work.iterdir()) == [], "each benchmark's directory is removed"
