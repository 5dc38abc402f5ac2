"""How fast a restore runs in a warm restart's spare (memory touched in advance,
training/state/reserve.py, and a restore rehearsed in miniature, rehearsal.py) against a cold
start, in fresh processes alternated, for an optimizer with no state before the restore and
for one that stepped before it.

    python benchmarks/restore_touched.py [--mb 64 512] [--runs 5]

For each size: a checkpoint of 16 linear layers under Adam (the weights and the two moments,
as benchmarks/memory_tier.py trains), then ``--runs`` rounds of four fresh processes that
build the same model and optimizer and resume from it: as a spare (a region of the
checkpoint's size touched, and a rehearsal) or as a cold start, each with an optimizer made
as a script makes it (no state: the restore copies the moments into the region, or into new
memory) and with one that stepped before its Checkpointer was made (as memory_tier.py's
training does, so that the tier's slots have their full size at once: the restore copies the
moments over the ones it had, state/mapped.py). Prints each one's median restore (the
Checkpointer's ``restore_seconds``: load, checksum, copies, the audit's fingerprints) as GB/s,
and the spare's against the cold start's.
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
#: Each kind of process: how it starts (a spare or cold), and its optimizer.
KINDS = ("spare fresh", "cold fresh", "spare stepped", "cold stepped")


def child(mb: float, folder: str, kind: str) -> None:
    """One process: build the model, and save (``make``) or resume (one of :data:`KINDS`)."""
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
    if kind == "make" or kind.endswith("stepped"):
        for weight in model.parameters():
            weight.grad = torch.zeros_like(weight)
        optimizer.step()
    if kind.startswith("spare"):  # first, as the spare does: a rehearsal leaves no region
        assert rehearse(), "the rehearsal failed"
        assert reserve.prepare(int(mb * 1e6) + (1 << 20)), "no room for the region"
    ckpt = Checkpointer(dir=folder, model=model, optimizer=optimizer)
    if kind == "make":
        ckpt.save()
    else:
        assert ckpt.restore_seconds is not None and ckpt.resumed_from is not None
        # The moments go into the region only where there is one and nothing to write over.
        assert (reserve.carved() > 0) == (kind == "spare fresh"), (kind, reserve.carved())
        print(ckpt.resumed_from.nbytes / ckpt.restore_seconds)
    ckpt.close()


def _child(mb: float, folder: Path, kind: str) -> str:
    """Run :func:`child` in a fresh process; its standard output."""
    done = subprocess.run([PYTHON, __file__, "--child", kind, "--folder", str(folder),
                           "--mb", str(mb)], capture_output=True, text=True,
                          env={**os.environ, "PROCCKPT_LOG_LEVEL": "WARNING"})
    if done.returncode != 0:
        raise SystemExit(f"the {kind} process failed: {done.stderr[-2000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[64.0, 512.0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", choices=["make", *KINDS], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.mb[0], args.folder, args.child)
        return 0
    print(f"{'state':>8}  {'optimizer':>9}  {'spare GB/s':>10}  {'cold GB/s':>9}  spare/cold")
    for mb in args.mb:
        work = Path(tempfile.mkdtemp(prefix="restore-touched-"))
        try:
            _child(mb, work, "make")
            speeds: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for _ in range(args.runs):
                for kind in KINDS:
                    speeds[kind].append(float(_child(mb, work, kind).split()[-1]))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for optimizer in ("fresh", "stepped"):
            spare = statistics.median(speeds[f"spare {optimizer}"])
            cold = statistics.median(speeds[f"cold {optimizer}"])
            print(f"{mb:>5.0f} MB  {optimizer:>9}  {spare / 1e9:>10.2f}  {cold / 1e9:>9.2f}  "
                  f"{spare / cold:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
