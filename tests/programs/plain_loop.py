"""A plain Python loop that knows nothing about procckpt (the DMTCP engine's test).

It advances a deterministic pseudo-random state for ``--steps`` steps, prints ``step N`` after
each, and writes the final state to ``--out``. Nothing in it can resume: under ``procckpt run
--engine dmtcp`` a restarted cycle continues from the saved process image.
"""

from __future__ import annotations

import argparse
import hashlib
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    state = hashlib.sha256(b"procckpt").digest()
    history = []  # grows with the steps, so that the image carries real heap state
    for step in range(1, args.steps + 1):
        state = hashlib.sha256(state + step.to_bytes(8, "little")).digest()
        history.append(state[:4])
        print(f"step {step}", flush=True)
        time.sleep(args.step_sleep)
    with open(args.out, "w") as f:
        f.write(f"{state.hex()} {hashlib.sha256(b''.join(history)).hexdigest()}\n")
    print("done", flush=True)


if __name__ == "__main__":
    main()
