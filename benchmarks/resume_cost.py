"""What a mid-epoch resume costs, early and late in the epoch (issue 11's target).

One epoch of a map-style data set whose samples cost ``--sample-cost`` seconds each to read
(decoding, augmenting), batches of 10. For each loader (no workers; 2 workers; torchdata's
StatefulDataLoader when installed) it measures, in fresh processes, the time from process
start to the first trained batch of:

    fresh      a start with no checkpoint
    early      a resume at batch 10 of the epoch
    late       a resume at batch --late (5,000 by default) of the epoch

Each is run --repeats times, interleaved; medians are printed with the ratios the target
names: late / early (<= 1.10) and each / fresh (<= 1.2). A loader that procckpt must replay
(worker processes) shows the cost growing with the position.

    python benchmarks/resume_cost.py [--late 5000] [--sample-cost 0.0005] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


def child(args: argparse.Namespace) -> None:
    """One process: build the loader, create the Checkpointer, time to the first batch."""
    started = float(os.environ["BENCH_T0"])
    from torch import nn
    from torch.utils.data import Dataset

    import procckpt

    class Costly(Dataset):
        def __init__(self, n: int, cost: float) -> None:
            self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
            self.cost = cost

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> torch.Tensor:
            until = time.perf_counter() + self.cost  # busy, like decoding
            while time.perf_counter() < until:
                pass
            return self.x[i] + 0.1 * torch.randn(8)

    data = Costly(10 * (args.late + 50), args.sample_cost)
    if args.loader == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        from torch.utils.data import DataLoader as Loader
    loader = Loader(data, batch_size=10, shuffle=True,
                    num_workers=2 if args.loader == "workers" else 0)
    model = nn.Linear(8, 1)
    ckpt = procckpt.Checkpointer(args.dir, model=model, save_every=None, async_save=False)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches(loader):
            model(x).sum().backward()
            if args.save_at is not None:  # the set-up run: checkpoint there, then stop
                if ckpt.batch + 1 == args.save_at:
                    ckpt.request_checkpoint(stop=True)
                continue
            print(json.dumps({"first_batch": time.time() - started}), flush=True)
            os._exit(0)


def measure(loader: str, position: int | None, args: argparse.Namespace, work: Path) -> float:
    """Seconds from process start to the first trained batch, resuming at ``position``."""
    d = work / f"{loader}-{position}-{time.monotonic_ns()}"
    base = [sys.executable, str(HERE), "--child", "--loader", loader, "--dir", str(d),
            "--late", str(args.late), "--sample-cost", str(args.sample_cost)]
    env = {**os.environ, "PROCCKPT_LOG_LEVEL": "WARNING"}
    env.pop("PROCCKPT_TOKEN", None)
    if position is not None:  # write the checkpoint to resume from (not timed)
        subprocess.run([*base, "--save-at", str(position)], env={**env, "BENCH_T0": "0"},
                       check=False, capture_output=True, timeout=3600)
    out = subprocess.run(base, env={**env, "BENCH_T0": repr(time.time())}, check=True,
                         capture_output=True, text=True, timeout=3600)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["first_batch"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--late", type=int, default=5000)
    p.add_argument("--sample-cost", type=float, default=0.0005)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loaders", default="plain,workers,torchdata")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--loader", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--save-at", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    loaders = [name for name in args.loaders.split(",") if name]
    if "torchdata" in loaders:
        try:
            import torchdata.stateful_dataloader  # noqa: F401
        except ImportError:
            print("torchdata is not installed: its loader is left out", file=sys.stderr)
            loaders.remove("torchdata")
    positions = {"fresh": None, "early": 10, "late": args.late}
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="procckpt-resume-") as tmp:
        for r in range(args.repeats):
            for loader in loaders:
                for name, position in positions.items():
                    t = measure(loader, position, args, Path(tmp))
                    times.setdefault((loader, name), []).append(t)
                    print(f"  repeat {r + 1}: {loader:9} {name:5} first batch after {t:.2f}s",
                          file=sys.stderr, flush=True)
    print(f"time to the first trained batch, median of {args.repeats} (sample cost "
          f"{args.sample_cost * 1e3:g} ms, batches of 10; late = batch {args.late}):")
    print(f"{'loader':10} {'fresh':>7} {'early':>7} {'late':>7} {'late/early':>11} "
          f"{'early/fresh':>12} {'late/fresh':>11}")
    for loader in loaders:
        m = {name: statistics.median(times[(loader, name)]) for name in positions}
        print(f"{loader:10} {m['fresh']:7.2f} {m['early']:7.2f} {m['late']:7.2f} "
              f"{m['late'] / m['early']:11.2f} {m['early'] / m['fresh']:12.2f} "
              f"{m['late'] / m['fresh']:11.2f}")
    print("targets: late/early <= 1.10, early/fresh and late/fresh <= 1.2")


if __name__ == "__main__":
    main()
