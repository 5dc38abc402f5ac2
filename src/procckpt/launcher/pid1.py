"""Duties of ``procckpt run`` when it is PID 1 of a PID namespace (a container's entrypoint).

Two things differ for PID 1:

- The kernel delivers a signal to PID 1 only if PID 1 installed a handler for it (SIGKILL and
  SIGSTOP from an ancestor namespace excepted): a default action, even "terminate", is never
  taken. The supervisor installs handlers for every signal it acts on (SIGTERM, SIGUSR1, ...),
  so a pod's SIGTERM reaches it; anything else sent to it is ignored, as with any init.
- Orphans are re-parented to PID 1, which must reap them or they stay zombies: torchrun's
  workers when torchrun dies first, a data loader's grandchildren, double-forked helpers.
  :func:`reap_orphans` collects every exited child except the supervised command, whose exit
  status ``subprocess.Popen`` must still read itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Container

import psutil

__all__ = ["is_init", "reap_orphans"]

logger = logging.getLogger(__name__)


def is_init() -> bool:
    """Whether this process is PID 1 of its PID namespace."""
    return os.getpid() == 1


def reap_orphans(keep: Container[int]) -> list[tuple[int, int]]:
    """Reap exited children other than ``keep``; return their (pid, raw wait status).

    Never blocks, and never calls ``waitpid(-1)``: that could take the supervised command's
    exit status away from its Popen object.
    """
    reaped: list[tuple[int, int]] = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return reaped
    for child in children:
        if child.pid in keep:
            continue
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if pid:
            reaped.append((pid, status))
    if reaped:
        logger.debug("reaped %d orphaned process(es): %s", len(reaped),
                     ", ".join(str(p) for p, _ in reaped))
    return reaped
