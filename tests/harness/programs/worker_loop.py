"""A training script that knows nothing about procckpt and reads its data through
``DataLoader(num_workers=2)``: the CRIU engine's test (whole process trees).

A small MLP under SGD with momentum, dropout, a shuffling sampler with its own generator and
noise drawn in the workers; prints ``step N`` after each step and saves the final weights,
optimizer state and a draw of the random stream to ``--out``. Nothing in it can resume: a
restarted cycle continues from the process image.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(16), self.y[i]  # the worker's own stream


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Noisy(args.n), batch_size=16, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(5))
    step = 0
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            print(f"step {step} epoch {epoch} loss {loss.item():.4f}", flush=True)
            time.sleep(args.step_sleep)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "draw": torch.randn(4)}, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
