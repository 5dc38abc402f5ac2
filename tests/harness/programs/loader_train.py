"""A training script for the exactness tests of data loading: a shuffling DataLoader (its own
generator or torch's global one; 0 or more workers) over a data set with a random transform
in ``__getitem__``, dropout in the model. It can request a mid-epoch checkpoint and kill itself
(SIGKILL: no clean-up of any kind) at given steps of its first start, so that the rerun must
resume from what is on disk.

Prints "resumed E B S" (epoch, batch, step of the resume, "-" on a fresh start) and "step N"."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import procckpt


class NoisyBlobs(Dataset):
    """Two Gaussian blobs; each sample gets fresh noise when it is read (a random transform)."""

    def __init__(self, n: int, cost: float = 0.0, own_rng: bool = False,
                 coin_flip: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.cost = cost  # seconds of work (decoding, augmenting) per sample
        # The noise from a generator the data set owns instead of torch's global stream.
        self.rng = torch.Generator().manual_seed(2) if own_rng else None
        # A sign flip with probability 1/2 from a NumPy generator of its own (seed 5: its first
        # two draws give the same outcome, so two loads of one sample agree by chance).
        self.coin = __import__("numpy").random.default_rng(5) if coin_flip else None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cost:
            time.sleep(self.cost)
        x = self.x[i] + 0.1 * torch.randn(8, generator=self.rng)
        if self.coin is not None and self.coin.random() < 0.5:
            x = -x
        return x, self.y[i]


def coin_per_worker(worker_id: int) -> None:
    """A worker_init_fn that gives the worker's data set a coin of its own (torch's docs: set
    a worker up through get_worker_info().dataset)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    info.dataset.coin = __import__("numpy").random.default_rng(info.seed % 2**32)


class OwnStatefulLoader:
    """A stateful loader of the script's own: a shuffled order per epoch from a seed and the
    epoch number, resumable from (epoch, position) through state_dict()/load_state_dict()."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int) -> None:
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.position, self._restored = 0, 0, False

    def __iter__(self):
        if not self._restored:
            self.position = 0
        self._restored = False
        order = torch.randperm(len(self.dataset),  # type: ignore[arg-type]
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position * self.batch_size < len(order):
            chosen = order[self.position * self.batch_size:(self.position + 1) * self.batch_size]
            self.position += 1
            xs, ys = zip(*(self.dataset[int(i)] for i in chosen))
            yield torch.stack(xs), torch.stack(ys)
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._restored = state["epoch"], state["position"], True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n", type=int, default=96)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--generator", action="store_true", help="DataLoader(generator=...)")
    parser.add_argument("--checkpoint-at-step", type=int, default=None,
                        help="on the first start, ask for a checkpoint after this step")
    parser.add_argument("--kill-at-step", type=int, default=None,
                        help="on the first start, SIGKILL this process after this step")
    parser.add_argument("--break-at-step", type=int, default=None,
                        help="leave the epochs loop with break after this step")
    parser.add_argument("--first-start-marker", default="first-start.done")
    parser.add_argument("--loader", choices=("torch", "torchdata", "own"), default="torch",
                        help="torch's DataLoader, torchdata's StatefulDataLoader, or a stateful "
                             "loader of the script's own")
    parser.add_argument("--sample-cost", type=float, default=0.0,
                        help="seconds of work per sample read")
    parser.add_argument("--own-rng", action="store_true",
                        help="the data set draws its noise from a generator of its own")
    parser.add_argument("--coin-flip", action="store_true",
                        help="a sign flip with probability 1/2 from the data set's own generator")
    parser.add_argument("--coin-in-worker-init", action="store_true",
                        help="the coin's generator is made in worker_init_fn, on the worker's "
                             "data set (get_worker_info().dataset), seeded by the worker's seed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(7) if args.generator else None
    data = NoisyBlobs(args.n, args.sample_cost, args.own_rng, args.coin_flip)
    if args.loader == "own":
        loader = OwnStatefulLoader(data, batch_size=8, seed=7)
    else:
        if args.loader == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
        else:
            from torch.utils.data import DataLoader
        loader = DataLoader(data, batch_size=8, shuffle=True, generator=generator,
                            num_workers=args.workers, persistent_workers=args.persistent_workers,
                            worker_init_fn=coin_per_worker if args.coin_in_worker_init else None)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    first_start = not Path(args.first_start_marker).exists()
    Path(args.first_start_marker).touch()
    resumed = ckpt.resumed_from is not None
    print(f"resumed {ckpt.epoch} {ckpt.batch} {ckpt.step}" if resumed else "resumed - - -",
          flush=True)
    for _epoch in ckpt.epochs(args.epochs):
        for xb, yb in ckpt.batches(loader):
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step = ckpt.step + 1
            print(f"step {step}", flush=True)
            if first_start and step == args.checkpoint_at_step:
                ckpt.request_checkpoint()
            if first_start and step == args.kill_at_step:
                ckpt.flush()  # the requested checkpoint (if any) is on disk
                os.kill(os.getpid(), signal.SIGKILL)
        if args.break_at_step is not None and ckpt.step >= args.break_at_step:
            break
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
