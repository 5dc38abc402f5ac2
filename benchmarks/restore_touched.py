"""How fast a restore runs in a warm restart's spare (memory touched in advance,
training/state/reserve.py, and a restore rehearsed in miniature, rehearsal.py) against a cold
start, in fresh processes alternated.

    python benchmarks/restore_touched.py [--mb 64 512] [--runs 5]

For each size: a checkpoint of 16 linear layers under Adam (the weights and the two moments,
as benchmarks/memory_tier.py trains), then ``--runs`` rounds of three fresh processes that
build the same model and optimizer and resume from it: one as a spare prepares (a region of
the checkpoint's size touched, and a rehearsal), one with the region alone, one with neither.
Prints each one's median restore (the Checkpointer's ``restore_seconds``: load, checksum,
copies, the audit's fingerprints) as GB/s, and the spare's against the cold start's.
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
    """One process: build the model, and save (``make``) or resume (``spare``, ``touched``,
    ``new``)."""
    import torch
    from torch import nn

    from procckpt import Checkpointer
    from procckpt.training.state import reserve
    from procckpt.training.state.rehearsal import rehearse

    torch.manual_seed(0)
    layers = 16
    width = int((mb * 1e6 / 12 / layers) ** 0.5)
    model = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for weight in model.parameters():
        weight.grad = torch.zeros_like(weight)
    optimizer.step()
    if mode == "spare":  # first, as the spare does: a rehearsal leaves no region
        assert rehearse(), "the rehearsal failed"
    if mode in ("spare", "touched"):
        assert reserve.prepare(int(mb * 1e6) + (1 << 20)), "no room for the region"
    ckpt = Checkpointer(dir=folder, model=model, optimizer=optimizer)
    if mode == "make":
        ckpt.save()
    else:
        assert ckpt.restore_seconds is not None and ckpt.resumed_from is not None
        assert (reserve.carved() > 0) == (mode != "new")
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
    parser.add_argument("--child", choices=["make", "spare", "touched", "new"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.mb[0], args.folder, args.child)
        return 0
    print(f"{'state':>8}  {'spare GB/s':>10}  {'touched GB/s':>12}  {'new GB/s':>9}  "
          "spare/new")
    for mb in args.mb:
        work = Path(tempfile.mkdtemp(prefix="restore-touched-"))
        try:
            _child(mb, work, "make")
            speeds: dict[str, list[float]] = {"spare": [], "touched": [], "new": []}
            for _ in range(args.runs):
                for mode in speeds:
                    speeds[mode].append(float(_child(mb, work, mode).split()[-1]))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        spare, touched, new = (statistics.median(speeds[m]) for m in speeds)
        print(f"{mb:>5.0f} MB  {spare / 1e9:>10.2f}  {touched / 1e9:>12.2f}  {new / 1e9:>9.2f}  "
              f"{spare / new:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
