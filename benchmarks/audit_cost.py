"""What the resume audit (training/audit.py) costs a training.

Measured in one run, each the median of --repeats rounds:

    per batch       the audited pass's bookkeeping for each batch it hands out (a position
                    and a reference kept), against iterating the same batches unaudited, as a
                    share of a training step (an MLP on 1 MB batches)
    per checkpoint  recording the batch after a checkpoint, on the training's path: its
                    fingerprint and the record handed to the audit's writer thread
    per resume      the record read and the first batch compared, and the state the first
                    step starts from: the model's and optimizer's tensors fingerprinted as
                    restored and again when the first step begins (--state-mb of them)
    per stop        reading one more batch from a DataLoader after a stop's checkpoint

at batches of --sizes MB, each laid out three ways: contiguous; permuted (a transpose, which
fills its span of memory: read as it lies); sliced (every other column: read in 4 MB pieces
through one host buffer, as a GPU batch is). The checkpoint's and the resume's batch costs are
also given as a ratio to one copy of the batch's bytes (``clone()``), which does not depend on
the machine's speed; the per-batch cost as a ratio to the step.

    python benchmarks/audit_cost.py [--sizes 1,64,512] [--state-mb 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from procckpt.training.audit import BatchAudit
from procckpt.training.state.first_step import StateExpectation, live_state, restored_state

FEATURES = 1024


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


def layouts(mb: int) -> dict[str, torch.Tensor]:
    """A batch of ``mb`` MB of float32 rows of FEATURES, laid out three ways."""
    rows = max(1, mb * 2**20 // (4 * FEATURES))
    contiguous = torch.randn(rows, FEATURES)
    return {"contiguous": contiguous,
            "permuted": torch.randn(FEATURES, rows).t(),
            "sliced": torch.randn(rows, 2 * FEATURES)[:, ::2]}


def per_batch(repeats: int) -> tuple[float, float]:
    """The audited pass's bookkeeping per batch, and a step on a 1 MB batch (seconds)."""
    batches = [(torch.randn(256, FEATURES), torch.randint(10, (256,))) for _ in range(64)]
    model = nn.Sequential(nn.Linear(FEATURES, 2048), nn.ReLU(), nn.Linear(2048, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        x, y = batches[0]
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    with tempfile.TemporaryDirectory() as root:
        audit = BatchAudit(Path(root), 0, "warn", None, refuse)

        def plain_pass() -> None:
            for _ in iter(batches):
                pass

        def audited_pass() -> None:
            position = Position()
            for _ in audit.wrap(iter(batches), position):
                position.batch += 1
                position.step += 1

        step()
        step_s = median_seconds(step, repeats)
        extra = (median_seconds(audited_pass, repeats)
                 - median_seconds(plain_pass, repeats)) / len(batches)
    return extra, step_s


def state_of(mb: int) -> dict[str, Any]:
    """A model of ``mb`` MB of parameters and its Adam optimizer after one step (twice that)."""
    width = 1024
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(max(1, mb // 4))])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def batch_costs(batch: torch.Tensor, root: Path, repeats: int) -> dict[str, float]:
    """Seconds to record ``batch`` after a checkpoint, and to compare it at a resume."""
    audit = BatchAudit(root, 0, "warn", None, refuse)
    keys = iter(range(10**9))

    def record() -> None:
        k = next(keys)
        audit.saved((0, k, k))
        audit.handed_out((0, k, k), (batch, 7))

    record_s = median_seconds(record, repeats)
    audit.flush()
    last = next(keys) - 1

    def compare() -> None:
        resumed = BatchAudit(root, 0, "warn", None, refuse)
        resumed.resumed("ckpt", (0, last, last))
        position = Position()
        position.batch = position.step = last
        next(iter(resumed.wrap(iter([(batch, 7)]), position)))
        assert resumed.verdict == "same", resumed.verdict

    return {"record": record_s, "compare": median_seconds(compare, repeats),
            "copy": median_seconds(batch.clone, repeats)}


def stop_seconds(data: torch.Tensor, rows: int, repeats: int) -> float:
    """Seconds to read one more batch of ``rows`` from a DataLoader (a stop's cost)."""
    loader = DataLoader(TensorDataset(data), batch_size=rows)
    return median_seconds(lambda: next(iter(loader)), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,64,512", help="batch sizes in MB")
    parser.add_argument("--state-mb", type=int, default=64,
                        help="MB of model parameters (the optimizer's state is twice that)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)

    extra, step_s = per_batch(args.repeats)
    print(f"step (MLP, batch 256x{FEATURES}, 1.0 MB): {step_s * 1e3:.2f} ms; per batch handed "
          f"out: {extra * 1e6:+.1f} us = {extra / step_s:+.3%} of a step")

    statefuls = state_of(args.state_mb)
    state_bytes = sum(p.numel() * 4 for p in statefuls["model"].parameters()) * 3

    def state_audit() -> None:  # as restored, then when the first step begins
        prints, counters, advice = restored_state(statefuls, {})
        expectation = StateExpectation(prints, lambda: live_state(statefuls), "", counters)
        assert expectation.problem("ckpt", 0) is None

    state_s = median_seconds(state_audit, args.repeats)
    print(f"state at the first step ({state_bytes / 1e6:.0f} MB of model and Adam state, "
          f"fingerprinted twice): {state_s * 1e3:.1f} ms per resume "
          f"({2 * state_bytes / state_s / 1e9:.1f} GB/s)")
    print()
    print(f"{'batch':>6} {'layout':<11} {'checkpoint':>11} {'resume':>9} {'stop':>9} "
          f"{'checkpoint/copy':>16} {'resume/copy':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for mb in (int(s) for s in args.sizes.split(",")):
            batches = layouts(mb)
            rows = batches["contiguous"].shape[0]
            stop_s = stop_seconds(batches["contiguous"], rows, args.repeats)
            for name, batch in batches.items():
                costs = batch_costs(batch, Path(tmp), args.repeats)
                resume_s = costs["compare"] + state_s
                print(f"{mb:>4}MB {name:<11} {costs['record'] * 1e3:>9.1f}ms "
                      f"{resume_s * 1e3:>7.1f}ms {stop_s * 1e3:>7.1f}ms "
                      f"{costs['record'] / costs['copy']:>16.2f} "
                      f"{costs['compare'] / costs['copy']:>12.2f}")
            del batches
    print()
    print("resume: the batch compared plus the state above; stop: one more batch read (a "
          "DataLoader's collate of one batch); the audit keeps no batch but the newest one "
          "handed out, which the loop holds anyway")


if __name__ == "__main__":
    main()
