"""examples/ddp_train.py, except that rank $HANG_RANK stops making progress at its
$HANG_AT_STEP-th step on the first start: what a stuck data worker or a lost collective looks
like from outside. The other ranks then wait for it in their next all-reduce."""

from __future__ import annotations

import importlib.util
import os
import time
import types
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ddp_train.py"


def stuck_forever() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    spec = importlib.util.spec_from_file_location("ddp_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    hang_rank, hang_at = int(os.environ["HANG_RANK"]), int(os.environ["HANG_AT_STEP"])
    steps = 0

    def sleep(seconds: float) -> None:  # the example pauses once per step
        nonlocal steps
        steps += 1
        if steps == hang_at and int(os.environ.get("RANK", "0")) == hang_rank \
                and os.environ.get("PROCCKPT_RESTART", "0") == "0":
            stuck_forever()
        time.sleep(seconds)

    example.time = types.SimpleNamespace(sleep=sleep)
    example.main()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
