"""A fine-tune of a frozen base: low-rank adapters (LoRA's shape) trained with AdamW on top of
linear layers that do not train.

procckpt writes the frozen weights (``requires_grad=False``) once, into chunks that every
later checkpoint shares: after the first, a checkpoint writes the adapters, their optimizer
state and the loop's position, a few percent of the state. ``procckpt status DIR`` shows each
checkpoint's SIZE (the whole state) beside WRITTEN (what writing it cost).

    procckpt run --time-limit 1m -- python examples/finetune_frozen.py
    procckpt status procckpt-ckpt

Under torchrun it trains data-parallel (DDP over gloo); rank 0 writes the frozen weights once:

    procckpt run --time-limit 1m -- torchrun --standalone --nproc-per-node 2 \
        examples/finetune_frozen.py

With ``--fsdp`` the model is sharded over the ranks instead (FSDP2's ``fully_shard``): each
rank holds a slice of every weight, frozen ones included, and the first checkpoint writes the
frozen slices once, as a set of their own that later checkpoints share and that loads into
another number of ranks too.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import procckpt


class Adapted(nn.Module):
    """A frozen linear layer plus a trained low-rank update: ``W x + B A x``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        nn.init.zeros_(self.up.weight)  # training starts from the base model itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + self.up(self.down(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--out", default=None, help="save the final parameters here")
    parser.add_argument("--fsdp", action="store_true", help="shard the model (under torchrun)")
    args = parser.parse_args()

    group = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun
    if group:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[Adapted(args.width, args.rank) for _ in range(args.layers)],
                          nn.Linear(args.width, 2))
    x = torch.randn(args.n, args.width)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    if group and args.fsdp:
        model = sharded(model)
    elif group:
        model = DistributedDataParallel(model)  # syncs the gradients of what trains only
    if group:
        loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))
    else:
        loader = DataLoader(data, batch_size=32, shuffle=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)

    if args.fsdp and group:  # each rank saves its own shards (through DCP)
        ckpt = procckpt.Checkpointer(args.ckpt_dir, train=procckpt.Sharded(model, optimizer),
                                     allow_reshard=True)
    else:
        ckpt = procckpt.Checkpointer(args.ckpt_dir, model=model, optimizer=optimizer)
    print(f"start step {ckpt.step}", flush=True)
    for epoch in ckpt.epochs(args.epochs):                                         # procckpt
        loss = None  # a resume at an epoch's last batch has none of it left to train
        for inputs, labels in ckpt.batches(loader):                                # procckpt
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_sleep)
        if loss is not None:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    if args.fsdp and group:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if args.out and dist.get_rank() == 0:
            torch.save(full, args.out)
    elif args.out and (not group or dist.get_rank() == 0):
        plain = model.module if group else model
        torch.save(plain.state_dict(), args.out)
    if group:
        dist.destroy_process_group()


def sharded(model: nn.Module) -> nn.Module:
    """``model`` sharded over the ranks with FSDP2: each layer, then the whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


if __name__ == "__main__":
    main()
