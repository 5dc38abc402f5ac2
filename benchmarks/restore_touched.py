"""How fast a restore runs into memory touched in advance (a warm restart's spare,
training/state/reserve.py) against new memory (a cold start), in fresh processes alternated.

    python benchmarks/restore_touched.py [--mb 64 512] [--runs 5]

For each size: a checkpoint of 16 linear layers under Adam (the weights and the two moments,
as benchmarks/memory_tier.py trains), then ``--runs`` pairs of fresh processes that build the
same model and optimizer and resume from it, one with a region of the checkpoint's size
touched before, one without. Prints each side's median restore (the Checkpointer's
``restore_seconds``: load, checksum, copies, the audit's fingerprints) as GB/s, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PYTHON = sys.executable


def child(mb: float, folder: str, mode: str) -> None:
    """One process: build the model, and save (``make``) or resume (``touched``, ``new``)."""
    import torch
    from torch import nn

    from procckpt import Checkpointer
    from procckpt.training.state import reserve

    torch.manual_seed(0)
    layers = 16
    width = int((mb * 1e6 / 12 / layers) ** 0.5)
    model = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for weight in model.parameters():
        weight.grad = torch.zeros_like(weight)
    optimizer.step()
    if mode == "touched":
        assert reserve.prepare(int(mb * 1e6) + (1 << 20)), "no room for the region"
    ckpt = Checkpointer(dir=folder, model=model, optimizer=optimizer)
    if mode == "make":
        ckpt.save()
    else:
        assert ckpt.restore_seconds is not None and ckpt.resumed_from is not None
        assert (reserve.carved() > 0) == (mode == "touched")
        print(ckpt.resumed_from.nbytes / ckpt.restore_seconds)
    ckpt.close()


def _child(mb: float, folder: Path, mode: str) -> str:
    """Run :func:`child` in a fresh process; its standard output."""
    done = subprocess.run([PYTHON, __file__, "--child", mode, "--folder", str(folder),
                           "--mb", str(mb)], capture_output=True, text=True,
                          env={**os.environ, "PROCCKPT_LOG_LEVEL": "WARNING"})
    if done.returncode != 0:
        raise SystemExit(f"the {mode} process failed: {done.stderr[-2000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[64.0, 512.0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", choices=["make", "touched", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.mb[0], args.folder, args.child)
        return 0
    print(f"{'state':>8}  {'touched GB/s':>12}  {'new GB/s':>9}  ratio")
    for mb in args.mb:
        work = Path(tempfile.mkdtemp(prefix="restore-touched-"))
        try:
            _child(mb, work, "make")
            speeds: dict[str, list[float]] = {"touched": [], "new": []}
            for _ in range(args.runs):
                for mode in speeds:
                    speeds[mode].append(float(_child(mb, work, mode).split()[-1]))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        touched, new = (statistics.median(speeds[m]) for m in ("touched", "new"))
        print(f"{mb:>5.0f} MB  {touched / 1e9:>12.2f}  {new / 1e9:>9.2f}  {touched / new:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
