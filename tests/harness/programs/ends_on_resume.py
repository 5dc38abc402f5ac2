"""A process whose first act when its image is restored is to end: the CRIU engine's test of
a tree resumed while CRIU still holds some of its threads.

``ends_on_resume.py IMAGE [THREADS]``: starts THREADS threads that sleep, then spins until
IMAGE exists and exits 0. IMAGE is the checkpoint its first image becomes, which exists only
once that image is taken, after the process was stopped for good: so the process that sees
it is the restored one, at its first instruction. A DataLoader worker imaged as its epoch
ended is the same, with fewer threads; the threads widen the moment in which CRIU lets go of
them one by one.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def main() -> None:
    image = sys.argv[1]
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 200):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    print("threads started", flush=True)
    while not os.path.exists(image):
        pass
    print("resumed", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
