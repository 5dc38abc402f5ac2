"""``python benchmarks/bench.py``: what checkpoints cost, against the targets of BENCHMARKS.md.

One run prints, side by side for each state size (64 MiB and 1 GiB; 4 GiB when memory
allows), medians over repeats:

1. the training stall per checkpoint: procckpt async, procckpt sync, plain torch.save+fsync;
2. request -> durable checkpoint, async and a stop's (synchronous) one, as a ratio to a raw
   write+fsync of the same random bytes;
3. restore (verify + load + load_state_dict) as a ratio to a raw read of the same bytes,
   both from a cold page cache (``posix_fadvise(DONTNEED)`` on the files);
4. extra host memory during a checkpoint and a restore, as a fraction of the state size;
5. how much a background write slows a Python-heavy training loop, writer thread vs helper
   process (the GIL question);
6. the step-time overhead of ``procckpt run`` with no checkpoint in flight, and the
   launcher's own CPU and memory while it waits.

The machine is shared and noisy: every number is a median, variants run interleaved, and
the comparisons are ratios taken within one run. ``--quick`` runs everything at a tiny size
(the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from procckpt.protocol.events import read_events
from procckpt.store import checksum
from procckpt.training.checkpointer import Checkpointer
from procckpt.training.save.writer import StreamingFileWriter

__all__ = ["main"]

MiB = 1 << 20
GiB = 1 << 30
#: Targets from the issue; the report marks each measured ratio against them.
TARGETS = {"stall": 0.05, "durable": 1.10, "restore": 1.2, "step": 0.005,
           "idle_cpu": 0.002, "idle_rss": 40e6, "memory": 1.0, "first": 1.5,
           "stop": 1.15}


# -- helpers ---------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": MiB, "g": GiB}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def human(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def drop_cache(path: Path) -> None:
    """Evict ``path`` (a file or every file under a directory) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:  # a temporary file renamed meanwhile (the audit's writer)
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss_anon() -> int:
    """Anonymous resident memory of this process (page cache and mapped files excluded)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return psutil.Process().memory_info().rss


class PeakSampler:
    """Samples RssAnon every few milliseconds on a thread; ``peak - base`` is the growth."""

    def __init__(self, every: float = 0.005) -> None:
        self.every = every
        self.base = rss_anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.every)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def growth(self) -> int:
        return self.peak - self.base


class TensorState(torch.nn.Module):
    """A stand-in model: ``size`` bytes of random float32 parameters in tensors of at most
    16 MiB, plus as many small ones (biases), like a real network's state_dict."""

    def __init__(self, size: int) -> None:
        super().__init__()
        big = max(1, size // (16 * MiB))
        small_elems = 256
        per_big = (size - big * small_elems * 4) // big // 4
        gen = torch.Generator().manual_seed(size)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.rand(per_big, generator=gen)) for _ in range(big))
        self.biases = torch.nn.ParameterList(
            torch.nn.Parameter(torch.rand(small_elems, generator=gen)) for _ in range(big))

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def views(self) -> Iterator[memoryview]:
        for p in self.parameters():
            yield memoryview(p.detach().numpy()).cast("B")


