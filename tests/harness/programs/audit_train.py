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
corruption); ``reinit``: the model's weights initialised again after the Checkpointer restored
them (a script that loads pretrained weights last). ``--batch`` makes the batches another
shape (each step turns them back into a tensor): ``dataclass`` (a collate that returns a
dataclass), ``sparse`` and ``nested`` (the inputs as such tensors), ``setkeys`` (samples that
are dicts built from a set of keys, iterated in the order of the process's string hash).
``--own-iterator`` (with ``--steps``): the loop draws its batches from an iterator of its
own, ``next(data_iter)``, which procckpt does not position; ``--started-at``: the script
writes the time of each start into ckpt.extras. Prints "resumed S" at the start (S: the step
resumed from, 0 on a fresh start), "step S trained I I I ..." (the batch's sample indices;
with --ddp "step S rank R trained ...", and "resumed S rank R") after each step, and
"weights W" at the end; ``--out`` writes the final weights (benchmarks/kill_campaign.py
counts the samples from these lines and compares the weights)."""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass
class Batch:
    """A batch as a collate function of the script's returns it."""

    x: torch.Tensor
    index: torch.Tensor
    note: str


class SetKeyed(Dataset):
    """Samples that are dicts whose keys come from a set: their order follows the string hash
    of the process."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        x, index = self.base[i]
        values = {"x": x, "index": index, "twice": 2 * x, "label": f"sample-{index}"}
        return {key: values[key] for key in set(values)}


def collate_for(shape: str):
    """The collate function that makes batches of ``shape`` (None: torch's default)."""
    from torch.utils.data import default_collate

    if shape == "dataclass":
        def collate(samples):
            x, index = default_collate(samples)
            return Batch(x, index, f"{len(samples)} samples")
    elif shape == "sparse":
        def collate(samples):
            x, index = default_collate(samples)
            return x.to_sparse(), index
    elif shape == "nested":
        def collate(samples):
            x, index = default_collate(samples)
            return torch.nested.nested_tensor(list(x.unbind())), index
    else:
        return None
    return collate


def as_tensors(batch, shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of any ``--batch`` shape as (inputs, sample indices)."""
    if shape == "dataclass":
        return batch.x, batch.index
    if shape == "setkeys":
        return batch["x"], batch["index"]
    x, index = batch
    if shape == "sparse":
        return x.to_dense(), index
    if shape == "nested":
        return torch.stack(x.unbind()), index
    return x, index


def loader_for(kind: str, dataset: Dataset, sampler_offset: int, skip_first: bool,
               workers: int = 0, shape: str = "tuple"):
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

    if shape == "setkeys":
        dataset = SetKeyed(dataset)
    return Loader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=collate_for(shape),
                  **options)


def steps_loop(ckpt, model, optimizer, total: int, corrupt: str, stop_at: int | None,
               started_at: bool = False, loader=None) -> None:
    """nanoGPT's shape: random samples drawn for each step, the next batch fetched ahead and
    kept in ckpt.extras. ``extras`` corruption: a resumed run fetches it again before the loop
    (from the fresh seed), over the one the checkpoint held."""
    data = Indexed()

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(SAMPLES, (BATCH,))
        return data.x[index], index

    if corrupt == "extras":
        ckpt.extras["batch"] = get_batch()
    if started_at:
        ckpt.extras["started_at"] = time.time()
    if loader is not None:  # minGPT's shape: next(data_iter), an iterator of its own
        data_iter = iter(loader)
        for _ in ckpt.steps(total):
            try:
                x, index = next(data_iter)
            except StopIteration:
                data_iter = iter(loader)
                x, index = next(data_iter)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            say(f"step {ckpt.step + 1} trained {' '.join(map(str, index.tolist()))}")
            if ckpt.step == stop_at and ckpt.resumed_from is None:
                ckpt.request_checkpoint(stop=True)
        return
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
    parser.add_argument("--corrupt", choices=["none", "epoch", "skip", "data", "extras",
                                              "reinit"], default="none")
    parser.add_argument("--batch", choices=["tuple", "dataclass", "sparse", "nested",
                                            "setkeys"], default="tuple")
    parser.add_argument("--own-iterator", action="store_true")
    parser.add_argument("--started-at", action="store_true")
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
    if corrupt == "reinit":  # weights loaded again after the Checkpointer restored them
        torch.manual_seed(0)
        (model.module if args.ddp else model).reset_parameters()
    loader = loader_for("ddp" if args.ddp else args.loader,
                        Indexed(shift=1.0 if corrupt == "data" else 0.0),
                        sampler_offset=1 if corrupt == "epoch" else 0,
                        skip_first=corrupt == "skip", workers=args.workers, shape=args.batch)
    if args.steps:
        return steps_loop(ckpt, model, optimizer, args.steps, corrupt, args.stop_at,
                          args.started_at, loader if args.own_iterator else None)
    for epoch in ckpt.epochs(args.epochs):
        if args.loader == "plain" or args.ddp:
            loader.sampler.set_epoch(epoch)
        for batch in ckpt.batches(loader):
            x, index = as_tensors(batch, args.batch)
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
