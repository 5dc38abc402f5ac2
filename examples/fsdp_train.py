"""Sharded (FSDP2) training: each rank holds and checkpoints only its shard of the model and
of the optimizer state, through torch.distributed.checkpoint (DCP).

Same synthetic task as ddp_train.py. The model and AdamW are wrapped in procckpt.Sharded, so
every rank writes its own shards into the checkpoint, and a checkpoint can be resumed with
another number of ranks when the Checkpointer is given allow_reshard=True (--reshard).

    torchrun --nproc-per-node 2 examples/fsdp_train.py
    procckpt run --time-limit 40s --grace 10s -- torchrun --standalone --nproc-per-node 2 \\
        examples/fsdp_train.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import procckpt


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to pause per step")
    parser.add_argument("--backend", default=None, help="gloo or nccl [nccl if every local rank "
                        "can have a GPU of its own]")
    parser.add_argument("--reshard", action="store_true",
                        help="accept a checkpoint written by another number of ranks")
    parser.add_argument("--out", default=None, help="rank 0 saves the full final model and each "
                        "rank a draw from its RNG to OUT.rank<N>.pt")
    args = parser.parse_args()

    rank, world, local_rank = procckpt.init_distributed(args.backend)
    device = torch.device("cpu")
    # A GPU per rank where the group runs on NCCL (procckpt picks it when every local rank
    # can have one); one process uses the GPU if there is one.
    nccl = world > 1 and dist.get_backend() == "nccl"
    if nccl or (world == 1 and torch.cuda.is_available() and args.backend != "gloo"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # one process: a group of one, so that FSDP has a mesh
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64),
                          nn.ReLU(), nn.Linear(64, 8)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(args.seed + 1000 * rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    data = Blobs(args.train_size, seed=args.seed)
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = procckpt.Checkpointer(train=procckpt.Sharded(model, optimizer), scheduler=scheduler,
                                 allow_reshard=args.reshard)
    if rank == 0:
        print(f"start: epoch {ckpt.epoch}, batch {ckpt.batch}, {world} rank(s)", flush=True)
    for epoch in ckpt.epochs(args.epochs):
        sampler.set_epoch(epoch)
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

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if args.out:
        torch.save({"model": full if rank == 0 else {}, "draw": torch.randn(4)},
                   f"{args.out}.rank{rank}.pt")
    if rank == 0:
        print("done", flush=True)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
