"""An Accelerate training script with procckpt's three lines around the prepared model,
optimizer and loader: a shuffling DataLoader (0 or more workers) over a data set with a random
transform in ``__getitem__``, dropout, a step-wise LR schedule. Writes the final weights to
``--out``. Under torchrun with ``--ddp``: DDP over gloo, one CPU process a rank (Accelerate
finds the group from torchrun's environment).

Prints "step N" after each step."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

import procckpt


class NoisyBlobs(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]  # a random transform


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n", type=int, default=160)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--hang-at-step", type=int, default=None,
                        help="on the first start, sleep for an hour in this step")
    parser.add_argument("--ddp", action="store_true", help="(torchrun sets up the group)")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not args.cuda)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
    loader = DataLoader(NoisyBlobs(args.n), batch_size=8, shuffle=True,
                        num_workers=args.workers)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)

    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler)
    marker = Path("hung-once")
    for _epoch in ckpt.epochs(args.epochs):
        for x, y in ckpt.batches(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            step = ckpt.step + 1
            if step == args.hang_at_step and not marker.exists():
                marker.touch()
                time.sleep(3600)  # stuck: only the hang timeout ends this
            print(f"step {step}", flush=True)
    if args.out and accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.cpu() for k, v in state.items()}, args.out)


if __name__ == "__main__":
    main()
