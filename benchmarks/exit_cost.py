"""``python benchmarks/exit_cost.py``: what a training process's exit costs, with and without
the interpreter's last garbage collection.

A process that made a ``Checkpointer`` skips that collection (training/shutdown.py);
``PROCCKPT_FINAL_GC=1`` keeps it. The script here imports torch, builds an MLP and an AdamW
optimizer, trains a few steps under a Checkpointer, and writes down the moment its last
statement ran. Both kinds run alternately, ``--rounds`` pairs; for each run the parent takes the
process's processor time (``wait4``) and the time from that last statement to the moment the
process was reaped. It prints the medians of each kind and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import sys, time
import torch
import procckpt

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = procckpt.Checkpointer(sys.argv[1], model=model, optimizer=optimizer, async_save=False)
for _ in ckpt.steps(int(sys.argv[3])):
    loss = model(torch.randn(32, 64)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
with open(sys.argv[2], "w") as f:
    f.write(repr(time.time()))
"""


def one_run(work: Path, n: int, keep_collection: bool, steps: int) -> tuple[float, float]:
    """(processor seconds of the process, seconds from its last statement to its reaping)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROCCKPT_")}
    env["OMP_NUM_THREADS"] = "1"
    if keep_collection:
        env["PROCCKPT_FINAL_GC"] = "1"
    script, stamp = work / "train.py", work / f"last-{n}"
    proc = subprocess.Popen([sys.executable, str(script), str(work / f"ckpt-{n}"), str(stamp),
                             str(steps)], env=env, cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    reaped = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the training script exited with {proc.returncode}")
    return usage.ru_utime + usage.ru_stime, reaped - float(stamp.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="pairs of runs, alternated")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="exit-cost-", dir=".") as tmp:
        work = Path(tmp).absolute()
        (work / "train.py").write_text(SCRIPT)
        n = 0
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for keep in order:
                runs[keep].append(one_run(work, n, keep, args.steps))
                n += 1
    print(f"{args.rounds} runs of each kind, alternated; medians")
    print(f"{'':38} {'process CPU s':>14} {'last statement -> reaped s':>27}")
    medians = {}
    for keep, label in ((True, "with the final collection (FINAL_GC=1)"),
                        (False, "without it (the default)")):
        cpu = statistics.median(r[0] for r in runs[keep])
        tail = statistics.median(r[1] for r in runs[keep])
        medians[keep] = (cpu, tail)
        print(f"{label:38} {cpu:14.3f} {tail:27.3f}")
    (cpu_with, tail_with), (cpu_without, tail_without) = medians[True], medians[False]
    print(f"ratio without / with: process CPU {cpu_without / cpu_with:.2f}, "
          f"exit {tail_without / tail_with:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
