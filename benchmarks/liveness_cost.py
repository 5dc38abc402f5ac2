"""``python benchmarks/liveness_cost.py``: what hang detection's sampler costs the training.

Under ``procckpt run`` rank 0's Checkpointer samples its training thread five times a second
(training/link/liveness.py). This runs a dispatch-bound loop of tiny torch steps (one thread, the
kind of loop where a GIL-taking thread shows most) with and without a sampler, interleaved,
and prints the median step time of each, their ratio, and the sampler thread's own CPU time
(from /proc/self/task/TID/schedstat) as a share of a core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from procckpt.protocol.control import ControlChannel
from procckpt.training.link.liveness import Liveness


def thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def run_loop(seconds: float) -> float:
    """Median seconds per step of a small forward/backward/SGD loop run for ``seconds``."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    times = []
    end = time.perf_counter() + seconds
    while (start := time.perf_counter()) < end:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0, help="each run's length")
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        channel = ControlChannel(Path(tmp), "bench")
        plain, sampled, shares = [], [], []
        run_loop(1.0)  # warm up
        for pair in range(args.pairs):
            for with_sampler in ((False, True) if pair % 2 == 0 else (True, False)):
                if not with_sampler:
                    plain.append(run_loop(args.seconds))
                    continue
                liveness = Liveness(channel, threading.current_thread())
                liveness.start()
                assert liveness._thread is not None
                tid = liveness._thread.native_id
                cpu = thread_cpu_seconds(tid)
                wall = time.perf_counter()
                sampled.append(run_loop(args.seconds))
                shares.append((thread_cpu_seconds(tid) - cpu) / (time.perf_counter() - wall))
                liveness.close()
    ratios = [s / p for s, p in zip(sampled, plain)]
    print(f"pid {os.getpid()}, {args.pairs} pairs of {args.seconds:g} s, torch "
          f"{torch.__version__}, one torch thread")
    print(f"step time without sampler (median): {statistics.median(plain) * 1e3:.3f} ms")
    print(f"step time with sampler (median):    {statistics.median(sampled) * 1e3:.3f} ms")
    print(f"ratio per pair, median (range):     {statistics.median(ratios):.4f} "
          f"({min(ratios):.4f} .. {max(ratios):.4f})")
    print(f"sampler thread CPU, share of a core: {statistics.median(shares) * 100:.3f}% "
          "(median)")


if __name__ == "__main__":
    main()
