"""DDP over gloo (CPU) on a data set of sample indices, dealt out by a shuffling
DistributedSampler, that writes every index it trains on to a ledger (a file a rank and run):
for the tests of a resume with another number of ranks, which count how often each sample of
an epoch was trained on. The Checkpointer allows resharding (a changed world size)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import procckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.25)
    parser.add_argument("--ledger", required=True, help="a directory; RUN-rankR.txt in it")
    parser.add_argument("--name", required=True, help="this run's name in the ledger")
    args = parser.parse_args()

    rank, world, _ = procckpt.init_distributed("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.arange(args.samples))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer, allow_reshard=True)
    ledger = Path(args.ledger) / f"{args.name}-rank{rank}.txt"
    with open(ledger, "a") as out:
        for epoch in ckpt.epochs(args.epochs):
            sampler.set_epoch(epoch)
            for (indices,) in ckpt.batches(loader):
                loss = model(indices.float().unsqueeze(1)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                out.write("".join(f"{epoch} {int(i)}\n" for i in indices))
                out.flush()
                time.sleep(args.step_sleep)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
