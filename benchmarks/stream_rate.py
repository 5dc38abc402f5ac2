"""How fast the documented streaming recipe reads, beside the same pipeline in a plain DataLoader.

The recipe (docs/resume.md, examples/streaming_train.py): Hugging Face ``datasets`` with
``streaming=True`` over local JSON Lines files, each sample tokenized at ``--sample-cost``
seconds, through ``procckpt.ShuffleBuffer`` (``--buffer`` samples), batches of 8, 2 worker
processes, torchdata's StatefulDataLoader (which asks each worker for its data set's state
after every batch: its default snapshot period), read through ``ckpt.batches()``. Against:

    plain       the same ShuffleBuffer in a plain DataLoader, no procckpt (no state at all)
    stateful    the recipe's loader, no procckpt
    recipe      the recipe's loader through ckpt.batches() (procckpt's position bookkeeping)

No training step: batches per second after the first --warm, over --batches, each loader in
its own fresh iteration, --repeats interleaved rounds. Prints each round, the medians and the
ratios to ``plain`` taken within each round (median). Target: recipe / plain >= 0.9.

    python benchmarks/stream_rate.py [--batches 400] [--repeats 5] [--buffer 256]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve()
EXAMPLES = HERE.parent.parent / "examples"
LOADERS = ("plain", "stateful", "recipe")


def rate(kind: str, files: list[Path], args: argparse.Namespace, ckpt_dir: Path) -> float:
    """Batches per second of one fresh iteration of loader ``kind``."""
    import torch
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    import procckpt
    import streaming_train as example

    data = procckpt.ShuffleBuffer(example.streamed(files, False), size=args.buffer, seed=0)
    loader = (DataLoader if kind == "plain" else StatefulDataLoader)(
        data, batch_size=8, num_workers=2)
    ckpt = None
    if kind == "recipe":
        ckpt = procckpt.Checkpointer(dir=ckpt_dir, model=torch.nn.Linear(2, 2), interval=None)
        batches = ckpt.batches(loader)
    else:
        batches = iter(loader)
    seen, started = 0, 0.0
    for _ in batches:
        seen += 1
        if seen == args.warm:
            started = time.perf_counter()
        elif seen == args.warm + args.batches:
            break
    seconds = time.perf_counter() - started
    if ckpt is not None:
        ckpt.close()
    # Shut the workers down here: an iterator left to the garbage collector may be collected
    # in the next loader's forked workers, which cannot stop another's children.
    del batches, loader, ckpt
    gc.collect()
    return args.batches / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--buffer", type=int, default=256)
    p.add_argument("--sample-cost", type=float, default=0.0003)
    args = p.parse_args()
    # torchdata 0.11 warns at every loader it makes that torch.set_vital is deprecated.
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    for module in ("torchdata", "datasets"):
        try:
            __import__(module)
        except ImportError:
            sys.exit(f"{module} is not installed: pip install torchdata datasets")
    sys.path.insert(0, str(EXAMPLES))
    import streaming_train as example

    example.READ_COST = args.sample_cost  # the workers fork from here: theirs too
    rates: dict[str, list[float]] = {k: [] for k in LOADERS}
    ratios: dict[str, list[float]] = {k: [] for k in LOADERS[1:]}
    with tempfile.TemporaryDirectory(prefix="procckpt-stream-rate-", dir=".") as tmp:
        work = Path(tmp)
        samples = 8 * (args.warm + args.batches) + args.buffer + 16
        files = 8
        example.make_data(work / "data", files, -(-samples // files), parquet=False)
        paths = sorted((work / "data").glob("*.jsonl"))
        os.environ.pop("PROCCKPT_DIR", None)
        for r in range(args.repeats):
            order = LOADERS if r % 2 == 0 else tuple(reversed(LOADERS))
            got = {k: rate(k, paths, args, work / f"ckpt-{r}-{k}") for k in order}
            for k in LOADERS:
                rates[k].append(got[k])
            for k in LOADERS[1:]:
                ratios[k].append(got[k] / got["plain"])
            print(f"  round {r + 1}: " + "  ".join(f"{k} {got[k]:6.1f}" for k in LOADERS)
                  + " batches/s", file=sys.stderr, flush=True)
    print(f"batches per second, median of {args.repeats} rounds ({args.batches} batches of 8 "
          f"after {args.warm}; buffer {args.buffer}; sample cost {args.sample_cost * 1e3:g} ms; "
          f"2 workers; no training step):")
    print(f"{'loader':10} {'batches/s':>10} {'/ plain':>8}")
    for k in LOADERS:
        ratio = f"{statistics.median(ratios[k]):8.2f}" if k in ratios else f"{'-':>8}"
        print(f"{k:10} {statistics.median(rates[k]):10.1f} {ratio}")
    print("/ plain: the median of the ratios taken within each round; target: recipe >= 0.9")


if __name__ == "__main__":
    main()
