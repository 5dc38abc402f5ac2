"""Checkpoints in object storage against the local disk: request to durable, and a resume on a
node whose local dir is empty, for the same state.

The server is moto's S3 server on loopback, started here (``pip install 'moto[server]'``): a
Python process that keeps objects in memory, so the figures say what procckpt's own path
(hashing, parallel uploads, the conditional commit) adds on this machine, not what a real
object store would sustain. Every parameter changes between checkpoints (nothing is shared
with an earlier one), so each checkpoint uploads the whole state.

    python benchmarks/s3_store.py --size 256MiB --repeats 5
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("PROCCKPT_LOG_LEVEL", "WARNING")  # the tables, not a line per checkpoint

from bench import TensorState, drop_cache, human, median, parse_size  # benchmarks/ is sys.path[0]

from procckpt import Checkpointer
from procckpt.protocol.events import read_events


def moto(port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moto's server did not start (see {log})") from None
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="s3-bench-", dir="."))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto(port, work / "moto.log")
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                      AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        model = TensorState(size)
        where = {"local disk": str(work / "local"), "S3 (moto, loopback)": "s3://bench/run"}
        os.environ["PROCCKPT_LOCAL_DIR"] = str(work / "staging")
        cks = {k: Checkpointer(d, model=model, keep=1, save_every=None, async_save=False)
               for k, d in where.items()}
        loops = {k: ck.batches(itertools.repeat(None)) for k, ck in cks.items()}
        for loop in loops.values():
            next(loop)
        durable: dict[str, list[float]] = {k: [] for k in where}

        def checkpoint(kind: str) -> None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            cks[kind].request_checkpoint()
            next(loops[kind])
            cks[kind].flush()
            last = [e for e in read_events(cks[kind].store.events_path)
                    if e["event"] == "checkpoint"][-1]
            durable[kind].append(float(last["seconds"]))

        for kind in where:  # untimed: the first write into a fresh place
            checkpoint(kind)
            durable[kind].clear()
        kinds = list(where)
        for r in range(args.repeats):
            for kind in kinds[r % 2:] + kinds[:r % 2]:
                checkpoint(kind)
                drop_cache(work)
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {durable[k][-1]:.2f}s" for k in kinds), flush=True)
        for ck in cks.values():
            ck.close()

        restore: dict[str, list[float]] = {k: [] for k in where}
        for r in range(args.repeats):
            for kind, spec in where.items():
                os.environ["PROCCKPT_LOCAL_DIR"] = str(work / f"node-{r}")  # an empty one
                drop_cache(work)
                started = time.perf_counter()
                ck = Checkpointer(spec, model=model, keep=1, save_every=None)
                restore[kind].append(time.perf_counter() - started)
                ck.close()
        state = model.nbytes
        print(f"\nstate: {human(state)}, every byte changed between checkpoints (all uploaded); "
              f"synchronous checkpoints, medians of {args.repeats}\n")
        print(f"{'':22}{'durable':>10}{'MB/s':>8}{'resume':>10}{'MB/s':>8}")
        for kind in kinds:
            d, r = median(durable[kind]), median(restore[kind])
            print(f"{kind:22}{d:>9.2f}s{state / d / 1e6:>8.0f}{r:>9.2f}s{state / r / 1e6:>8.0f}")
        local, remote = kinds
        print(f"\nthroughput S3 / local disk: write "
              f"{median(durable[local]) / median(durable[remote]):.2f}, resume (empty local dir) "
              f"{median(restore[local]) / median(restore[remote]):.2f}")
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