def raw_write(views: Callable[[], Iterator[memoryview]], path: Path) -> float:
    """Seconds to write the bytes and fsync: plain os.write of 16 MiB pieces, then fsync."""
    # A new file each time, as a checkpoint is: freeing the old file's blocks (0.6 s for
    # 4 GiB on ext4 here) is not part of a write. procckpt deletes old checkpoints after the
    # new one is durable, outside the time measured for it, too.
    path.unlink(missing_ok=True)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for view in views():
            for off in range(0, len(view), 16 * MiB):
                piece = view[off:off + 16 * MiB]
                while piece:
                    piece = piece[os.write(fd, piece):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_read(path: Path, buf: bytearray) -> float:
    """Seconds to read the file into a reusable buffer, 16 MiB at a time."""
    view = memoryview(buf)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # as any bulk reader would
        while f.readinto(view):
            pass
    return time.perf_counter() - started


def plain_torch_save(payload: Any, path: Path) -> float:
    path.unlink(missing_ok=True)  # a new file, as for raw_write
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def interleaved(kinds: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Seconds per kind: ``repeats`` rounds, each running every kind once, in an order that
    rotates by one each round, after one round that warms each kind up and is not counted."""
    report: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    for r in range(repeats + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds = kinds[name]()
            if r:
                report[name].append(seconds)
    return report


def machine() -> dict[str, str]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    disk = "?"
    with contextlib.suppress(Exception):
        best = ""
        for part in psutil.disk_partitions(all=False):
            if os.getcwd().startswith(part.mountpoint) and len(part.mountpoint) > len(best):
                best = part.mountpoint
                disk = f"{part.device} ({part.fstype}) at {part.mountpoint}"
    mem = psutil.virtual_memory()
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical cores",
        "memory": f"{mem.total / GiB:.1f} GiB ({mem.available / GiB:.1f} GiB available)",
        "disk": disk,
        "os": f"{platform.system()} {platform.release()}",
        "software": f"Python {platform.python_version()}, torch {torch.__version__}, "
                    f"CRC-32 by {checksum.IMPLEMENTATION}, {torch.get_num_threads()} torch threads",
        "load": "load average %.2f %.2f %.2f at start" % os.getloadavg(),
        "memcpy": nontemporal_copies(),
    }


def nontemporal_copies() -> str:
    """From what size glibc's memcpy/memmove bypass the cache (x86), as its loader reports.

    The async pause is memory copies of each tensor: those below this size are made with
    ordinary stores, which read every destination line first. A VM that reports its host's
    whole L3 to a few cores gets a threshold larger than a model's tensors (BENCHMARKS.md).
    """
    with contextlib.suppress(Exception):
        listed = subprocess.run(["/lib64/ld-linux-x86-64.so.2", "--list-tunables"],
                                capture_output=True, text=True, timeout=10).stdout
        for line in listed.splitlines():
            if "x86_non_temporal_threshold:" in line:
                size = int(line.split(":", 1)[1].split()[0], 16)
                return f"non-temporal stores from {human(size)} (glibc)"
    return "?"


# -- 1-4: checkpoints of one size ------------------------------------------------------------
@dataclass
class SizeResult:
    size: int
    stall_async: list[float] = field(default_factory=list)
    stall_sync: list[float] = field(default_factory=list)
    stall_torch: list[float] = field(default_factory=list)
    first_async_stall: float = float("nan")
    durable_async: list[float] = field(default_factory=list)
    durable_sync: list[float] = field(default_factory=list)
    raw_write: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    raw_read: list[float] = field(default_factory=list)
    ckpt_memory: int = 0
    restore_memory: int = 0
    checkpoint_bytes: int = 0


def bench_size(size: int, repeats: int, work: Path, log: Callable[[str], None]) -> SizeResult:
    res = SizeResult(size)
    model = TensorState(size)
    res.size = model.nbytes
    raw_path = work / "raw.bin"
    torch_path = work / "torch-save.pt"
    dirs = {"async": work / "async", "sync": work / "sync"}
    ckpts = {mode: Checkpointer(d, model=model, keep=1, save_every=None,
                                async_save=(mode == "async")) for mode, d in dirs.items()}
    loops = {mode: ck.batches(itertools.repeat(None)) for mode, ck in ckpts.items()}
    for it in loops.values():
        next(it)  # the first batch: safe points come after each one

    def step_with_checkpoint(mode: str) -> tuple[float, float]:
        """(stall, request -> durable). Durable is when the checkpoint was renamed into place
        and acknowledged, as the journal records it; pruning the old one comes after."""
        ck = ckpts[mode]
        ck.request_checkpoint()
        started = time.perf_counter()
        next(loops[mode])  # the safe point of the previous batch runs here: the stall
        stall = time.perf_counter() - started
        ck.flush()
        last = [e for e in read_events(ck.store.events_path) if e["event"] == "checkpoint"][-1]
        return stall, float(last["seconds"])

    gc.collect()
    with PeakSampler() as sampler:
        # The arena is reserved after the first step, in the background; a real run trains
        # for minutes before its first checkpoint, so give it the time it takes here.
        next(loops["async"])
        saver = ckpts["async"]._background
        while saver is not None and not saver.reserved:
            time.sleep(0.01)
        res.first_async_stall, _ = step_with_checkpoint("async")
    res.ckpt_memory = sampler.growth  # the arena (reserved ahead) and the write's buffers
    first = ckpts["async"].last_checkpoint
    res.checkpoint_bytes = first.nbytes if first is not None else res.size
    variants: dict[str, Callable[[], None]] = {
        "raw": lambda: res.raw_write.append(raw_write(model.views, raw_path)),
        "torch": lambda: res.stall_torch.append(
            plain_torch_save({"model": model.state_dict()}, torch_path)),
        "sync": lambda: _append_pair(res.stall_sync, res.durable_sync,
                                     step_with_checkpoint("sync")),
        "async": lambda: _append_pair(res.stall_async, res.durable_async,
                                      step_with_checkpoint("async")),
    }
    names = list(variants)
    # One untimed round first: the first write of each kind into a fresh directory (block
    # allocation, an empty journal) is slower in a way no later checkpoint is.
    warmups = {"raw": lambda: raw_write(model.views, raw_path),
               "torch": lambda: plain_torch_save({"model": model.state_dict()}, torch_path),
               "sync": lambda: step_with_checkpoint("sync"),
               "async": lambda: step_with_checkpoint("async")}
    for name in names:
        warmups[name]()
        drop_cache(work)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            variants[name]()
            drop_cache(work)
        log(f"  {human(res.size)} repeat {r + 1}/{repeats}: async stall "
            f"{res.stall_async[-1]:.3f}s durable {res.durable_async[-1]:.2f}s, sync "
            f"{res.stall_sync[-1]:.2f}s, torch.save {res.stall_torch[-1]:.2f}s, raw write "
            f"{res.raw_write[-1]:.2f}s")
    for ck in ckpts.values():
        ck.close()
    torch_path.unlink(missing_ok=True)

    # Restore into the same model, from a cold cache, against a raw read of the same bytes.
    buf = bytearray(16 * MiB)
    for r in range(repeats):
        drop_cache(dirs["async"])
        drop_cache(raw_path)
        if r % 2:
            res.raw_read.append(raw_read(raw_path, buf))
        gc.collect()
        with PeakSampler() as sampler:
            ck = Checkpointer(dirs["async"], model=model, keep=1, save_every=None)
        assert ck.restore_seconds is not None, "nothing was restored"
        res.restore.append(ck.restore_seconds)
        res.restore_memory = max(res.restore_memory, sampler.growth)
        ck.close()
        del ck
        gc.collect()
        if not r % 2:
            drop_cache(raw_path)
            res.raw_read.append(raw_read(raw_path, buf))
    raw_path.unlink(missing_ok=True)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    return res  # the caller collects the model and its host copy


def _append_pair(a: list[float], b: list[float], pair: tuple[float, float]) -> None:
    a.append(pair[0])
    b.append(pair[1])


# -- 5: the GIL: writer thread vs helper process ---------------------------------------------
_HELPER = """
import mmap, os, sys
from procckpt.training.save.writer import StreamingFileWriter
src, dst = sys.argv[1], sys.argv[2]
fd = os.open(src, os.O_RDONLY)
mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
mm.madvise(mmap.MADV_WILLNEED)
print("ready", flush=True)
sys.stdin.readline()
w = StreamingFileWriter(__import__("pathlib").Path(dst))
w.write(memoryview(mm))
w.finish()
print("done", flush=True)
"""


class PythonHeavyLoop:
    """A small, dispatch-bound training step. Steps like this hold the GIL most of the time,
    as the Python of a real training loop does, so they slow down when another thread of
    the process holds it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                         torch.nn.Linear(32, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x = torch.randn(8, 32)
        self.run(lambda: True)  # first-call costs (lazy imports) are not measured

    def run(self, until: Callable[[], bool]) -> float:
        """Step until ``until()`` (at least once); return steps per second."""
        threads = torch.get_num_threads()
        # One thread: tiny ops gain nothing from more, and a thread pool that spins on a
        # shared 2-core machine makes the rate depend on the neighbours, not on the GIL.
        torch.set_num_threads(1)
        steps = 0
        started = time.perf_counter()
        try:
            while True:
                loss = self.model(self.x).square().mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                steps += 1
                if until():
                    break
        finally:
            torch.set_num_threads(threads)
        return steps / (time.perf_counter() - started)


def bench_gil(size: int, repeats: int, work: Path, log: Callable[[str], None],  # noqa: PLR0915 (a benchmark, read top to bottom)
              ) -> dict[str, float]:
    shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    src = shm_dir / f"procckpt-bench-{os.getpid()}.bin"
    with open(src, "wb") as f:
        chunk = os.urandom(MiB)
        for _ in range(size // MiB):
            f.write(chunk)
    fd = os.open(src, os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    os.close(fd)
    view = memoryview(mm)
    dst = work / "gil.bin"
    rates: dict[str, list[float]] = {"idle": [], "thread": [], "process": []}
    writes: dict[str, list[float]] = {"thread": [], "process": []}
    held: list[float] = []
    loop = PythonHeavyLoop()
    try:
        for r in range(repeats):
            deadline = time.perf_counter() + 1.5
            rates["idle"].append(loop.run(lambda d=deadline: time.perf_counter() > d))

            def via_thread() -> None:
                writer = StreamingFileWriter(dst)
                done = threading.Event()
                spent: list[float] = []

                def write() -> None:
                    t0 = time.perf_counter()
                    writer.write(view)
                    writer.finish()
                    spent.append(time.perf_counter() - t0)
                    done.set()

                thread = threading.Thread(target=write)
                thread.start()
                rates["thread"].append(loop.run(done.is_set))
                thread.join()
                writes["thread"].append(spent[0])
                # Outside the GIL-free calls (CRC, write, fadvise, fsync) the thread may hold it.
                held.append(max(0.0, spent[0] - writer.io_seconds))
                dst.unlink()

            def via_process() -> None:
                helper = subprocess.Popen(
                    [sys.executable, "-c", _HELPER, str(src), str(dst)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert helper.stdout is not None and helper.stdin is not None
                helper.stdout.readline()  # "ready": the interpreter start is not measured
                finished = threading.Event()
                went: list[float] = []

                def watch() -> None:
                    assert helper.stdout is not None
                    helper.stdout.readline()
                    writes["process"].append(time.perf_counter() - went[0])
                    finished.set()

                watcher = threading.Thread(target=watch)
                watcher.start()
                went.append(time.perf_counter())
                helper.stdin.write("go\n")
                helper.stdin.flush()
                rates["process"].append(loop.run(finished.is_set))
                watcher.join()
                helper.wait()
                dst.unlink()

            for variant in ((via_thread, via_process) if r % 2 == 0
                            else (via_process, via_thread)):
                variant()
            log(f"  GIL repeat {r + 1}/{repeats}: steps/s idle {rates['idle'][-1]:.0f}, "
                f"writer thread {rates['thread'][-1]:.0f} (write {writes['thread'][-1]:.2f}s), "
                f"helper process {rates['process'][-1]:.0f} (write "
                f"{writes['process'][-1]:.2f}s)")
    finally:
        view.release()
        mm.close()
        src.unlink(missing_ok=True)
    idle = median(rates["idle"])
    return {"idle": idle, "size": size, "thread": median(rates["thread"]) / idle,
            "process": median(rates["process"]) / idle,
            "write_thread": median(writes["thread"]), "write_process": median(writes["process"]),
            "held_ms": median(held) * 1e3}


# -- 6: the launcher -------------------------------------------------------------------------
def worker_main(argv: list[str]) -> None:
    """``python benchmarks/bench.py worker``: a small training loop that reports step times."""
    p = argparse.ArgumentParser(prog="benchmarks/bench.py worker")
    p.add_argument("--mode", choices=("plain", "procckpt"), required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core for the step, one for everything else
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(128, 256)
    if args.mode == "procckpt":
        ck = Checkpointer(args.dir, model=model, optimizer=opt, save_every=None)
        loader: Iterator[Any] = ck.batches(itertools.repeat(None))
    else:
        loader = iter(itertools.repeat(None))
    times: list[float] = []
    started = last = time.perf_counter()
    warm = False
    for _ in loader:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        if warm:
            times.append(now - last)
        elif now - started > 1.0:
            warm = True
            print("warm", flush=True)
        last = now
        if now - started > args.seconds:
            break
    print(json.dumps({"median": median(times), "mean": sum(times) / len(times),
                      "steps": len(times)}), flush=True)


@dataclass
class LauncherResult:
    plain: list[float] = field(default_factory=list)
    launched: list[float] = field(default_factory=list)
    idle_cpu: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    uss: list[int] = field(default_factory=list)
    safe_point_us: float = float("nan")


def _cpu_seconds(proc: psutil.Process) -> float:
    """CPU time of a process, in ns resolution where /proc/PID/schedstat has it."""
    try:
        return int(Path(f"/proc/{proc.pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        t = proc.cpu_times()
        return t.user + t.system


def bench_launcher(repeats: int, seconds: float, work: Path, log: Callable[[str], None],
                   ) -> LauncherResult:
    res = LauncherResult()
    procckpt = shutil.which("procckpt")
    launcher_cmd = ([procckpt] if procckpt else [sys.executable, "-m", "procckpt.cli"])
    env = dict(os.environ, PROCCKPT_LOG_LEVEL="WARNING")
    worker = [sys.executable, str(Path(__file__).absolute()), "worker", "--seconds",
              str(seconds)]
    for r in range(repeats):
        for launched in ((False, True) if r % 2 == 0 else (True, False)):
            d = work / f"launcher-{r}"
            if launched:
                cmd = [*launcher_cmd, "run", "--engine", "hooks", "--dir", str(d), "--", *worker,
                       "--mode", "procckpt"]
            else:
                cmd = [*worker, "--mode", "plain"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=work)
            assert proc.stdout is not None
            launcher = psutil.Process(proc.pid)
            proc.stdout.readline()  # "warm"
            t0, c0 = time.perf_counter(), _cpu_seconds(launcher) if launched else 0.0
            stats = json.loads(proc.stdout.readline())
            if launched:
                with contextlib.suppress(psutil.Error):
                    c1 = _cpu_seconds(launcher)
                    info = launcher.memory_full_info()
                    res.idle_cpu.append((c1 - c0) / (time.perf_counter() - t0))
                    res.rss.append(info.rss)
                    res.uss.append(info.uss)
            proc.wait()
            shutil.rmtree(d, ignore_errors=True)
            (res.launched if launched else res.plain).append(stats["median"])
        log(f"  launcher repeat {r + 1}/{repeats}: step {res.plain[-1] * 1e3:.3f} ms plain, "
            f"{res.launched[-1] * 1e3:.3f} ms under procckpt run; launcher CPU "
            f"{res.idle_cpu[-1] * 100:.3f}% of a core, RSS {res.rss[-1] / 1e6:.1f} MB")
    res.safe_point_us = safe_point_cost(work)
    return res


def safe_point_cost(work: Path, steps: int = 200_000) -> float:
    """Microseconds a safe point with nothing to do adds to each step, as seen under the
    launcher (a control channel that is polled): ckpt.batches() vs. a bare iterator."""
    d = work / "safe-point"
    old = {k: os.environ.get(k) for k in ("PROCCKPT_TOKEN", "PROCCKPT_DIR")}
    os.environ["PROCCKPT_TOKEN"] = "bench"
    os.environ["PROCCKPT_DIR"] = str(d)
    try:
        ck = Checkpointer(d, save_every=None)
        best_bare, best_ck = float("inf"), float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for _ in zip(range(steps), itertools.repeat(None)):
                pass
            best_bare = min(best_bare, time.perf_counter() - started)
            started = time.perf_counter()
            for _ in zip(range(steps), ck.batches(itertools.repeat(None))):
                pass
            best_ck = min(best_ck, time.perf_counter() - started)
        ck.close()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(d, ignore_errors=True)
    return (best_ck - best_bare) / steps * 1e6


# -- the report ------------------------------------------------------------------------------
def _quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``xs`` (sorted), by the nearest ranks."""
    if not xs:
        return float("nan"), float("nan")
    n = len(xs)
    return xs[(n - 1) // 4], xs[(3 * (n - 1) + 3) // 4]


def verdict(value: float, target: float) -> str:
    if value != value:  # NaN
        return ""
    return "ok" if value <= target else "MISSED"


def report(sizes: list[SizeResult], gil: dict[str, float] | None,  # noqa: PLR0915 (one report, section by section)
           launcher: LauncherResult | None, info: dict[str, str], markdown: bool) -> str:
    lines: list[str] = []
    cols = [human(s.size) for s in sizes]

    def row(label: str, values: list[str], note: str = "") -> None:
        if markdown:
            lines.append(f"| {label} | " + " | ".join(values) + f" | {note} |")
        else:
            lines.append(f"  {label:<44}" + "".join(f"{v:>18}" for v in values)
                         + (f"   {note}" if note else ""))

    def header(title: str) -> None:
        if markdown:
            lines.extend(["", f"**{title}**", "", "| | " + " | ".join(cols) + " | target |",
                          "|---|" + "---|" * len(cols) + "---|"])
        else:
            lines.append(f"{title}:")

    if markdown:
        lines.append("Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()))
    else:
        lines.append("procckpt benchmark")
        lines.extend(f"  {k:<9} {v}" for k, v in info.items())
        lines.append("  " + " " * 44 + "".join(f"{c:>18}" for c in cols))

    def timed(label: str, values: list[list[float]], digits: int = 3) -> None:
        row(label, [f"{median(v):.{digits}f} ({min(v, default=float('nan')):.{digits}f})"
                    for v in values])

    def ratio_rows(num: list[list[float]], den: list[list[float]], target: float,
                   only_from: int = 0, digits: int = 2) -> None:
        med = [median(a) / median(b) for a, b in zip(num, den)]
        best = [min(a) / min(b) if a and b else float("nan") for a, b in zip(num, den)]
        marks = " ".join(verdict(x, target) for s, x in zip(sizes, med) if s.size >= only_from)
        row("ratio of medians", [f"{x:.{digits}f}" for x in med], f"<= {target} {marks}")
        row("ratio of minimums", [f"{x:.{digits}f}" for x in best])

    header("Training stall per checkpoint, s: median (min)")
    timed("procckpt async", [s.stall_async for s in sizes], 4)
    timed("procckpt sync", [s.stall_sync for s in sizes])
    timed("torch.save + fsync", [s.stall_torch for s in sizes])
    row("async / (torch.save + fsync):", [""] * len(sizes))
    ratio_rows([s.stall_async for s in sizes], [s.stall_torch for s in sizes],
               TARGETS["stall"], only_from=GiB, digits=3)
    row("first async checkpoint (arena reserved ahead)",
        [f"{s.first_async_stall:.3f}" for s in sizes])
    firsts = [s.first_async_stall / statistics.median(s.stall_async) for s in sizes]
    row("first / steady async stall", [f"{x:.2f}" for x in firsts],
        f"<= {TARGETS['first']} " + " ".join(verdict(x, TARGETS["first"]) for x in firsts))

    header("Request -> durable checkpoint, s: median (min)")
    timed("procckpt async", [s.durable_async for s in sizes])
    timed("raw write + fsync of the same bytes", [s.raw_write for s in sizes])
    ratio_rows([s.durable_async for s in sizes], [s.raw_write for s in sizes],
               TARGETS["durable"])
    timed("procckpt sync (a stop's checkpoint)", [s.durable_sync for s in sizes])
    ratio_rows([s.durable_sync for s in sizes], [s.raw_write for s in sizes],
               TARGETS["stop"])

    header("Restore from a cold page cache, s: median (min)")
    timed("procckpt (verify, load, load_state_dict)", [s.restore for s in sizes])
    timed("raw read of the same bytes", [s.raw_read for s in sizes])
    ratio_rows([s.restore for s in sizes], [s.raw_read for s in sizes], TARGETS["restore"])

    header("Extra host memory: anonymous RSS growth / checkpoint size")
    ratios = [s.ckpt_memory / s.checkpoint_bytes for s in sizes]
    excess = [s.ckpt_memory - s.checkpoint_bytes for s in sizes]
    row("first async checkpoint", [f"{x:.4f}" for x in ratios],
        f"<= {TARGETS['memory']} " + " ".join(verdict(x, TARGETS["memory"]) for x in ratios))
    # What does not grow with the state (the writer's gathering buffer, its thread's stack,
    # the payload's Python objects) shows as a ratio just above 1 at small sizes.
    row("growth beyond 1x the checkpoint, KiB", [f"{x / 1024:+.0f}" for x in excess])
    row("restore", [f"{s.restore_memory / s.checkpoint_bytes:.3f}" for s in sizes])

    if gil is not None:
        title = (f"GIL: a Python-heavy training loop ({gil['idle']:.0f} steps/s alone) while "
                 f"{human(gil['size'])} is written in the background")
        items = [
            ("writer thread (procckpt)", f"{gil['thread']:.2f}", f"{gil['write_thread']:.2f} s"),
            ("helper process", f"{gil['process']:.2f}", f"{gil['write_process']:.2f} s"),
        ]
        note = (f"the writer thread held the GIL at most {gil['held_ms']:.1f} ms in all "
                "(its time outside CRC, write, fadvise and fsync calls)")
        if markdown:
            lines.extend(["", f"**{title}**", "",
                          "| writer | loop steps/s relative to no write | write took |",
                          "|---|---|---|"])
            lines.extend(f"| {a} | {b} | {c} |" for a, b, c in items)
            lines.extend(["", note[0].upper() + note[1:] + "."])
        else:
            lines.append(title + ":")
            lines.extend(f"  {a:<44}{b:>14}{c:>14}   (loop speed, write time)"
                         for a, b, c in items)
            lines.append(f"  {note}")

    if launcher is not None:
        plain, launched = median(launcher.plain), median(launcher.launched)
        # Each pair ran back to back; the ratio within a pair cancels most of the drift of a
        # shared machine, the spread across pairs says how much is left.
        pairs = sorted(b / a - 1 for a, b in zip(launcher.plain, launcher.launched))
        overhead = median(pairs)
        low, high = _quartiles(pairs)
        cpu, rss = median(launcher.idle_cpu), median([float(x) for x in launcher.rss])
        uss = median([float(x) for x in launcher.uss])
        sp = launcher.safe_point_us
        # What procckpt adds to a step: the safe point, and at most the launcher's CPU time
        # (were every core busy with training, the launcher would take it from a step).
        parts = sp / 1e6 / plain + cpu
        if high <= TARGETS["step"]:
            measured = "ok"
        elif low > TARGETS["step"]:
            measured = "MISSED"
        else:
            measured = "within the noise"
        items = [
            ("step time, plain loop (median)", f"{plain * 1e3:.3f} ms", ""),
            ("step time under procckpt run, no checkpoint", f"{launched * 1e3:.3f} ms", ""),
            (f"step-time overhead, end to end ({len(pairs)} pairs)",
             f"{overhead:+.2%} (middle half {low:+.1%} .. {high:+.1%})",
             f"<= {TARGETS['step']:.1%} {measured}"),
            ("safe-point cost per step (microbenchmark)",
             f"{sp:.2f} us = {sp / 1e6 / plain:.3%} of this step", ""),
            ("step-time overhead from its parts (safe point + launcher CPU)", f"{parts:.3%}",
             f"<= {TARGETS['step']:.1%} {verdict(parts, TARGETS['step'])}"),
            ("launcher CPU while idle", f"{cpu:.3%} of a core",
             f"<= {TARGETS['idle_cpu']:.1%} {verdict(cpu, TARGETS['idle_cpu'])}"),
            ("launcher RSS (USS)", f"{rss / 1e6:.1f} MB ({uss / 1e6:.1f} MB)",
             f"<= 40 MB {verdict(rss, TARGETS['idle_rss'])}"),
        ]
        if markdown:
            lines.extend(["", "**procckpt run with no checkpoint in flight**", "",
                          "| | measured | target |", "|---|---|---|"])
            lines.extend(f"| {a} | {b} | {c} |" for a, b, c in items)
        else:
            lines.append("procckpt run with no checkpoint in flight:")
            lines.extend(f"  {a:<62}{b:>34}   {c}" for a, b, c in items)
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------
def default_sizes() -> list[int]:
    sizes = [64 * MiB, GiB]
    # 4 GiB needs the model, the host copy and room for the page cache, on a shared machine.
    if psutil.virtual_memory().available > 14 * GiB:
        sizes.append(4 * GiB)
    return sizes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        worker_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python benchmarks/bench.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--sizes", help="state sizes, e.g. 64MiB,1GiB [64MiB,1GiB and 4GiB when "
                                   "memory allows]")
    p.add_argument("--repeats", type=int, default=5, help="repeats per measurement [5]")
    p.add_argument("--dir", default=".", help="where to write (the disk to measure) [.]")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: gil,launcher")
    p.add_argument("--launcher-seconds", type=float, default=6.0,
                   help="seconds of each run of the step-overhead comparison [6]")
    p.add_argument("--gil-size", help="bytes written in the GIL comparison [1GiB or less]")
    p.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        sizes = [parse_size(s) for s in (args.sizes or "1MiB").split(",")]
        repeats, gil_size, launcher_seconds, launcher_repeats = 1, 4 * MiB, 2.5, 1
    else:
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else default_sizes()
        repeats = args.repeats
        gil_size, launcher_seconds = min(max(sizes), GiB), args.launcher_seconds
        launcher_repeats = max(6, 2 * repeats)  # short runs, many pairs
    if args.gil_size:
        gil_size = parse_size(args.gil_size)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    os.environ.pop("PROCCKPT_TOKEN", None)  # never talk to a launcher that runs this
    os.environ.setdefault("PROCCKPT_LOG_LEVEL", "WARNING")  # one line per checkpoint is noise
    info = machine()
    # Our own handler first, so that the Checkpointers made here leave SIGTERM alone and it
    # stops the benchmark (cleaning up) instead of asking for a checkpoint.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="procckpt-bench-", dir=args.dir)).absolute()
    try:
        results = []
        for size in sizes:
            log(f"state size {human(size)}:")
            results.append(bench_size(size, repeats, work, log))
            gc.collect()  # the model, its host copy and their reference cycles
        gil = None if "gil" in skip else bench_gil(gil_size, repeats, work, log)
        launcher = (None if "launcher" in skip
                    else bench_launcher(launcher_repeats, launcher_seconds, work, log))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(results, gil, launcher, info, markdown=False))
    if args.markdown:
        Path(args.markdown).write_text(report(results, gil, launcher, info, markdown=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
