"""Logging set-up for the ``procckpt`` logger: once per process, level from the environment."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup_logging"]


def setup_logging(level: str | None = None, label: str | None = None) -> None:
    """Send procckpt's records to stderr as ``procckpt: message`` unless already configured.

    The level comes from ``level``, else ``$PROCCKPT_LOG_LEVEL``, else INFO. ``label`` tells
    the two sides apart in one output (``procckpt[train]: ...``).
    """
    root = logging.getLogger("procckpt")
    # In a process group every rank would say the same: ranks other than 0 say only what
    # goes wrong, unless a level is asked for.
    quiet = os.environ.get("RANK", "0").strip() not in ("", "0")
    wanted = (level or os.environ.get("PROCCKPT_LOG_LEVEL")
              or ("WARNING" if quiet else "INFO")).upper()
    root.setLevel(getattr(logging, wanted, logging.INFO))
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    prefix = "procckpt" if label is None else f"procckpt[{label}]"
    if quiet:
        prefix = f"procckpt[rank {os.environ['RANK'].strip()}]"
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    root.addHandler(handler)
    root.propagate = False
