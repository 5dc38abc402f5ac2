"""What a mid-epoch resume costs, early and late in the epoch.

One epoch of a map-style data set whose samples cost ``--sample-cost`` seconds each to read
(decoding, augmenting), batches of 10. For each loader (no workers; 2 workers; torchdata's
StatefulDataLoader when installed) it measures, in fresh processes, the time from process
start to the first trained batch of:

    fresh      a start with no checkpoint
    early      a resume at batch 10 of the epoch
    late       a resume at batch --late (5,000 by default) of the epoch

Two more loaders read a stream instead (examples/streaming_train.py's data: 32 JSON Lines
files, texts tokenized at the same cost a sample): ``stream``, Hugging Face ``datasets`` with
``streaming=True`` through ``procckpt.ShuffleBuffer`` and a StatefulDataLoader with 2 workers
(resumed by its state), and ``stream-plain``, an iterable without state through a plain
DataLoader with 2 workers (replayed); they need ``datasets`` and torchdata.

The checkpoints to resume from are written once; each measurement resumes from a fresh
copy. Each is run --repeats times, interleaved; medians are printed with the ratios the target
names: late / early (<= 1.10) and each / fresh (<= 1.2). It also prints what the per-sample
seeding of worker processes costs per sample.

    python benchmarks/resume_cost.py [--late 5000] [--sample-cost 0.0005] [--repeats 9]
        [--loaders plain,workers,torchdata,stream,stream-plain]
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
EXAMPLES = HERE.parent.parent / "examples"
STREAMS = ("stream", "stream-plain")
#: The stream's files: enough samples for the late position.
STREAM_FILES = 32


def busy(seconds: float) -> None:
    until = time.perf_counter() + seconds  # busy, like decoding
    while time.perf_counter() < until:
        pass


def stream_loader(args: argparse.Namespace) -> object:
    """The stream's loader: Hugging Face's streamed files through a ShuffleBuffer and a
    StatefulDataLoader (``stream``), or the plain iterable (``stream-plain``), 2 workers."""
    sys.path.insert(0, str(EXAMPLES))
    import procckpt
    import streaming_train as example

    files = sorted(Path(args.data).glob("*.jsonl"))
    example.READ_COST = args.sample_cost
    if args.loader == "stream-plain":
        from torch.utils.data import DataLoader

        return DataLoader(example.LinesWithoutState(files), batch_size=10, num_workers=2)
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = procckpt.ShuffleBuffer(example.streamed(files, parquet=False), size=64, seed=0)
    return StatefulDataLoader(data, batch_size=10, num_workers=2)


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
            busy(self.cost)
            return self.x[i] + 0.1 * torch.randn(8)

    if args.loader in STREAMS:
        loader = stream_loader(args)
    else:
        if args.loader == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader as Loader
        else:
            from torch.utils.data import DataLoader as Loader
        loader = Loader(Costly(10 * (args.late + 50), args.sample_cost), batch_size=10,
                        shuffle=True, num_workers=2 if args.loader == "workers" else 0)
    model = nn.EmbeddingBag(512, 1) if args.loader in STREAMS else nn.Linear(8, 1)
    ckpt = procckpt.Checkpointer(args.dir, model=model, save_every=None, async_save=False)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches(loader):
            model(x["tokens"] if isinstance(x, dict) else x).sum().backward()
            if args.save_at is not None:  # the set-up run: checkpoint there, then stop
                if ckpt.batch + 1 == args.save_at:
                    ckpt.request_checkpoint(stop=True)
                continue
            print(json.dumps({"first_batch": time.time() - started}), flush=True)
            os._exit(0)


def child_argv(loader: str, d: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(HERE), "--child", "--loader", loader, "--dir", str(d),
            "--late", str(args.late), "--sample-cost", str(args.sample_cost),
            "--data", str(args.data)]


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
    p.add_argument("--loaders", default="plain,workers,torchdata,stream,stream-plain")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--loader", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--save-at", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    loaders = [name for name in args.loaders.split(",") if name]
    for module, needed_by in (("torchdata", ("torchdata", "stream")), ("datasets", ("stream",))):
        try:
            __import__(module)
        except ImportError:
            print(f"{module} is not installed: left out {', '.join(needed_by)}",
                  file=sys.stderr)
            loaders = [name for name in loaders if name not in needed_by]
    positions = {"fresh": None, "early": 10, "late": args.late}
    times: dict[tuple[str, str], list[float]] = {}
    skips: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="procckpt-resume-") as tmp:
        work = Path(tmp)
        if any(name in STREAMS for name in loaders):
            sys.path.insert(0, str(EXAMPLES))
            import streaming_train

            args.data = str(work / "stream-data")
            rows = -(-10 * (args.late + 50) // STREAM_FILES)
            streaming_train.make_data(Path(args.data), STREAM_FILES, rows, parquet=False)
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
                    print(f"  repeat {r + 1}: {loader:12} {name:5} first batch after {t:.2f}s",
                          file=sys.stderr, flush=True)
    print(f"time to the first trained batch, median of {args.repeats} (sample cost "
          f"{args.sample_cost * 1e3:g} ms, batches of 10; late = batch {args.late}):")
    print(f"{'loader':12} {'fresh':>7} {'early':>7} {'late':>7} {'late/early':>11} "
          f"{'early/fresh':>12} {'late/fresh':>11} {'skip early':>11} {'skip late':>10}")
    for loader in loaders:
        m = {name: statistics.median(times[(loader, name)]) for name in positions}
        k = {name: (f"{statistics.median(skips[(loader, name)]) * 1e3:.1f} ms"
                    if skips.get((loader, name)) else "-") for name in ("early", "late")}
        print(f"{loader:12} {m['fresh']:7.2f} {m['early']:7.2f} {m['late']:7.2f} "
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
