"""Frozen weights written once: bytes written per checkpoint, stall and request to durable.

Three processes' worth of state side by side, each of SIZE bytes of float32 parameters in
tensors of at most 16 MiB (bench.py's ``TensorState``), each with its own checkpoint dir:

- ``trained, every byte``: every parameter trains, ``PROCCKPT_FROZEN_ONCE=0``: what every
  checkpoint cost before frozen weights went to the chunk store (the baseline);
- ``trained``: every parameter trains, the chunk store on (the default): nothing is frozen,
  so nothing may cost more than the baseline;
- ``95% frozen``: 95% of the bytes in parameters with ``requires_grad=False``, the rest
  trained: after the first checkpoint only the trained part (and the loop's state) is written.

Between checkpoints each trained parameter changes in place (as an optimizer step changes it).
A checkpoint is requested and taken at the next safe point of ``ckpt.batches()``; the stall
is that safe point's time, request to durable the ``seconds`` of its journal entry, written
bytes its ``written``. The three kinds take turns in a rotating order; medians of REPEATS.

    python benchmarks/frozen_base.py --size 1GiB --repeats 5
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("PROCCKPT_LOG_LEVEL", "WARNING")  # the tables, not a line per checkpoint

from bench import TensorState, drop_cache, human, median, parse_size  # benchmarks/ is sys.path[0]

from procckpt import Checkpointer
from procckpt.protocol.events import read_events

KINDS = ("trained, every byte", "trained", "95% frozen")
TARGET_WRITTEN = 0.1  # bytes written after the first / the state's size, 95% frozen
TARGET_NO_REGRESSION = 1.1  # trained (chunk store on) / trained, every byte


class Run:
    """One kind's state, Checkpointer and loop."""

    def __init__(self, kind: str, size: int, work: Path, async_save: bool) -> None:
        self.kind = kind
        self.model = TensorState(size)
        params = list(self.model.parameters())
        if kind == "95% frozen":
            frozen, total = 0, self.model.nbytes
            for p in sorted(params, key=lambda p: -p.numel()):
                if frozen + p.numel() * 4 <= 0.95 * total:
                    p.requires_grad_(False)
                    frozen += p.numel() * 4
        self.trained = [p for p in params if p.requires_grad]
        os.environ["PROCCKPT_FROZEN_ONCE"] = "0" if kind == "trained, every byte" else "1"
        self.ck = Checkpointer(work / kind.replace(" ", "-").replace(",", "").replace("%", ""),
                               model=self.model, keep=2, save_every=None,
                               async_save=async_save)
        del os.environ["PROCCKPT_FROZEN_ONCE"]
        self.loop = self.ck.batches(itertools.repeat(None))
        next(self.loop)
        self.stall: list[float] = []
        self.durable: list[float] = []
        self.written: list[int] = []

    def checkpoint(self, record: bool = True) -> None:
        with torch.no_grad():
            for p in self.trained:
                p.add_(1e-3)  # an optimizer step
        self.ck.request_checkpoint()
        started = time.perf_counter()
        next(self.loop)
        stall = time.perf_counter() - started
        self.ck.flush()
        last = [e for e in read_events(self.ck.store.events_path)
                if e["event"] == "checkpoint"][-1]
        if record:
            self.stall.append(stall)
            self.durable.append(float(last["seconds"]))
            self.written.append(int(last["written"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sync", action="store_true", help="synchronous checkpoints")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary "
                        "directory in the current one)")
    args = parser.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="frozen-bench-", dir=args.dir or "."))
    try:
        runs = [Run(kind, size, work, not args.sync) for kind in KINDS]
        for run in runs:  # the first checkpoint writes everything (and makes the arena)
            run.checkpoint(record=False)
            drop_cache(work)
        for r in range(args.repeats):
            for run in runs[r % 3:] + runs[:r % 3]:
                run.checkpoint()
                drop_cache(work)
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{run.kind} {run.stall[-1]:.3f}s / {run.durable[-1]:.2f}s" for run in runs),
                flush=True)
        state = runs[0].model.nbytes
        print(f"\nstate: {human(state)} in {len(list(runs[0].model.parameters()))} tensors, "
              f"{'synchronous' if args.sync else 'background'} checkpoints, medians of "
              f"{args.repeats}\n")
        print(f"{'':22}{'stall':>10}{'durable':>10}{'written':>12}{'written/state':>15}")
        for run in runs:
            written = median([float(w) for w in run.written])
            print(f"{run.kind:22}{median(run.stall):>9.3f}s{median(run.durable):>9.2f}s"
                  f"{human(written):>12}{written / state:>15.3f}")
        base, same, frozen = runs
        print()
        ratios = [
            ("95% frozen: written / state", median([float(w) for w in frozen.written]) / state,
             TARGET_WRITTEN),
            ("trained: stall / every byte's", median(same.stall) / median(base.stall),
             TARGET_NO_REGRESSION),
            ("trained: durable / every byte's", median(same.durable) / median(base.durable),
             TARGET_NO_REGRESSION),
            ("95% frozen: stall / every byte's", median(frozen.stall) / median(base.stall),
             None),
            ("95% frozen: durable / every byte's",
             median(frozen.durable) / median(base.durable), None),
        ]
        for label, value, target in ratios:
            verdict = "" if target is None else \
                f"  (target <= {target}: {'ok' if value <= target else 'MISSED'})"
            print(f"{label:36}{value:8.3f}{verdict}")
        for run in runs:
            run.ck.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
