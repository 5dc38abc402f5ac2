"""A small training run for the async-checkpoint tests: an MLP with dropout and Adam on
shuffled random data, so that an exact resume needs the model, the optimizer, every RNG and
the loader position.

Test knobs: ``--write-pause`` slows each written piece down (``--chunk`` bytes) so that a test
can act while a background write is in flight; ``--crash-at`` raises an exception after that
step; ``--out`` saves the final parameters for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import procckpt
from procckpt.training.save import writer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--interval", type=float, default=None)
    p.add_argument("--sync", action="store_true", help="async_save=False")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--write-pause", type=float, default=0.0)
    p.add_argument("--chunk", type=int, default=0)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.write_pause:
        writer.StreamingFileWriter.pause_per_chunk = args.write_pause
    if args.chunk:
        writer.CHUNK = args.chunk

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 16), torch.randn(args.samples, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(args.width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = procckpt.Checkpointer(args.dir, model=model, optimizer=optimizer,
                                 interval=args.interval, save_every=None,
                                 async_save=False if args.sync else None)
    print(f"start step {ckpt.step}", flush=True)
    for _epoch in ckpt.epochs(args.epochs):
        for x, y in ckpt.batches(loader):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"step {ckpt.step + 1}", flush=True)
            if args.crash_at is not None and ckpt.step + 1 == args.crash_at:
                raise RuntimeError(f"crash at step {args.crash_at} (on purpose)")
            if args.step_sleep:
                time.sleep(args.step_sleep)
    if args.out:
        torch.save(model.state_dict(), args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
