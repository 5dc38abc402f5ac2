"""Data-parallel (DDP) training of a small classifier on synthetic data, on CPU or GPU.

What makes an exact resume hard here: a shuffling DistributedSampler, dropout and a random
augmentation drawn from each rank's own random stream, SGD with momentum and a learning-rate
schedule. The procckpt lines are marked. Runs with or without the launcher, with one process
or many:

    python examples/ddp_train.py
    torchrun --nproc-per-node 2 examples/ddp_train.py
    procckpt run --time-limit 40s --grace 10s -- torchrun --standalone --nproc-per-node 2 \\
        examples/ddp_train.py
    srun --ntasks 2 python examples/ddp_train.py        # inside a Slurm allocation
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import procckpt  # procckpt 1/4


class Blobs(Dataset):
    """Points around 8 class centres in 32 dimensions; each access adds fresh noise."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = 3 * torch.randn((8, 32), generator=g)
        self.labels = torch.randint(0, 8, (n,), generator=g)
        self.points = centres[self.labels] + torch.randn((n, 32), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[index] + 0.2 * torch.randn(32), self.labels[index]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to pause per step")
    parser.add_argument("--backend", default=None, help="gloo or nccl [nccl if every local rank "
                        "can have a GPU of its own]")
    parser.add_argument("--out", default=None, help="each rank saves its final state to "
                        "OUT.rank<N>.pt (parameters, optimizer, a draw from its RNG)")
    args = parser.parse_args()

    rank, world, local_rank = procckpt.init_distributed(args.backend)  # procckpt 2/4
    device = torch.device("cpu")
    # A GPU per rank where the group runs on NCCL (procckpt picks it when every local rank
    # can have one); one process uses the GPU if there is one.
    nccl = world > 1 and dist.get_backend() == "nccl"
    if nccl or (world == 1 and torch.cuda.is_available() and args.backend != "gloo"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_model().to(device)
    torch.manual_seed(args.seed + 1000 * rank)  # each rank its own dropout and noise
    if world > 1:
        model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda"
                                        else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = Blobs(args.train_size, seed=args.seed)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer,  # procckpt 3/4
                                 scheduler=scheduler)
    if rank == 0:
        print(f"start: epoch {ckpt.epoch}, batch {ckpt.batch}, {world} rank(s)", flush=True)
    for epoch in ckpt.epochs(args.epochs):  # procckpt 4/4 (and ckpt.batches below)
        sampler.set_epoch(epoch)
        model.train()
        total = 0.0
        for x, y in ckpt.batches(loader):
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            if args.sleep:
                time.sleep(args.sleep)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} | loss {total / max(1, len(loader)):.4f}", flush=True)

    if args.out:
        plain = model.module if isinstance(model, DistributedDataParallel) else model
        torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict(),
                    "draw": torch.randn(4)}, f"{args.out}.rank{rank}.pt")
    if rank == 0:
        print("done", flush=True)
    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
