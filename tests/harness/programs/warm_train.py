"""What a script can see of how it was started, written once per life, then a small training
that kills itself (SIGKILL, as the OOM killer does) at a step in each of its first lives:
warm restarts must start it as a cold start does."""

from __future__ import annotations

import sys

PRELOADED = "torch" in sys.modules  # (before this script imported anything of its own)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

#: Whether the default random stream is where its seed put it, and the threads, as the script
#: finds them: a spare's imports and its rehearsed restore (training/state/rehearsal.py) must
#: leave both as a cold start has them.
UNDRAWN = torch.equal(torch.Generator().manual_seed(torch.initial_seed()).get_state(),
                      torch.get_rng_state())
THREADS = len(os.listdir("/proc/self/task"))


def _scheduling() -> list[object]:
    """How the scheduler weighs this process: its policy, its nice and its session's
    (autogroup's) nice, where the kernel has them. A spare imports at a lower weight
    (launcher/warm.py) and must hand the script the one a cold start has."""
    try:
        with open("/proc/self/autogroup") as f:
            said = f.read().split()
    except OSError:
        said = []
    # Empty for a process in the default group (one whose session began at boot).
    group = said[-1] if said else None
    return [os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), group]

import procckpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, nargs="*", default=[],
                        help="the steps to die at, one per life: life N dies at the Nth")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--lives", required=True, help="a file that gets a line per life")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    life = {"argv": sys.argv, "orig_argv": sys.orig_argv, "file": __file__, "name": __name__,
            "path0": sys.path[0], "cwd": os.getcwd(), "var": os.environ.get("WARM_TEST_VAR"),
            "restart": os.environ.get("PROCCKPT_RESTART"), "preloaded": PRELOADED,
            "executable": sys.executable, "pid": os.getpid(), "pgid": os.getpgid(0),
            "sigint": str(signal.getsignal(signal.SIGINT)),
            "sigterm": str(signal.getsignal(signal.SIGTERM)), "undrawn": UNDRAWN,
            "threads": THREADS, "scheduling": _scheduling()}
    lives = _note(Path(args.lives), life)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    for step in ckpt.steps(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step + 1}", flush=True)
        if lives <= len(args.kill_at) and step + 1 == args.kill_at[lives - 1]:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
    torch.save(model.state_dict(), args.out)


def _note(lives: Path, life: dict[str, object]) -> int:
    """Add this life to the file; how many lives it holds now."""
    with open(lives, "a") as f:
        f.write(json.dumps(life) + "\n")
    return len(lives.read_text().splitlines())


if __name__ == "__main__":
    main()
