"""Gloo's worker threads and the end of the process.

Gloo runs each collective on a worker thread of its own (``pt_gloo_runloop``), which lets go
of the collective's tensors only after the caller's wait returned. Letting go of a tensor that
Python has already dropped takes the GIL. Should the interpreter be finalizing by then, Python
ends that thread inside a C++ destructor, and the whole rank dies of SIGABRT ("terminate
called without an active exception") instead of exiting with its own code. gdb on the cores
of two such ranks: ``~AsyncBroadcastWork`` (procckpt's own broadcast, right before a planned
stop's exit) and ``~AsyncBarrierWork`` -> ``~AsyncAllgatherCoalescedWork`` (an FSDP script's
closing ``dist.barrier()``, 3 runs of 40), each -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit``.

Two guards: :func:`let_go` after each of procckpt's collectives, and :func:`settle_at_exit`,
an ``atexit`` hook for everything else (the script's own collectives): exit hooks run before
the interpreter starts finalizing, so a thread can still take the GIL while the hook sleeps.
"""

from __future__ import annotations

import atexit
import os
import time

import torch

__all__ = ["let_go", "settle_at_exit", "gloo_threads_running", "LET_GO_S", "SETTLE_S"]

#: How long :func:`let_go` waits at most (the backend's thread needs only the GIL).
LET_GO_S = 2.0
#: How long the exit waits at most for gloo's threads to go idle.
SETTLE_S = 2.0
#: The name torch gives gloo's worker threads.
GLOO_THREAD = "pt_gloo_runloop"

_registered = False


def let_go(*tensors: torch.Tensor) -> None:
    """Wait until the backend's thread let go of ``tensors``, just used in a collective.

    Waiting here, GIL released, closes the window for procckpt's own collectives (a planned
    stop exits right after the commit's broadcast). CPU tensors only: NCCL's watchdog keeps
    its works far longer, and not every step should wait for it.
    """
    held = [t for t in tensors if t.device.type == "cpu" and hasattr(t, "_use_count")]
    deadline = time.monotonic() + LET_GO_S
    while any(t._use_count() > 1 for t in held) and time.monotonic() < deadline:
        time.sleep(0.0002)  # gives up the GIL, which the thread needs to drop the reference


def settle_at_exit() -> None:
    """Make the interpreter's exit wait (:data:`SETTLE_S` at most) until gloo's worker
    threads are idle. Registered once per process; costs about a millisecond at exit."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_settle)


def _settle() -> None:
    # Each sleep gives up the GIL: a thread waiting for it gets it and finishes. Idle twice in
    # a row means no thread was still on its way to the GIL (one preempted is runnable).
    deadline = time.monotonic() + SETTLE_S
    idle = 0
    while idle < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
        idle = 0 if gloo_threads_running() else idle + 1


def gloo_threads_running() -> bool:
    """Whether a gloo worker thread of this process is running or runnable (Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name_end = stat.rfind(")")
        name = stat[stat.find("(") + 1:name_end]
        if name == GLOO_THREAD and stat[name_end + 2:name_end + 3] in ("R", "D"):
            return True
    return False
