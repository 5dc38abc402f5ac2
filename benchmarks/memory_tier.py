"""What a crash costs with the memory tier (docs/crashes.md): a training with 64 MB of state
and 25-ms steps under ``procckpt run --restart-on-failure``, its training process SIGKILLed at
random moments, as an OOM kill would; every figure a ratio taken in this one run.

    python benchmarks/memory_tier.py [--kills 8] [--mb 64] [--step-ms 25] [--seed 0]

Prints, against the targets of issue 55:

- steps lost a crash (trained, then trained again after the restart), in seconds of steps
  (target: at most 1 s);
- the time from the kill to the first resumed step, against ``python -c "import torch"``
  measured here (target: at most 1.0x; a restart starts a fresh interpreter, so it is more
  until restarts start warm);
- the tier's cost a step: the time of steps 200 to 1000 with the tier against without, in
  rounds of one run each, their order swapped every round; the median of the rounds' ratios
  (target: at most 1 %). The window opens once the warm restart's spare has imported torch
  (about 2 s after the first step here: its import slows the training while it runs, with
  the tier or without it, and a window that caught more of it in one arm than in the other
  measured that, not the tier). It is long enough to hold 25-30 slots: in a window of 250
  steps, one slot more or less (7 or 8) moved the figure by 0.1 %;
- how fast the restarts restored their state (the kept slot, read back from the checkpoint
  dir; target: at least 3 GB/s), and how many restores copied the optimizer's state into
  memory touched already: the optimizer's own earlier state (this training's optimizer steps
  before its Checkpointer is made, state/mapped.py), or the region the warm restart's spare
  touched while it waited (training/state/reserve.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PYTHON = sys.executable
PROCCKPT = [PYTHON, "-m", "procckpt"]


#: A step sleeps until this long before its end, then watches the clock: a sleep's own end
#: comes late by 0.1-0.4 ms here, by more or less from run to run, which moved a run's steps
#: by 0.3 % (of 25 ms) against the next run's, as much as the tier's cost. A host that waits
#: for its GPU spins too (CUDA's default synchronisation spins before it yields).
SPIN = 0.001


def train(args: argparse.Namespace) -> None:
    """The training: 16 linear layers under Adam, ``--mb`` MB of state (the weights and the
    two moments); each step trains one layer in turn, so that a step leaves the processor
    mostly idle, as a GPU training's host is, and sleeps to ``--step-ms``."""
    import torch
    from torch import nn

    from procckpt import Checkpointer

    torch.manual_seed(0)
    layers = 16
    width = int((args.mb * 1e6 / 12 / layers) ** 0.5)
    model = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for weight in model.parameters():  # every moment made at once: the state's full size
        weight.grad = torch.zeros_like(weight)
    optimizer.step()
    ckpt = Checkpointer(model=model, optimizer=optimizer)
    x = torch.randn(16, width)
    step_seconds = args.step_ms / 1e3
    print(f"resumed {ckpt.step} {time.time():.4f}", flush=True)
    for _ in ckpt.steps(args.steps):
        started = time.perf_counter()
        layer = model[ckpt.step % layers]
        loss = layer(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {ckpt.step + 1} {time.time():.4f}", flush=True)
        end = started + step_seconds
        time.sleep(max(0.0, end - SPIN - time.perf_counter()))
        while time.perf_counter() < end:  # (see SPIN)
            pass
    tier = getattr(ckpt, "_tier", None)  # (the cadence it settled on: no event says it all)
    if tier is not None and tier._stalls:
        print(f"tier every {tier.every} copy {statistics.median(tier._stalls):.5f} "
              f"slots {tier.slots}", flush=True)


def _steps(text: str) -> list[tuple[int, float]]:
    return [(int(m[1]), float(m[2])) for m in re.finditer(r"^step (\d+) ([\d.]+)$", text,
                                                          re.M)]


def _import_torch() -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([PYTHON, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _launch(work: Path, name: str, train_args: list[str], *options: str,
            ) -> tuple[subprocess.Popen[str], Path, Path]:
    folder = work / name
    folder.mkdir()
    out, err = folder / "stdout", folder / "stderr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*PROCCKPT, "run", "--dir", str(folder / "ckpt"), *options, "--",
                             PYTHON, __file__, "--train", *train_args], cwd=folder, env=env,
                            stdout=open(out, "w"), stderr=open(err, "w"), text=True,
                            start_new_session=True)
    return proc, out, err


#: The steps the tier's cost is measured over (see the module).
WINDOW = (200, 1000)


def _step_cost(work: Path, train_args: list[str], rounds: int,
               ) -> tuple[float, float, list[float], dict[str, Any]]:
    """Median seconds of the :data:`WINDOW`'s steps without and with the tier, the median of
    each round's ratio (with / without: a round's two runs are neighbours in time, so a VM
    that slows for a minute slows both), and the cadence the tier settled on (its last
    run's)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    cadence: dict[str, Any] = {}
    first, last = WINDOW
    for i in range(rounds):
        for tier in ((False, True) if i % 2 == 0 else (True, False)):
            folder = f"cost-{i}-{tier}"
            proc, out, err = _launch(work, folder, [*train_args, "--steps", str(last)],
                                     "--memory-tier" if tier else "--no-memory-tier",
                                     "--interval", "off")
            if proc.wait() != 0:
                raise SystemExit(f"the training failed: {err.read_text()[-2000:]}")
            text = out.read_text()
            steps = dict(_steps(text))
            times[tier].append(steps[last] - steps[first])
            settled = re.search(r"^tier every (\d+) copy ([\d.]+) slots (\d+)$", text, re.M)
            if tier and settled:
                cadence = {"every": int(settled[1]), "copy": float(settled[2]),
                           "slots": int(settled[3])}
    ratios = [t / p for p, t in zip(times[False], times[True])]
    return (statistics.median(times[False]), statistics.median(times[True]), ratios,
            cadence)


def _crashes(work: Path, train_args: list[str], kills: int, rng: random.Random,
             ) -> tuple[list[int], list[float], list[float], int, str]:
    """Kill the training ``kills`` times; the steps each lost, the seconds from each kill to
    the first resumed step, the restores' speeds (bytes/s), how many of them copied into
    memory touched already, the launcher's log."""
    proc, out, err = _launch(work, "crashes", [*train_args, "--steps", "100000"],
                             "--restart-on-failure", "--max-restarts", str(kills + 5))
    lost, recoveries = [], []
    try:
        for _ in range(kills):
            seen = len(_steps(out.read_text()))
            deadline = time.monotonic() + 600
            while len(_steps(out.read_text())) < seen + 40:  # the restart trained a second
                assert proc.poll() is None and time.monotonic() < deadline, \
                    err.read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(rng.uniform(1.0, 5.0))
            pid = _training_pid(err)
            assert pid is not None, err.read_text()[-3000:]
            lives = len(re.findall(r"^resumed ", out.read_text(), re.M))
            killed_at = time.time()
            os.kill(_command_of(pid), signal.SIGKILL)  # as the OOM killer does
            while _training_pid(err) == pid:
                assert proc.poll() is None, err.read_text()[-3000:]
                time.sleep(0.02)
            deadline = time.monotonic() + 600
            while True:
                text = out.read_text()
                resumed = [m for m in re.finditer(r"^resumed (\d+) ", text, re.M)]
                after = _steps(text[resumed[-1].end():]) if len(resumed) > lives else []
                if after:
                    break
                assert time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.02)
            before = [s for s, t in _steps(text[:resumed[-1].start()]) if t <= killed_at]
            lost.append(max(before) - int(resumed[-1][1]))
            recoveries.append(after[0][1] - killed_at)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    journal = [json.loads(line) for line in
               (out.parent / "ckpt" / "events.jsonl").read_text().splitlines()]
    timed = [e for e in journal
             if e.get("event") == "recovery" and e.get("restore") and e.get("bytes")]
    speeds = [e["bytes"] / e["restore"] for e in timed]
    touched = sum(1 for e in timed if e.get("touched"))
    return lost, recoveries, speeds, touched, err.read_text()


