"""A plain Python loop that knows nothing about procckpt (the DMTCP engine's test).

It advances a deterministic pseudo-random state for ``--steps`` steps, prints ``step N`` after
each, and writes the final state (and the hash of its random ballast) to ``--out``. Nothing in
it can resume: under ``procckpt run --engine dmtcp`` a restarted cycle continues from the saved
process image.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ballast-mb", type=int, default=0,
                        help="hold this many MB of random bytes (a bigger, slower image)")
    parser.add_argument("--end-unsaveable-after-stop", metavar="EVENTS", default=None,
                        help="after the last step, forbid DMTCP checkpoints and finish only "
                        "once the journal EVENTS has asked for a stop (a run that ends while "
                        "its stop is being asked for)")
    parser.add_argument("--hold-unsaveable", action="store_true",
                        help="after the last step, forbid DMTCP checkpoints and wait until a "
                        "SIGTERM, which ends it with exit code 0 (a graceful handler)")
    parser.add_argument("--fork-copy", action="store_true",
                        help="fork a copy of itself that lives as long as it does (what a "
                        "DataLoader worker or multiprocessing's fork makes)")
    args = parser.parse_args()
    if args.fork_copy and os.fork() == 0:
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)
    # Random bytes no second start could reproduce: the hash printed now and the one written
    # at the end agree only if every cycle continued this very process's memory.
    ballast = os.urandom(args.ballast_mb << 20)
    print(f"ballast {hashlib.sha256(ballast).hexdigest()}", flush=True)

    state = hashlib.sha256(b"procckpt").digest()
    history = []  # grows with the steps, so that the image carries real heap state
    for step in range(1, args.steps + 1):
        state = hashlib.sha256(state + step.to_bytes(8, "little")).digest()
        history.append(state[:4])
        print(f"step {step}", flush=True)
        time.sleep(args.step_sleep)
    if args.end_unsaveable_after_stop:
        end_after_stop(args.end_unsaveable_after_stop)
    if args.hold_unsaveable:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        dmtcp_disable_ckpt()
        while True:
            time.sleep(1)
    with open(args.out, "w") as f:
        f.write(f"{state.hex()} {hashlib.sha256(b''.join(history)).hexdigest()} "
                f"{hashlib.sha256(ballast).hexdigest()}\n")
    print("done", flush=True)


def end_after_stop(events: str) -> None:
    """Hold off DMTCP's checkpoints (the dmtcp_disable_ckpt of its preloaded library) until
    the launcher has asked for a stop, then go on to the end."""
    dmtcp_disable_ckpt()
    while True:
        try:
            with open(events) as f:
                if any(json.loads(line).get("action") == "stop" for line in f if line.strip()):
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.05)


def dmtcp_disable_ckpt() -> None:
    disable = getattr(ctypes.CDLL(None), "dmtcp_disable_ckpt", None)
    assert disable is not None, "not running under DMTCP"
    disable()


if __name__ == "__main__":
    main()
