"""Benchmark: how long DMTCP takes to write a process image, against a raw write of its bytes.

    python benchmarks/dmtcp_images.py [--mb 256] [--reps 5] [--gzip] [--dir DIR]

Runs a Python process holding ``--mb`` MB of random (incompressible) tensor data under the
DMTCP engine, takes ``--reps`` checkpoints through the engine (the path ``procckpt run`` uses),
and compares, by medians of one run:

* the image write: from the checkpoint request until DMTCP's images are complete;
* a raw write of the same bytes: the image file's content, already in memory, written to a new
  file in the same directory without fsync (DMTCP does not fsync either), right after each
  checkpoint, so that both writes find the page cache in the same state (clean: the commit
  fsyncs the image, and the raw file is fsynced after its timed write);
* procckpt's commit: moving the images into a checkpoint, fsync, CRC-32, manifest, rename.

The line to quote is ``ratio image write / raw write``. The numbers are for the machine they
ran on: run it there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from procckpt.launcher.engines.dmtcp import DmtcpEngine, find_dmtcp
from procckpt.protocol.events import read_events
from procckpt.store import CheckpointStore

__all__ = ["main"]

_WORKLOAD = """
import sys, time
mb = int(sys.argv[1])
try:
    import torch
    torch.manual_seed(0)
    data = torch.rand(mb * (1 << 20) // 4)
    kind = "torch"
except ImportError:
    data = bytearray(__import__("os").urandom(mb << 20))
    kind = "bytes"
print("ready", kind, flush=True)
while True:
    time.sleep(0.05)
"""


@dataclass
class Measured:
    writes: list[float]  # seconds from the request until DMTCP's images were complete
    commits: list[float]  # seconds procckpt then took to commit them
    raw_writes: list[float]  # seconds a plain write() of the same bytes took
    nbytes: int  # of the newest checkpoint


def _measure(store_dir: Path, mb: int, reps: int, gzip: bool) -> Measured:
    tools = find_dmtcp()
    if tools is None:
        raise SystemExit("bench_dmtcp: dmtcp_launch is not on PATH; install DMTCP first "
                         "(`module load dmtcp` on clusters)")
    store = CheckpointStore(store_dir, keep=1).open()
    engine = DmtcpEngine(store, tools, gzip=gzip)
    argv, env = engine.start_cycle([sys.executable, "-c", _WORKLOAD, str(mb)], "bench")
    child = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        engine.child_started(child.pid)
        line = child.stdout.readline() if child.stdout else ""
        if not line.startswith("ready"):
            raise SystemExit(f"bench_dmtcp: the workload did not start: {line!r}")
        raw_writes = []
        for _ in range(reps):
            seq = engine.request("checkpoint", "bench")
            deadline = time.monotonic() + 600
            while engine.confirmation(seq) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            confirmed = engine.confirmation(seq)
            if confirmed is None or confirmed.checkpoint is None:
                raise SystemExit(f"bench_dmtcp: checkpoint failed: {confirmed}")
            newest = store.checkpoints()[0]
            image = newest.file(newest.manifest["dmtcp"]["images"][0])
            raw_writes.append(_raw_write(image.read_bytes(), store.root / "raw-write.bin"))
    finally:
        try:
            os.killpg(child.pid, 9)
        except ProcessLookupError:
            pass
        child.wait()
        engine.end_cycle()
    done = [e for e in read_events(store.events_path) if e.get("event") == "checkpoint"]
    writes = [float(e["write_seconds"]) for e in done]
    commits = [float(e["seconds"]) - float(e["write_seconds"]) for e in done]
    return Measured(writes, commits, raw_writes, store.checkpoints()[0].nbytes)


def _raw_write(data: bytes, target: Path) -> float:
    """Seconds a plain write of ``data`` takes; the file is then fsynced (untimed) and removed,
    leaving no dirty pages to slow the next measurement."""
    with open(target, "wb") as f:
        started = time.monotonic()
        f.write(data)
        seconds = time.monotonic() - started
        os.fsync(f.fileno())
    target.unlink()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/dmtcp_images.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MB of tensor data the process holds")
    parser.add_argument("--reps", type=int, default=5, help="checkpoints to take")
    parser.add_argument("--gzip", action="store_true", help="also measure DMTCP with gzip")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="procckpt-bench-dmtcp-", dir=args.dir) as tmp:
        plain = _measure(Path(tmp) / "plain", args.mb, args.reps, gzip=False)
        raw_s = statistics.median(plain.raw_writes)
        write = statistics.median(plain.writes)
        commit = statistics.median(plain.commits)
        mb = plain.nbytes / 1e6
        print(f"process image: {mb:.1f} MB ({args.mb} MB of tensor data), medians of "
              f"{args.reps} checkpoints")
        print(f"DMTCP image write (no gzip):     {write:7.2f} s  {mb / write:8.0f} MB/s")
        print(f"raw write of the same bytes:     {raw_s:7.2f} s  {mb / raw_s:8.0f} MB/s")
        print(f"procckpt commit (fsync, CRC-32): {commit:7.2f} s")
        print(f"ratio image write / raw write:   {write / raw_s:7.2f}x")
        if args.gzip:
            zipped = _measure(Path(tmp) / "gzip", args.mb, max(1, args.reps // 2), gzip=True)
            zwrite = statistics.median(zipped.writes)
            print(f"DMTCP image write with gzip:     {zwrite:7.2f} s  "
                  f"({zipped.nbytes / 1e6:.1f} MB; {zwrite / write:.1f}x the plain write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
