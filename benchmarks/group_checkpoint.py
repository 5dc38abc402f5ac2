"""What a checkpoint costs a process group's training, beside DCP.

Spawns 2 gloo ranks on this machine, each holding a DDP model of --size bytes of replicated
float32 parameters. Each rank measures, in one run, interleaved:

    procckpt async   the training's pause at the safe point that takes a checkpoint, with
                     checkpoints written in the background (the default)
    procckpt sync    the same with PROCCKPT_ASYNC=0 (the whole write is the pause)
    dcp async_save   torch.distributed.checkpoint.async_save of the same state: until it
                     returns (its stager copies; the write goes on in the background)
    dcp save         torch.distributed.checkpoint.save (synchronous)

plus the first async checkpoint (host memory made ahead, after the first step). The pause is
the slowest rank's (a group waits for it). Also, for the stop checkpoint (a synchronous one,
which is what a stop or a deadline takes): request -> durable as the journal records it,
against a raw write + fsync of the same bytes by rank 0 (which writes the replicated state).
Prints medians and the target ratios: async / sync <= 0.1, first / steady async <= 1.5,
stop durable / raw write <= 1.15.

With ``--sharded`` the model is FSDP2-sharded instead (``procckpt.Sharded``): each rank holds
and writes half of every tensor, through DCP, and the raw write is each rank's own half.

    python benchmarks/group_checkpoint.py [--size 1GiB] [--repeats 5] [--dir .] [--sharded]
                                          [--keep 1] [--only "stop durable,raw write"]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench import nontemporal_copies  # benchmarks/ is sys.path[0] when run as a script
from ranks import run_ranks
from torch.nn.parallel import DistributedDataParallel

MiB = 1 << 20
KINDS = ("procckpt async", "procckpt sync", "dcp async_save", "dcp save", "stop durable",
         "raw write")


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, work: str,  # noqa: C901, PLR0915 (one rank's benchmark, read top to bottom)
           results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), PROCCKPT_LOG_LEVEL="WARNING")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from bench import TensorState, interleaved, parse_size, raw_write  # on sys.path
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import procckpt
    from procckpt.protocol.events import read_events

    state = TensorState(parse_size(args.size))
    if args.sharded:  # FSDP2: each rank holds half of every tensor, saved through DCP
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(state, mesh=init_device_mesh("cpu", (world,)))
        held = {"train": procckpt.Sharded(model)}
    else:
        model = DistributedDataParallel(state)
        held = {"model": model}
    ckpts = {mode: procckpt.Checkpointer(Path(work) / mode, keep=args.keep, save_every=None,
                                         sync_every=1, async_save=(mode == "async"), **held)
             for mode in ("async", "sync")}
    loops = {mode: ck.batches(iter(int, 1)) for mode, ck in ckpts.items()}
    for loop in loops.values():
        next(loop)
        next(loop)  # the first safe point: the async one starts making its host memory
    saver = ckpts["async"]._background
    while saver is not None and not saver.reserved:  # a real run trains meanwhile
        time.sleep(0.01)
    dist.barrier()

    def procckpt_pause(mode: str) -> float:
        ckpts[mode].request_checkpoint()
        dist.barrier()
        started = time.perf_counter()
        next(loops[mode])  # the safe point of the step before takes the checkpoint
        pause = time.perf_counter() - started
        for _ in range(3):
            next(loops[mode])  # later agreements commit a background one
        ckpts[mode]._dist.settle(ckpts[mode]._member)  # durable before the next kind runs
        return slowest(pause)

    def stop_durable() -> float:
        """Request -> durable of a synchronous group checkpoint, as its journal line says
        (the agreement, every rank's part, rank 0's commit; not the pruning after it)."""
        procckpt_pause("sync")
        if rank:
            return 0.0
        events = read_events(ckpts["sync"].store.events_path)
        return float([e for e in events if e["event"] == "checkpoint"][-1]["seconds"])

    def mine() -> Iterator[memoryview]:
        """The bytes this rank writes: its shards, or (rank 0) the replicated state."""
        for p in state.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            yield memoryview(local.detach().numpy()).cast("B")

    def raw() -> float:
        writes = args.sharded or rank == 0
        seconds = raw_write(mine, Path(work) / f"raw-{rank}.bin") if writes else 0.0
        dist.barrier()
        return slowest(seconds)

    pending: list[object] = []

    def dcp_pause(kind: str) -> float:
        target = Path(work) / f"dcp-{kind}-{time.monotonic_ns()}"
        state = {"model": get_model_state_dict(model)}
        dist.barrier()
        started = time.perf_counter()
        if kind == "async":
            pending.append(dcp.async_save(state, checkpoint_id=str(target)))
        else:
            dcp.save(state, checkpoint_id=str(target))
        pause = time.perf_counter() - started
        for future in pending:
            future.result()  # type: ignore[attr-defined]
        pending.clear()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        return slowest(pause)

    kinds = {"procckpt async": lambda: procckpt_pause("async"),
             "procckpt sync": lambda: procckpt_pause("sync"),
             "dcp async_save": lambda: dcp_pause("async"),
             "dcp save": lambda: dcp_pause("sync"),
             "stop durable": stop_durable,
             "raw write": raw}
    if args.only:
        kinds = {name: kinds[name] for name in args.only}
    first = procckpt_pause("async")
    report = interleaved(kinds, args.repeats)
    report["first async"] = [first]
    if rank == 0:
        results.put(report)
    for ck in ckpts.values():
        ck.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="replicated state per rank [1GiB]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=".", help="where to write (the disk to measure) [.]")
    parser.add_argument("--sharded", action="store_true",
                        help="FSDP2 instead of DDP: each rank writes its shards through DCP")
    parser.add_argument("--keep", type=int, default=1,
                        help="checkpoints procckpt keeps; older ones are deleted after each [1]")
    parser.add_argument("--only", type=lambda text: [k.strip() for k in text.split(",")],
                        default=None, help="measure only these kinds, comma-separated "
                        f"(of: {', '.join(KINDS)})")
    args = parser.parse_args()
    unknown = set(args.only or ()) - set(KINDS)
    if unknown:
        parser.error(f"--only: no kind {', '.join(sorted(unknown))} (kinds: {', '.join(KINDS)})")
    with tempfile.TemporaryDirectory(prefix="procckpt-group-", dir=args.dir) as work:
        report = run_ranks(worker, 2, args, work)
    med = {name: statistics.median(xs) for name, xs in report.items()}
    layout = "FSDP2, {} sharded".format(args.size) if args.sharded else \
        f"DDP, {args.size} replicated"
    print(f"2 gloo ranks, {layout}; pause of the slowest rank per "
          f"checkpoint, median of {args.repeats} (min); memcpy: {nontemporal_copies()}")
    for name, xs in report.items():
        print(f"  {name:16} {med[name]:8.3f} s  ({min(xs):.3f})")
    for a, b, label, target in (("procckpt async", "procckpt sync", "async / sync", 0.1),
                                ("first async", "procckpt async", "first / steady async", 1.5),
                                ("procckpt async", "dcp async_save", "async / dcp async_save",
                                 None),
                                ("stop durable", "raw write", "stop durable / raw write", 1.15)):
        if a in med and b in med:
            goal = f"  (target <= {target})" if target else ""
            print(f"  {label + ':':25} {med[a] / med[b]:.3f}{goal}")


if __name__ == "__main__":
    main()
