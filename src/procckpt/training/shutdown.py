"""A training process's exit without the interpreter's last walk over torch's objects.

At exit CPython collects cyclic garbage among every object still alive: after ``import torch``
and an optimizer (whose first ``add_param_group`` imports ``torch._dynamo``) those number in the
millions, and the walk takes about a second of a processor on the 2-core VM of the benchmarks
(benchmarks/exit_cost.py), at the end of every cycle, between a stop's checkpoint and the next
cycle's start. :func:`skip_final_collection` registers ``gc.freeze`` as an exit handler: once
the handlers registered after it have run, the objects alive are moved to the collector's
permanent generation, which finalization's collections leave alone; the system takes the
memory back with the process. Skipped: the finalizers of objects that only a reference cycle
kept alive at exit, which Python does not promise to run then anyway. An object reachable from a
module or a frame is still finalized when its last reference goes; a file that only a cycle holds
is not flushed: close it, or keep the collection with ``PROCCKPT_FINAL_GC=1``.
"""

from __future__ import annotations

import atexit
import gc
import os
import threading

__all__ = ["skip_final_collection"]

_lock = threading.Lock()
_registered = False


def skip_final_collection() -> bool:
    """Have the interpreter's exit skip its collection of the objects then alive (once per
    process; not with ``PROCCKPT_FINAL_GC=1``). True if it was registered now."""
    global _registered
    with _lock:
        if _registered or os.environ.get("PROCCKPT_FINAL_GC", "").strip() == "1":
            return False
        _registered = True
    atexit.register(gc.freeze)
    return True