def _training_pid(err: Path) -> int | None:
    """The pid the launcher says it started: the keeper in front of the training."""
    found = re.findall(r"cycle \d+: started .* \(pid (\d+)", err.read_text())
    return int(found[-1]) if found else None


def _command_of(keeper: int) -> int:
    """The training's own process, the keeper's one child."""
    import psutil

    while not (below := psutil.Process(keeper).children()):
        time.sleep(0.01)
    return below[0].pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=5, help="alternated runs for the cost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train:
        train(args)
        return 0
    train_args = ["--mb", str(args.mb), "--step-ms", str(args.step_ms)]
    work = Path(tempfile.mkdtemp(prefix="memory-tier-"))
    try:
        cold = _import_torch()
        plain, tiered, ratios, cadence = _step_cost(work, train_args, args.rounds)
        lost, recoveries, speeds, touched, log = _crashes(work, train_args, args.kills,
                                                 random.Random(args.seed))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    step = args.step_ms / 1e3
    said = re.search(r"memory tier: (\S+ \S+) a slot", log)
    settled = (f"written every {cadence['every']} steps at the end of a cost run (the copy "
               f"took {cadence['copy'] * 1e3:.1f} ms, median)" if cadence
               else "no cadence said")
    rows = [
        ("state", f"{args.mb:.0f} MB, steps of {args.step_ms:.0f} ms; memory tier: "
                  f"{said[1] + ' a slot' if said else 'the tier said nothing'}, {settled}"),
        ("steps lost a crash", f"median {statistics.median(lost):.0f}, max {max(lost)} "
                               f"({max(lost) * step:.2f} s of steps; target <= 1 s) over "
                               f"{len(lost)} kills"),
        ("kill -> first resumed step", f"median {statistics.median(recoveries):.2f} s = "
                                       f"{statistics.median(recoveries) / cold:.1f}x "
                                       f"`import torch` ({cold:.2f} s; target <= 1.0x)"),
        ("the tier's cost a step", f"{statistics.median(ratios) - 1:+.2%} (steps {WINDOW[0]} "
                                   f"to {WINDOW[1]}, the median of {len(ratios)} rounds: "
                                   f"{' '.join(f'{r - 1:+.2%}' for r in ratios)}; medians "
                                   f"{plain:.2f} s without, {tiered:.2f} s with; "
                                   "target <= 1 %)"),
        ("restore", (f"median {statistics.median(speeds) / 1e9:.2f} GB/s from the kept slot "
                     f"(target >= 3 GB/s); {touched} of {len(speeds)} into memory touched "
                     "already") if speeds else "no restore timed"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
