"""What the ranks' agreement on checkpoints costs per training step (gloo, CPU).

Spawns N ranks (default 2) on this machine, each running DDP steps of a small and a larger MLP
four ways, in interleaved blocks so that load from other processes hits all of them alike:

    plain      for batch in batches: step()
    every-1    for batch in ckpt.batches(batches): step()    Checkpointer(sync_every=1)
    adaptive   the same with the default (an all-reduce about every 0.2 s)
    plain-2    plain again: how much two identical ways differ here (the noise floor)

The Checkpointer runs as under ``procckpt run`` (PROCCKPT_TOKEN set: it polls control/ too).
Prints the median step time of each way and its ratio to plain, plus the latency of the
agreement's all-reduce alone. Numbers from one run; rerun on a quiet machine to compare.

    python benchmarks/agreement_cost.py [--ranks 2] [--blocks 15] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ranks import run_ranks  # benchmarks/ is sys.path[0] when run as a script
from torch import nn
from torch.nn.parallel import DistributedDataParallel

MODELS = {
    "small MLP 32-64-8 (2.6k params), batch 16": (32, 64, 16),
    "larger MLP 256-1024-8 (272k params), batch 64": (256, 1024, 64),
}
WAYS = ("plain", "every-1", "adaptive", "plain-2")  # plain-2: the noise floor (A/A)


def make(inputs: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, 8))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str,
           results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), PROCCKPT_LOG_LEVEL="WARNING")
    # As under `procckpt run`: the Checkpointer polls DIR/control for requests.
    os.environ.update(PROCCKPT_TOKEN="benchmark", PROCCKPT_DIR=tmp)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import procckpt
    from procckpt.store import CheckpointStore
    from procckpt.training.group import Flags, RankAgreement

    if rank == 0:
        CheckpointStore(tmp).open()  # what `procckpt run` prepares
    dist.barrier()

    # The agreement's all-reduce alone.
    agreement = RankAgreement(torch.device("cpu"), every=1)
    for step in range(50):
        agreement.reduce(Flags(), step)
    latencies = []
    for step in range(50, 50 + args.steps * 5):
        t0 = time.perf_counter()
        agreement.reduce(Flags(), step)
        latencies.append(time.perf_counter() - t0)
    report: dict[str, object] = {"allreduce": latencies}

    for label, (inputs, hidden, batch) in MODELS.items():
        torch.manual_seed(0)
        model = DistributedDataParallel(make(inputs, hidden))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = [(torch.randn(batch, inputs), torch.randint(0, 8, (batch,)))
                for _ in range(args.steps)]

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        ckpts = {way: procckpt.Checkpointer(model=model,
                                            sync_every=1 if way == "every-1" else None)
                 for way in ("every-1", "adaptive")}
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for x, y in data[:10]:  # warm-up
            step(x, y)
        for block in range(args.blocks):
            # Rotate the order, so that no way always follows the same other one.
            for way in WAYS[block % len(WAYS):] + WAYS[:block % len(WAYS)]:
                dist.barrier()
                t0 = time.perf_counter()
                batches = ckpts[way].batches(data) if way in ckpts else data
                for x, y in batches:
                    step(x, y)
                elapsed = torch.tensor([(time.perf_counter() - t0) / len(data)])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                times[way].append(float(elapsed))
        report[label] = times
        report[label + " agreements"] = {w: c._dist.agreement.agreements
                                         for w, c in ckpts.items()}
    if rank == 0:
        results.put(report)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=15, help="interleaved blocks per way")
    parser.add_argument("--steps", type=int, default=100, help="steps per block")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        report = run_ranks(worker, args.ranks, args, tmp)

    lat = sorted(report["allreduce"])  # type: ignore[arg-type]
    print(f"gloo, {args.ranks} ranks, CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"{args.blocks} blocks x {args.steps} steps per way")
    print(f"agreement all-reduce alone (7 x float64): median {statistics.median(lat) * 1e6:.0f} "
          f"us, p90 {lat[int(len(lat) * 0.9)] * 1e6:.0f} us")
    for label in MODELS:
        times = report[label]  # type: ignore[index]
        med = {w: statistics.median(times[w]) for w in WAYS}
        counts = report[label + " agreements"]  # type: ignore[index]
        print(f"\n{label}")
        for way in WAYS:
            extra = "" if way == "plain" else f"  x{med[way] / med['plain']:.3f}"
            if way in counts:
                extra += f"  ({counts[way]} agreements in {args.blocks * args.steps} steps)"
            print(f"  {way:9s} {med[way] * 1e3:8.3f} ms/step{extra}")


if __name__ == "__main__":
    main()
