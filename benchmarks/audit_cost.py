"""What the first-batch audit (training/audit.py) costs a training.

Three costs, each as a ratio to a training step measured in the same run (an MLP of width
--width on batches of --batch samples of --features floats, forward, backward, SGD step):

    per batch       the audited pass's bookkeeping for each batch it hands out (a position
                    and a reference kept), against iterating the same batches unaudited
                    (batches already in memory, so that only the bookkeeping differs)
    per checkpoint  recording the batch after a checkpoint, on the training's path: its
                    CRC-32 and the record handed to the audit's writer thread (the target:
                    <= 1 % of a step)
    per resume      the record read, and the first batch's CRC compared with it
    per stop        reading one more batch from the loader after a stop's checkpoint (here a
                    DataLoader without workers over an in-memory data set)

Each is the median of --repeats rounds; the ratios, not the times, are what to compare
between machines.

    python benchmarks/audit_cost.py [--batch 256] [--features 1024] [--width 2048]
        [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from procckpt.training.audit import BatchAudit


class Position:
    """The Progress fields the audit reads, advanced as batches() advances them."""

    def __init__(self) -> None:
        self.epoch, self.batch, self.step = 0, 0, 0
        self.remapped = False


def refuse(message: str):
    raise SystemExit(message)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)

    data = TensorDataset(torch.randn(args.batch * args.batches, args.features),
                         torch.randint(10, (args.batch * args.batches,)))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    model = nn.Sequential(nn.Linear(args.features, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = next(iter(loader))

    def step() -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    in_memory = list(loader)
    with tempfile.TemporaryDirectory() as root:
        audit = BatchAudit(Path(root), 0, "warn", None, refuse)
        checkpoints = iter(range(10**9))

        def plain_pass() -> None:
            for _ in iter(in_memory):
                pass

        def audited_pass() -> None:
            position = Position()
            for _ in audit.wrap(iter(in_memory), position):
                position.batch += 1
                position.step += 1

        def record() -> None:
            k = next(checkpoints)
            audit.saved((0, k, k))
            audit.handed_out((0, k, k), batch)

        def one_more_batch() -> None:
            next(iter(loader))

        step()  # warm up
        step_s = median_seconds(step, args.repeats)
        plain_s = median_seconds(plain_pass, args.repeats) / args.batches
        audited_s = median_seconds(audited_pass, args.repeats) / args.batches
        record_s = median_seconds(record, args.repeats)
        audit.flush()
        last = next(checkpoints) - 1

        def compare() -> None:
            resumed = BatchAudit(Path(root), 0, "warn", None, refuse)
            resumed.resumed("ckpt", (0, last, last))
            position = Position()
            position.batch = position.step = last
            next(iter(resumed.wrap(iter([batch]), position)))
            assert resumed.verdict == "same", resumed.verdict

        compare_s = median_seconds(compare, args.repeats)
        read_s = median_seconds(one_more_batch, args.repeats)

    mb = args.batch * args.features * 4 / 1e6
    print(f"step (batch {args.batch}x{args.features}, {mb:.1f} MB; width {args.width}): "
          f"{step_s * 1e3:.2f} ms, median of {args.repeats}")
    print(f"per batch:      {(audited_s - plain_s) * 1e6:+.1f} us over an unaudited pass "
          f"= {(audited_s - plain_s) / step_s:+.3%} of a step")
    print(f"per checkpoint: {record_s * 1e3:.3f} ms to fingerprint and record = "
          f"{record_s / step_s:.3%} of a step (target <= 1 %)")
    print(f"per resume:     {compare_s * 1e3:.3f} ms to read the record and compare = "
          f"{compare_s / step_s:.3%} of a step")
    print(f"per stop:       {read_s * 1e3:.3f} ms to read one more batch = "
          f"{read_s / step_s:.3%} of a step")


if __name__ == "__main__":
    main()
