"""What a mid-epoch resume costs, early and late in the epoch.

One epoch of a map-style data set whose samples cost ``--sample-cost`` seconds each to read
(decoding, augmenting), batches of 10. For each loader (no workers; 2 workers; torchdata's
StatefulDataLoader when installed) it measures, in fresh processes, the time from process
start to the first trained batch of:

    fresh      a start with no checkpoint
    early      a resume at batch 10 of the epoch
    late       a resume at batch --late (5,000 by default) of the epoch

The checkpoints to resume from are written once; each measurement resumes from a fresh
copy. Each is run --repeats times, interleaved; medians are printed with the ratios the target
names: late / early (<= 1.10) and each / fresh (<= 1.2). It also prints what the per-sample
seeding of worker processes costs per sample.

    python benchmarks/resume_cost.py [--late 5000] [--sample-cost 0.0005] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def child_argv(loader: str, d: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(HERE), "--child", "--loader", loader, "--dir", str(d),
            "--late", str(args.late), "--sample-cost", str(args.sample_cost)]


def child_env() -> dict[str, str]:
    env = {**os.environ, "PROCCKPT_LOG_LEVEL": "WARNING"}
    env.pop("PROCCKPT_TOKEN", None)
    return env


def set_up(loader: str, position: int, args: argparse.Namespace, work: Path) -> Path:
    """A checkpoint dir holding a checkpoint at batch ``position`` (written once, not timed)."""
    d = work / f"setup-{loader}-{position}"
    done = subprocess.run([*child_argv(loader, d, args), "--save-at", str(position)],
                          env={**child_env(), "BENCH_T0": "0"}, capture_output=True, text=True,
                          timeout=3600)
    if not any((d / "checkpoints").glob("ckpt-*")):  # it stops with 75, as a stop does
        raise SystemExit(f"the set-up run wrote no checkpoint:\n{done.stderr[-2000:]}")
    return d


def measure(loader: str, setup: Path | None, args: argparse.Namespace,
            work: Path) -> tuple[float, float | None]:
    """Seconds from process start to the first trained batch, resuming from a copy of
    ``setup`` (None: a fresh start); and the seconds the resume took to pass over the batches
    already trained on (from the run's journal)."""
    d = work / f"{loader}-{time.monotonic_ns()}"
    if setup is not None:
        shutil.copytree(setup, d)
    out = subprocess.run(child_argv(loader, d, args),
                         env={**child_env(), "BENCH_T0": repr(time.time())}, check=True,
                         capture_output=True, text=True, timeout=3600)
    first = float(json.loads(out.stdout.strip().splitlines()[-1])["first_batch"])
    skip = None
    journal = d / "events.jsonl"
    if setup is not None and journal.exists():
        for line in journal.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "resume-skip":
                skip = float(event["seconds"])
    shutil.rmtree(d, ignore_errors=True)
    return first, skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--late", type=int, default=5000)
    p.add_argument("--sample-cost", type=float, default=0.0005)
    p.add_argument("--repeats", type=int, default=9)
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
    skips: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="procckpt-resume-") as tmp:
        work = Path(tmp)
        setups = {(loader, name): set_up(loader, position, args, work)
                  for loader in loaders for name, position in positions.items()
                  if position is not None}
        for r in range(args.repeats):
            for loader in loaders:
                for name in positions:
                    t, skip = measure(loader, setups.get((loader, name)), args, work)
                    times.setdefault((loader, name), []).append(t)
                    if skip is not None:
                        skips.setdefault((loader, name), []).append(skip)
                    print(f"  repeat {r + 1}: {loader:9} {name:5} first batch after {t:.2f}s",
                          file=sys.stderr, flush=True)
    print(f"time to the first trained batch, median of {args.repeats} (sample cost "
          f"{args.sample_cost * 1e3:g} ms, batches of 10; late = batch {args.late}):")
    print(f"{'loader':10} {'fresh':>7} {'early':>7} {'late':>7} {'late/early':>11} "
          f"{'early/fresh':>12} {'late/fresh':>11} {'skip early':>11} {'skip late':>10}")
    for loader in loaders:
        m = {name: statistics.median(times[(loader, name)]) for name in positions}
        k = {name: (f"{statistics.median(skips[(loader, name)]) * 1e3:.1f} ms"
                    if skips.get((loader, name)) else "-") for name in ("early", "late")}
        print(f"{loader:10} {m['fresh']:7.2f} {m['early']:7.2f} {m['late']:7.2f} "
              f"{m['late'] / m['early']:11.2f} {m['early'] / m['fresh']:12.2f} "
              f"{m['late'] / m['fresh']:11.2f} {k['early']:>11} {k['late']:>10}")
    print("skip: the resume's own time to pass over the trained batches (the journal's "
          "resume-skip), medians")
    print("targets: late/early <= 1.10, early/fresh and late/fresh <= 1.2")
    print(f"re-seeding before each sample in a worker (what makes the skip exact there): "
          f"{seeding_cost() * 1e6:.1f} us per sample (median of 5 x 2,000)")


def seeding_cost() -> float:
    """Seconds per sample that procckpt's per-sample seeding adds in a worker process."""
    import timeit

    import numpy  # noqa: F401 - seeded too when a script has imported it

    from procckpt.training.position.loaders import sample_seed, seed_streams

    runs = timeit.repeat(lambda: seed_streams(sample_seed(12345, 678)), number=2000, repeat=5)
    return statistics.median(runs) / 2000


if __name__ == "__main__":
    main()
