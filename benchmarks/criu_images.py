"""Benchmark: what a CRIU image of a process costs, beside DMTCP's (benchmarks/dmtcp_images.py)
on the same process: its bytes against the process's resident memory, its write (the time the
process is paused) and its restore against a raw write and read of the same bytes.

    python benchmarks/criu_images.py [--mb 256] [--reps 5] [--dir DIR]

Runs a Python process holding ``--mb`` MB of random (incompressible) tensor data behind
procckpt's keeper, takes ``--reps`` periodic images through the CRIU engine (``criu dump
--leave-running``, the path ``procckpt run --engine criu`` uses), and prints, by medians of
one run:

* image bytes / resident memory (the process's RSS when imaged; target: at most 1.1);
* the image write, the process paused, / a raw write of the same bytes (the image files'
  content, already in memory, written to a new file in the same directory without fsync, as
  CRIU does not fsync; target: at most 1.5);
* procckpt's commit (CRC-32, manifest, fsync, rename);
* a restore (``restore.py``: ``criu restore`` until the process runs again) / a raw read of
  the same bytes from the page cache.

Needs root and CRIU 4.1 or newer (`criu check`). The numbers are for the machine they ran on.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from procckpt.launcher.child import start_behind_keeper
from procckpt.launcher.engines.criu import CriuEngine, criu_problem, find_criu
from procckpt.protocol.events import read_events
from procckpt.store import CheckpointStore

sys.path.insert(0, str(Path(__file__).parent))
from dmtcp_images import _raw_write  # noqa: E402 (the same raw write as DMTCP's, beside it)

__all__ = ["main"]

_WORKLOAD = """
import sys, time
import torch
torch.manual_seed(0)
data = torch.rand(int(sys.argv[1]) * (1 << 20) // 4)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _wait(engine: CriuEngine, seq: int) -> None:
    deadline = time.monotonic() + 600
    while engine.confirmation(seq) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    confirmed = engine.confirmation(seq)
    if confirmed is None or confirmed.checkpoint is None:
        raise SystemExit(f"criu_images: the image failed: {confirmed}")


def _image_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.glob("*.img")))


def _raw_read(path: Path) -> float:
    started = time.monotonic()
    for p in sorted(path.glob("*.img")):
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass
    return time.monotonic() - started


def _kill(keeper: subprocess.Popen[bytes], lifeline: int, tree: list[psutil.Process]) -> None:
    """The keeper and the tree below it gone, their pids free again (a restore needs them)."""
    os.killpg(keeper.pid, signal.SIGKILL)
    keeper.wait()
    os.close(lifeline)
    psutil.wait_procs(tree, timeout=30)


def _restore(engine: CriuEngine, command: list[str]) -> float:
    """Seconds from starting the next cycle's command until the restored process runs."""
    argv, _ = engine.start_cycle(command, "bench")
    pidfile = engine.work / "root.pid"
    started = time.monotonic()
    keeper, lifeline = start_behind_keeper(argv, os.environ)
    while not pidfile.exists():
        if keeper.poll() is not None:
            raise SystemExit(f"criu_images: the restore failed (see {engine.work}/restore.log)")
        time.sleep(0.002)
    seconds = time.monotonic() - started
    _kill(keeper, lifeline, psutil.Process(keeper.pid).children(recursive=True))
    engine.end_cycle()
    return seconds


def _measure(root: Path, mb: int, reps: int) -> None:
    tools, problem = criu_problem(find_criu())
    if tools is None:
        raise SystemExit(f"criu_images: {problem}")
    store = CheckpointStore(root / "store", keep=1).open()
    engine = CriuEngine(store, tools)
    command = [sys.executable, "-c", _WORKLOAD, str(mb)]
    argv, _ = engine.start_cycle(command, "bench")
    keeper, lifeline = start_behind_keeper(argv, os.environ)
    engine.child_started(keeper.pid)
    while not engine.connected():
        time.sleep(0.05)
    time.sleep(max(5.0, mb / 100))  # the tensor made: the process at its size
    rss, raw_writes, raw_reads = [], [], []
    tree = psutil.Process(keeper.pid).children(recursive=True)
    try:
        for _ in range(reps):
            rss.append(sum(p.memory_info().rss for p in tree))
            _wait(engine, engine.request("checkpoint", "bench"))
            newest = store.checkpoints()[0]
            raw_writes.append(_raw_write(_image_bytes(newest.path), root / "raw.bin"))
            raw_reads.append(_raw_read(newest.path))
    finally:
        _kill(keeper, lifeline, tree)
        engine.end_cycle()
    restores = [_restore(engine, command) for _ in range(reps)]
    done = [e for e in read_events(store.events_path) if e.get("event") == "checkpoint"]
    writes = [float(e["write_seconds"]) for e in done]
    commits = [float(e["seconds"]) - float(e["write_seconds"]) for e in done]
    nbytes = store.checkpoints()[0].nbytes
    mbytes = nbytes / 1e6
    write, raw_w = statistics.median(writes), statistics.median(raw_writes)
    restore, raw_r = statistics.median(restores), statistics.median(raw_reads)
    print(f"process image: {mbytes:.1f} MB ({mb} MB of tensor data), CRIU "
          f"{tools.version_text}, medians of {reps}")
    print(f"image bytes / resident memory:   {nbytes / statistics.median(rss):7.2f}x "
          f"(RSS {statistics.median(rss) / 1e6:.1f} MB)")
    print(f"image write (process paused):    {write:7.2f} s  {mbytes / write:8.0f} MB/s")
    print(f"raw write of the same bytes:     {raw_w:7.2f} s  {mbytes / raw_w:8.0f} MB/s")
    print(f"ratio image write / raw write:   {write / raw_w:7.2f}x")
    print(f"procckpt commit (CRC-32, fsync): {statistics.median(commits):7.2f} s")
    print(f"restore until the process runs:  {restore:7.2f} s")
    print(f"raw read of the same bytes:      {raw_r:7.2f} s")
    print(f"ratio restore / raw read:        {restore / raw_r:7.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/criu_images.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MB of tensor data the process holds")
    parser.add_argument("--reps", type=int, default=5, help="images to take and restore")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="procckpt-bench-criu-", dir=args.dir) as tmp:
        _measure(Path(tmp), args.mb, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
