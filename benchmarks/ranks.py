"""Running a benchmark's worker on N gloo ranks of this machine, as spawned processes."""

from __future__ import annotations

import queue
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable[..., None], ranks: int, *extra: Any) -> Any:
    """Run ``worker(rank, ranks, port, *extra, results)`` in ``ranks`` spawned processes and
    return the one report a rank puts on ``results``; exit if a rank fails first."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, ranks, port, *extra, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    while True:
        try:
            report = results.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a rank failed (see above)") from None
    for p in procs:
        p.join(timeout=120)
    return report
