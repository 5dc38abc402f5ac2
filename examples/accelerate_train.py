"""An Accelerate training script with procckpt's three lines around the prepared model,
optimizer and loader: a shuffling DataLoader (0 or more workers) over a data set with a random
transform in ``__getitem__``, dropout, a step-wise LR schedule. Writes the final weights to
``--out``. Under torchrun with ``--ddp``: DDP over gloo, one CPU process a rank (Accelerate
finds the group from torchrun's environment). With ``--fsdp``: FSDP2, each rank holding and
saving its shards of the model and of the optimizer state (``procckpt.Sharded``): on CPUs the
model is sharded with ``fully_shard`` and Accelerate prepares the rest (its FSDP plugin runs
only on several GPUs); with ``--cuda``, Accelerate's FSDP plugin (``fsdp_version=2``) does it.

Prints "step N" after each step.

    procckpt run --time-limit 1m -- python examples/accelerate_train.py --epochs 5
    procckpt check -- python examples/accelerate_train.py --accumulate 2
    procckpt run --time-limit 1m -- torchrun --standalone --nproc-per-node 2 \
        examples/accelerate_train.py --fsdp
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

import framework_common
import procckpt


def main() -> None:
    parser = framework_common.parser()
    parser.add_argument("--accumulate", type=int, default=None,
                        help="sum the gradients of this many micro-batches before each "
                             "optimizer step (with accelerator.accumulate)")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 over the ranks of torchrun (see above)")
    args = parser.parse_args()

    torch.manual_seed(0)
    plugin = None
    if args.fsdp and args.cuda:
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=not args.cuda, fsdp_plugin=plugin,
                              gradient_accumulation_steps=args.accumulate or 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    if args.fsdp and not args.cuda:
        shard_on_cpus(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
    loader = DataLoader(framework_common.NoisyBlobs(args.n), batch_size=8, shuffle=True,
                        num_workers=args.workers)
    if args.fsdp and not args.cuda:  # sharded already: Accelerate would wrap it in DDP
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                                  scheduler)

    if args.fsdp:  # each rank saves its shards, through DCP
        ckpt = procckpt.Checkpointer(train=procckpt.Sharded(model, optimizer),
                                     scheduler=scheduler)
    else:
        ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler)
    marker = Path("hung-once")
    for _epoch in ckpt.epochs(args.epochs):
        for x, y in ckpt.batches(loader):
            with accelerator.accumulate(model) if args.accumulate else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            step = ckpt.step + 1
            if step == args.hang_at_step and not marker.exists():
                marker.touch()
                time.sleep(3600)  # stuck: only the hang timeout ends this
            print(f"step {step}", flush=True)
    if args.fsdp:  # every rank takes part in gathering the full weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    else:
        state = accelerator.unwrap_model(model).state_dict()
    if args.out and accelerator.is_main_process:
        torch.save({k: v.cpu() for k, v in state.items()}, args.out)


def shard_on_cpus(model: nn.Sequential) -> None:
    """FSDP2 over the process group Accelerate made: each linear layer, then the whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


if __name__ == "__main__":
    main()
