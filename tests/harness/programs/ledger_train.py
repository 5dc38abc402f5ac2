"""DDP over gloo (CPU) on a data set of sample indices, dealt out by a shuffling
DistributedSampler, that writes every index it trains on to a ledger (a file a rank and run):
for the tests of a resume with another number of ranks, which count how often each sample of
an epoch was trained on. The Checkpointer allows resharding (a changed world size).

With ``--fsdp`` the model is sharded over the ranks (FSDP2) and saved through DCP with its
AdamW state (``procckpt.Sharded``); rank 0 writes the full weights the run started from
(after any resume) to ``NAME-start.pt`` in the ledger directory."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
    parser.add_argument("--fsdp", action="store_true", help="shard the model (FSDP2)")
    args = parser.parse_args()

    rank, world, _ = procckpt.init_distributed("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(args.samples))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    if args.fsdp:
        model = sharded_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        ckpt = procckpt.Checkpointer(train=procckpt.Sharded(model, optimizer),
                                     allow_reshard=True)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if rank == 0:
            torch.save(full, Path(args.ledger) / f"{args.name}-start.pt")
    else:
        model = DistributedDataParallel(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
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


def sharded_model() -> torch.nn.Module:
    """Two linear layers, each and then the whole sharded over the ranks."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
