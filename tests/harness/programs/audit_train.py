"""A training for the first-batch audit's tests: samples that carry their index, a loader that
shuffles them (a DataLoader with a sampler of the script's own, or torchdata's
StatefulDataLoader), 2 epochs of 8 batches. ``--stop-at N`` asks for a checkpoint and a stop
after step N of a fresh start (not of a resumed run), so that a rerun resumes there.

``--corrupt`` breaks the data position of a resumed run, as the bugs users meet do:
``epoch``: the sampler shuffles with another epoch's order; ``skip``: the loader's first
batch after the resume is lost (a loader state off by one); ``data``: the samples' values
changed (data files rewritten); ``extras`` (with ``--steps``): the batch fetched ahead into
ckpt.extras is fetched again; ``--corrupt-rank R``: on rank R alone. ``--ddp`` (under
torchrun): gloo, DDP, and a DistributedSampler (its epoch offset by the ``epoch``
corruption). Prints "resumed S" at the start (S: the step resumed from, 0
on a fresh start), "step S trained I I I ..." (the batch's sample indices; with --ddp "step S
rank R trained ...", and "resumed S rank R") after each step,
and "weights W" at the end; ``--out`` writes the final weights (benchmarks/kill_campaign.py
counts the samples from these lines and compares the weights)."""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import procckpt

SAMPLES, BATCH = 64, 8


class Indexed(Dataset):
    def __init__(self, shift: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=g) + shift

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


class OwnOrder(Sampler):
    """A shuffle from a Python generator of its own, seeded by the epoch it is told."""

    def __init__(self, offset: int = 0) -> None:
        self.epoch, self.offset = offset, offset

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch + self.offset

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self):
        order = list(range(SAMPLES))
        random.Random(1000 + self.epoch).shuffle(order)
        return iter(order)


class OffsetDistributed(DistributedSampler):
    """A DistributedSampler told another epoch than the one it is in (by ``offset``)."""

    def __init__(self, dataset: Dataset, offset: int) -> None:
        super().__init__(dataset, shuffle=True, seed=7)
        self.offset = offset

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch + self.offset)


def loader_for(kind: str, dataset: Dataset, sampler_offset: int, skip_first: bool,
               workers: int = 0):
    if kind == "ddp":
        Base, options = DataLoader, {"sampler": OffsetDistributed(dataset, sampler_offset)}
    elif kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as Base

        options = {"shuffle": True, "generator": torch.Generator().manual_seed(3)}
    else:
        Base, options = DataLoader, {"sampler": OwnOrder(sampler_offset)}

    class Loader(Base):
        skip = skip_first

        def __iter__(self):
            it = super().__iter__()
            if self.skip:  # once, in the pass a resume opens
                self.skip = False
                next(it)
            return it

    return Loader(dataset, batch_size=BATCH, num_workers=workers, **options)


def steps_loop(ckpt, model, optimizer, total: int, corrupt: str, stop_at: int | None) -> None:
    """nanoGPT's shape: random samples drawn for each step, the next batch fetched ahead and
    kept in ckpt.extras. ``extras`` corruption: a resumed run fetches it again before the loop
    (from the fresh seed), over the one the checkpoint held."""
    data = Indexed()

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(SAMPLES, (BATCH,))
        return data.x[index], index

    if corrupt == "extras":
        ckpt.extras["batch"] = get_batch()
    for _ in ckpt.steps(total):
        x, index = ckpt.extras["batch"] if "batch" in ckpt.extras else get_batch()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        say(f"step {ckpt.step + 1} trained {' '.join(map(str, index.tolist()))}")
        ckpt.extras["batch"] = get_batch()
        if ckpt.step == stop_at and ckpt.resumed_from is None:
            ckpt.request_checkpoint(stop=True)
    say("weights " + " ".join(map(str, model.weight.flatten().tolist())))


def say(line: str) -> None:
    """One line in one write: the ranks of a group share the output."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--corrupt", choices=["none", "epoch", "skip", "data", "extras"],
                        default="none")
    parser.add_argument("--steps", type=int, default=None,
                        help="an iteration-based loop of N steps (ckpt.steps()) instead")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--corrupt-rank", type=int, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    rank = 0
    if args.ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    who = f" rank {rank}" if args.ddp else ""
    say(f"resumed {ckpt.step}{who}")
    mine = args.corrupt_rank is None or args.corrupt_rank == rank
    corrupt = args.corrupt if ckpt.resumed_from is not None and mine else "none"
    loader = loader_for("ddp" if args.ddp else args.loader,
                        Indexed(shift=1.0 if corrupt == "data" else 0.0),
                        sampler_offset=1 if corrupt == "epoch" else 0,
                        skip_first=corrupt == "skip", workers=args.workers)
    if args.steps:
        return steps_loop(ckpt, model, optimizer, args.steps, corrupt, args.stop_at)
    for epoch in ckpt.epochs(args.epochs):
        if args.loader == "plain" or args.ddp:
            loader.sampler.set_epoch(epoch)
        for x, index in ckpt.batches(loader):
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_sleep)
            say(f"step {ckpt.step + 1}{who} trained {' '.join(map(str, index.tolist()))}")
            if ckpt.step == args.stop_at and ckpt.resumed_from is None:
                ckpt.request_checkpoint(stop=True)
    net = model.module if args.ddp else model
    print("weights", *net.weight.flatten().tolist(), flush=True)
    if args.out and rank == 0:
        torch.save(net.state_dict(), args.out)


if __name__ == "__main__":
    main()
