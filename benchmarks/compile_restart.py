"""How long a torch.compile'd training takes to reach its first step after a restart, with
Inductor's cache kept in the checkpoint dir (procckpt run's default) and without it (a fresh
cache every cycle: what a requeue onto another node, with an empty /tmp, would see).

Runs a small compiled MLP under ``procckpt run --time-limit`` for a few cycles each way, then
reads the time to the first step of every cycle from the events journal (the cycle's start to
the Checkpointer's ``ready``, plus the first step) and the goodput's ``startup`` per cycle,
which counts the compile (the first step's excess over the second).

    python benchmarks/compile_restart.py [--cycles 3] [--time-limit 75]

Prints one table per way and the ratio of the later cycles' median to the first cycle's.
Numbers from one run; the machine is shared, so compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN = '''
import os, sys, tempfile, time
if os.environ.get("BENCH_FRESH_CACHE"):  # another node every cycle: nothing compiled yet
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-fresh-")
import torch
from torch import nn
import procckpt

torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())],
                      nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model)
ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for step in ckpt.steps(int(sys.argv[1])):
    loss = nn.functional.cross_entropy(compiled(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.05)
'''


def run_way(name: str, fresh: bool, cycles: int, limit: int, work: Path) -> list[dict]:
    ckpt = work / name / "ckpt"
    ckpt.parent.mkdir(parents=True)
    script = ckpt.parent / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if fresh:
        env["BENCH_FRESH_CACHE"] = "1"
    # Enough steps to outlast the cycles asked for: ~0.06 s a step once compiled.
    steps = int(cycles * limit / 0.06)
    subprocess.run([sys.executable, "-m", "procckpt", "run", "--dir", str(ckpt),
                    "--time-limit", f"{limit}s", "--grace", "10s", "--max-restarts",
                    str(cycles - 1), "--", sys.executable, str(script), str(steps)],
                   cwd=ckpt.parent, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=cycles * limit + 300)
    status = subprocess.run([sys.executable, "-m", "procckpt", "status", "--json", str(ckpt)],
                            capture_output=True, text=True, check=True)
    goodput = json.loads(status.stdout)["goodput"]
    events = [json.loads(line) for line in (ckpt / "events.jsonl").read_text().splitlines()]
    rows = []
    for c in goodput["cycles"]:
        inside = [e for e in events if c["start"] <= e["time"] <= c["end"]]
        ready = next((e for e in inside if e["event"] == "ready"), None)
        warm = next((e for e in inside if e["event"] == "warm"), None)
        if ready is None or warm is None:
            continue
        first_step = ready["time"] - c["start"] + warm["first"]
        rows.append({"cycle": c["cycle"], "first_step": first_step,
                     "startup": c["seconds"]["startup"], "compile": warm["first"] - warm["second"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--time-limit", type=int, default=75)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; {args.cycles} cycles of "
          f"{args.time_limit}s each way")
    with tempfile.TemporaryDirectory(prefix="compile-restart-") as tmp:
        ratios = {}
        for name, fresh in (("cache kept in the checkpoint dir", False),
                            ("a fresh cache every cycle", True)):
            rows = run_way(name.split()[1], fresh, args.cycles, args.time_limit, Path(tmp))
            print(f"\n{name}:")
            print(f"  {'cycle':>5}  {'to first step':>13}  {'startup':>8}  {'first-second':>12}")
            for r in rows:
                print(f"  {r['cycle']:>5}  {r['first_step']:>12.1f}s  {r['startup']:>7.1f}s  "
                      f"{r['compile']:>11.1f}s")
            if len(rows) >= 2:
                later = statistics.median(r["first_step"] for r in rows[1:])
                ratios[name] = later / rows[0]["first_step"]
                print(f"  later cycles' median / first cycle: {ratios[name]:.2f}")
        if len(ratios) == 2:
            kept, fresh_ = ratios.values()
            print(f"\nrestart with the kept cache reaches its first step in {kept:.2f}x the first "
                  f"cycle's time; with a fresh cache in {fresh_:.2f}x")


if __name__ == "__main__":
    main()
