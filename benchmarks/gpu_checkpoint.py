"""What a checkpoint of GPU-resident state costs one training process, beside DCP.

A model of Linear layers on the GPU, trained with Adam, whose state (parameters and both
moments) is about --size bytes. Measured in one run, interleaved, medians:

    normal step          forward + backward + optimizer step, synchronized
    checkpointing step   the same step right after a safe point that takes an async
                         checkpoint: overlapped (the copy runs beside forward/backward, the
                         optimizer step waits for it) and not (PROCCKPT_OVERLAP=0)
    D2H                  a bulk copy of the same tensors into page-locked memory, waited for
    stop durable         request -> durable of a stop's checkpoint (synchronous), as journalled
    raw write            os.write + fsync of the same bytes from host memory
    dcp async_save       torch.distributed.checkpoint.async_save of the same state: until it
                         returns, then a step (its stall on the training)
    first ckpt step      the checkpointing step of a new Checkpointer's first checkpoint (its
                         host arena reserved ahead, as in training), once
    restore              a new Checkpointer on the overlapped run's dir loading its newest
                         checkpoint into the model on the GPU (restore_seconds), once

Targets: checkpointing step (overlapped) <= 1.05 x a normal step; the step's extra time
without overlap <= 1.1 x the D2H time; stop durable <= 1.15 x raw write; procckpt's extra
step time below DCP async_save's.

    python benchmarks/gpu_checkpoint.py [--size 1GiB] [--batch 4096] [--repeats 7] [--dir .]
                                        [--json FILE] [--targets-only]

``--device cpu`` runs the same code on the CPU (a smoke test: no figure means anything there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("PROCCKPT_LOG_LEVEL", "WARNING")  # the figures, not a line per checkpoint
warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")

from bench import interleaved, parse_size, raw_write  # noqa: E402 - benchmarks/ is sys.path[0]


def make_model(size: int, hidden: int, device: str) -> torch.nn.Module:
    per_layer = 3 * (hidden * hidden + hidden) * 4  # parameters + Adam's two moments, float32
    layers = max(1, round(size / per_layer))
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):  # initialised where they live: on the CPU, 8 GiB took seconds
        blocks += [torch.nn.Linear(hidden, hidden, device=device), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


class Training:
    """One model, its optimizer, and the steps and checkpoints timed on them."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        import procckpt

        self.device = args.device
        self.cuda = self.device == "cuda"
        self.model = make_model(parse_size(args.size), args.hidden, self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.hidden, device=self.device)
        self.step()  # Adam makes its moments in the first step
        self.work = work
        self.ckpts: dict[str, Any] = {}
        for mode, overlap in (("overlap", "1"), ("no overlap", "0")):
            os.environ["PROCCKPT_OVERLAP"] = overlap  # read when the Checkpointer is made
            self.ckpts[mode] = procckpt.Checkpointer(
                work / mode.replace(" ", "-"), model=self.model, optimizer=self.optimizer,
                keep=1, save_every=None, async_save=True)
        os.environ.pop("PROCCKPT_OVERLAP")
        self.loops = {mode: ck.batches(iter(int, 1)) for mode, ck in self.ckpts.items()}
        for loop in self.loops.values():
            next(loop)
            next(loop)  # the first safe point: the host arena is made in the background
        for ck in self.ckpts.values():
            while ck._background is not None and not ck._background.reserved:
                time.sleep(0.01)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        from procckpt.training.save.writer import tensors_of

        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return [t for t in tensors_of(state) if t.device.type == self.device]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self) -> None:
        self.model(self.x).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self, before: Any = None) -> float:
        """Seconds from a safe point (with ``before`` run in it) to the end of the next step."""
        self.sync()
        started = time.perf_counter()
        if before is not None:
            before()
        self.step()
        self.sync()
        return time.perf_counter() - started

    def checkpointing_step(self, mode: str) -> float:
        ck = self.ckpts[mode]
        ck.request_checkpoint()
        seconds = self.timed_step(lambda: next(self.loops[mode]))
        ck.flush()  # durable before anything else is timed
        return seconds

    def d2h(self) -> float:
        from procckpt.training.save.arena import HostArena

        arena = getattr(self, "_arena", None) or HostArena()
        self._arena = arena
        arena.capture(self.tensors()).wait_copied()  # the first one allocates
        self.sync()
        started = time.perf_counter()
        arena.capture(self.tensors()).wait_copied()
        return time.perf_counter() - started

    def stop_durable(self) -> float:
        from procckpt.protocol.events import read_events

        ck = self.ckpts["no overlap"]
        self.sync()
        ck.save("stop")
        events = read_events(ck.store.events_path)
        return float([e for e in events if e["event"] == "checkpoint"][-1]["seconds"])

    def raw(self) -> float:
        # One host copy, made at the first call: what is timed is the write of those bytes,
        # and a fresh copy of 8 GiB into pageable memory took seconds a round.
        if not hasattr(self, "_host"):
            self._host = [t.cpu() for t in self.tensors()]
        host = self._host

        def views() -> Any:
            for t in host:
                yield memoryview(t.numpy()).cast("B")

        return raw_write(views, self.work / "raw.bin")

    def first_checkpointing_step(self) -> float:
        """The checkpointing step of a new Checkpointer's first checkpoint, once."""
        import procckpt

        ck = procckpt.Checkpointer(self.work / "first", model=self.model,
                                   optimizer=self.optimizer, keep=1, save_every=None,
                                   async_save=True)
        loop = ck.batches(iter(int, 1))
        next(loop)
        next(loop)
        while ck._background is not None and not ck._background.reserved:
            time.sleep(0.01)
        ck.request_checkpoint()
        seconds = self.timed_step(lambda: next(loop))
        ck.flush()
        ck.close()
        return seconds

    def restore(self) -> float:
        """A new Checkpointer restoring the overlapped run's newest checkpoint, once."""
        import procckpt

        ck = procckpt.Checkpointer(self.work / "overlap", model=self.model,
                                   optimizer=self.optimizer, keep=1, save_every=None)
        self.sync()
        seconds = float(ck.restore_seconds)
        ck.close()
        return seconds

    def dcp_async(self) -> float:
        import torch.distributed.checkpoint as dcp

        target = self.work / f"dcp-{time.monotonic_ns()}"
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        future: list[Any] = []
        seconds = self.timed_step(
            lambda: future.append(dcp.async_save(state, checkpoint_id=str(target))))
        future[0].result()
        shutil.rmtree(target, ignore_errors=True)
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="parameters + optimizer state [1GiB]")
    parser.add_argument("--batch", type=int, default=4096, help="rows per step [4096]")
    parser.add_argument("--hidden", type=int, default=4096, help="width of each layer [4096]")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=".", help="where to write (the disk to measure) [.]")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--json", metavar="FILE", help="also write the medians and ratios there")
    parser.add_argument("--targets-only", action="store_true",
                        help="time only what the two targets need (normal and overlapped "
                             "checkpointing step, stop durable, raw write): for large sizes")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device; there is none (--device cpu for a smoke run)")
    with tempfile.TemporaryDirectory(prefix="procckpt-gpu-", dir=args.dir) as work:
        t = Training(args, Path(work))
        kinds = {"normal step": lambda: t.timed_step(),
                 "ckpt step, overlap": lambda: t.checkpointing_step("overlap"),
                 "ckpt step, no overlap": lambda: t.checkpointing_step("no overlap"),
                 "D2H": t.d2h, "stop durable": t.stop_durable, "raw write": t.raw}
        if args.targets_only:
            del kinds["ckpt step, no overlap"], kinds["D2H"]
        else:
            try:
                import torch.distributed.checkpoint as dcp

                if hasattr(dcp, "async_save"):
                    kinds["dcp async_save step"] = t.dcp_async
            except ImportError:
                pass
        report = interleaved(kinds, args.repeats)
        first = None if args.targets_only else t.first_checkpointing_step()
        for ck in t.ckpts.values():
            ck.close()
        restore = None if args.targets_only else t.restore()
    med = {name: statistics.median(xs) for name, xs in report.items()}
    from procckpt.store.checksum import IMPLEMENTATION as crc

    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run)"
    print(f"{device}, torch {torch.__version__}: {t.nbytes / 2**30:.2f} GiB of state, batch "
          f"{args.batch}, CRC-32 by {crc}; median of {args.repeats} (min), s:")
    for name, xs in report.items():
        print(f"  {name:24} {med[name]:8.4f}  ({min(xs):.4f})")
    normal = med["normal step"]
    print(f"  ckpt step overlapped / normal step:       {med['ckpt step, overlap'] / normal:.3f}"
          "  (target <= 1.05)")
    print(f"  stop durable / raw write:                {med['stop durable'] / med['raw write']:.2f}"
          "  (target <= 1.15)")
    ratios = {"ckpt step / normal step": med["ckpt step, overlap"] / normal,
              "stop durable / raw write": med["stop durable"] / med["raw write"]}
    if "D2H" in med:
        extra = med["ckpt step, no overlap"] - normal
        ratios["extra step time without overlap / D2H"] = extra / med["D2H"]
        print(f"  extra step time without overlap / D2H:   {extra / med['D2H']:.2f}"
              "  (target <= 1.1)")
    if first is not None:
        ratios["first / steady ckpt step"] = first / med["ckpt step, overlap"]
    if "dcp async_save step" in med:
        ratios["extra step time, procckpt / dcp async_save"] = (
            (med["ckpt step, overlap"] - normal) / max(med["dcp async_save step"] - normal, 1e-9))
        print(f"  extra step time, procckpt / dcp async_save: "
              f"{ratios['extra step time, procckpt / dcp async_save']:.2f}  (target < 1)")
    if first is not None:
        print(f"  first ckpt step / steady:                "
              f"{ratios['first / steady ckpt step']:.2f}  ({first:.4f} s; target <= 1.5)")
    if restore is not None:
        print(f"  restore onto the device:                 {restore:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device, "torch": torch.__version__, "state_bytes": t.nbytes, "crc": crc,
            "medians": med, "first ckpt step": first, "restore": restore, "ratios": ratios},
            indent=1))


if __name__ == "__main__":
    main()
