"""A plain Python loop that knows nothing about procckpt (the DMTCP engine's test).

It advances a deterministic pseudo-random state for ``--steps`` steps, prints ``step N`` after
each, and writes the final state (and the hash of its random ballast) to ``--out``. Nothing in
it can resume: under ``procckpt run --engine dmtcp`` a restarted cycle continues from the saved
process image.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ballast-mb", type=int, default=0,
                        help="hold this many MB of random bytes (a bigger, slower image)")
    args = parser.parse_args()
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
    with open(args.out, "w") as f:
        f.write(f"{state.hex()} {hashlib.sha256(b''.join(history)).hexdigest()} "
                f"{hashlib.sha256(ballast).hexdigest()}\n")
    print("done", flush=True)


if __name__ == "__main__":
    main()
