"""Threads that stay: work handed to a thread already running, at a safe point's pause.

Starting a thread makes the caller wait until the new thread has run: ``Thread.start()``
returns only once the thread said it started. On a quiet 2-core VM that is about 0.2 ms; where
another process holds a core (a warm restart's spare importing torch beside the training) it
was 1-5 ms, as the scheduler may queue the new thread behind that process. The memory tier's
pause started three (its copy's helper, the audit's writer and the slot's completion), so
that a slot cost the training 12-15 ms instead of 8 while a spare imported, and its cadence,
planned on that cost, lost more steps to a crash for seconds after every restart.

:class:`Standing` hands work to threads of a :class:`~concurrent.futures.ThreadPoolExecutor`
made on first use, which stay, idle, between calls: the caller only puts the work on a queue.
The interpreter finishes what was handed over before it exits (the executor's own exit hook),
as it would join a thread that is no daemon. A process forked from this one gets threads of its
own on first use: the parent's do not exist there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Standing"]


class Standing:
    """Up to ``threads`` threads named ``name``, made when first needed and kept."""

    def __init__(self, name: str, threads: int = 1) -> None:
        self.name = name
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on one of the threads; its future."""
        pool = self._pool
        if pool is None or self._pid != os.getpid():
            pool = self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            self._pid = os.getpid()
        return pool.submit(fn, *args)
