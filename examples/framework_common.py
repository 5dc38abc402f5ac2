"""What the framework programs (lightning_train.py, transformers_train.py, accelerate_train.py)
share: their command line, and a data set with a random transform."""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--n", "--samples", dest="n", type=int, default=160,
                   help="samples in the data set (--samples under torchrun, whose own "
                        "options --n would abbreviate)")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="on the first start, sleep for an hour in this step")
    p.add_argument("--ddp", action="store_true", help="DDP over gloo (under torchrun)")
    p.add_argument("--cuda", action="store_true", help="train on the GPU")
    p.add_argument("--out", default=None)
    return p


class NoisyBlobs(Dataset):
    """Two Gaussian blobs; each sample gets fresh noise when it is read (a random transform)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]
