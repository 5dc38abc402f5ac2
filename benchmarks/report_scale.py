"""``python benchmarks/report_scale.py``: how ``procckpt report`` grows with the journal.

Writes journals of N and 2N cycles (each cycle: start-up, a periodic checkpoint, the deadline's
checkpoint, a restart; eight events, as a time-limit run journals them), renders each page
three times and prints the median seconds and their ratio: about 2 when the report is linear
in the cycles, about 4 when it is quadratic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from procckpt.inspect.report import render_report
from procckpt.store import MARKER


def write_journal(root: Path, cycles: int) -> None:
    root.mkdir(parents=True)
    (root / MARKER).write_text(json.dumps({"format": 1, "created": 0.0}))
    t = 1000.0
    with open(root / "events.jsonl", "w") as f:
        def say(**event: object) -> None:
            f.write(json.dumps(event) + "\n")

        say(event="start", time=t, job_id=None)
        for c in range(1, cycles + 1):
            say(event="cycle", time=t, cycle=c, pid=1, restart=c - 1, engine="hooks",
                lead=2.0, interval=5.0)
            say(event="ready", time=t + 1, restore=0.1)
            say(event="checkpoint", time=t + 5, seconds=0.2, step=c * 10, reason="interval")
            say(event="trigger", time=t + 8, action="stop", reason="deadline", cycle=c)
            say(event="checkpoint", time=t + 9, seconds=0.2, step=c * 10 + 5, reason="deadline")
            say(event="confirmed", time=t + 9, checkpoint=f"ckpt-{c}", step=c * 10 + 5,
                seconds=0.3, cycle=c)
            say(event="cycle-end", time=t + 9.5, cycle=c, code=75, ended="stopped")
            say(event="restart", time=t + 9.6, restart=c, cause="deadline", step=c * 10 + 5)
            t += 10
        say(event="exit", time=t, code=0, reason="finished", message="training finished",
            cycles=cycles)


def seconds_to_render(root: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        render_report(root)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small, large = Path(tmp) / "small", Path(tmp) / "large"
        write_journal(small, args.cycles)
        write_journal(large, 2 * args.cycles)
        a = seconds_to_render(small, args.repeats)
        b = seconds_to_render(large, args.repeats)
    print(f"{args.cycles} cycles: {a:.2f}s; {2 * args.cycles} cycles: {b:.2f}s; "
          f"ratio {b / a:.2f} (2 = linear, 4 = quadratic)")


if __name__ == "__main__":
    main()
