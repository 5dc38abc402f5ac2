"""``procckpt status DIR``: what a checkpoint directory holds, in a table a person can read."""

from __future__ import annotations

import time
from pathlib import Path

from .durations import format_duration
from .errors import CheckpointReadError, StoreError
from .protocol.events import read_events
from .store import MARKER, CheckpointStore
from .store.store import format_size

__all__ = ["render_status"]


def render_status(root: Path, *, events: int = 8, verify: bool = True) -> str:
    """Return the status report for the checkpoint directory ``root``."""
    store = CheckpointStore(root)
    if not (store.root / MARKER).exists():
        raise StoreError(f"{store.root} is not a procckpt checkpoint dir (no {MARKER} marker)")
    now = time.time()
    lines = [f"checkpoint dir: {store.root}"]
    complete = store.completion()
    lock = store.root / "lock"
    holder = _holder(store)
    if complete:
        step = f" (step {complete['step']})" if complete.get("step") is not None else ""
        lines.append(f"state:          finished {format_duration(now - complete.get('time', now))}"
                     f" ago{step}")
    elif holder:
        lines.append(f"state:          running (pid {holder.get('pid')} on {holder.get('host')})")
    else:
        lines.append("state:          not running" + ("" if lock.exists() else " (never run)"))
    history = list(read_events(store.events_path))
    # How long each checkpoint took to become durable: a DMTCP image's manifest says it, the
    # hooks engine's checkpoints are in the journal.
    took = {e.get("checkpoint"): e.get("seconds") for e in history
            if e.get("event") == "checkpoint" and isinstance(e.get("seconds"), (int, float))}
    rows = [("CHECKPOINT", "STEP", "EPOCH", "SIZE", "WRITE", "AGE", "ENGINE", "REASON", "VALID")]
    for path in sorted(store.ckpt_root.glob("ckpt-*"), key=lambda p: p.name, reverse=True):
        try:
            manifest = store._read_manifest(path, retry=False) or {}
        except CheckpointReadError:
            manifest = {}
        if path.name.endswith(".corrupt"):
            valid = "corrupt"
        elif verify:
            try:
                problem = store.verify(path)
            except CheckpointReadError as e:
                problem = f"unreadable ({e.__cause__ or e})"
            valid = "yes" if problem is None else f"NO: {problem}"
        else:
            valid = "?"
        size = sum(int(f.get("bytes", 0)) for f in manifest.get("files", {}).values())
        age = format_duration(now - manifest["time"]) if "time" in manifest else "-"
        write = manifest.get("write_seconds", took.get(path.name))
        rows.append((path.name, str(manifest.get("step", "-")), str(manifest.get("epoch", "-")),
                     format_size(size), "-" if write is None else f"{write:.1f}s", age,
                     str(manifest.get("engine", "-")),
                     str(manifest.get("reason", "-")), valid))
    if len(rows) == 1:
        lines.append("checkpoints:    none yet")
    else:
        lines.append("")
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    restarts = sum(1 for e in history if e.get("event") == "restart")
    starts = sum(1 for e in history if e.get("event") == "start")
    hangs = sum(1 for e in history if e.get("event") == "hang")
    lines.append("")
    lines.append(f"launches: {starts}   restarts: {restarts}   "
                 f"checkpoints saved: {sum(1 for e in history if e.get('event') == 'checkpoint')}"
                 + (f"   hangs: {hangs}" if hangs else ""))
    resume = next((e for e in reversed(history) if e.get("event") == "resume"), None)
    if resume is not None and isinstance(resume.get("seconds"), (int, float)):
        line = (f"last resume: {resume.get('checkpoint', '?')} (step {resume.get('step', '?')}),"
                f" restored in {resume['seconds']:.2f}s")
        after = history[history.index(resume) + 1:]
        skip = next((e for e in after if e.get("event") == "resume-skip"), None)
        if skip is not None:
            line += (f"; {skip.get('batches')} batches passed over in "
                     f"{skip.get('seconds', 0):.2f}s ({str(skip.get('how', '?')).split(' (')[0]})")
        lines.append(line)
    period = next((e for e in reversed(history) if e.get("event") == "interval"), None)
    if period is not None:
        seconds = period.get("seconds")
        every = "none" if not isinstance(seconds, (int, float)) else \
            f"every {format_duration(seconds)}"
        lines.append(f"periodic checkpoints: {every} ({period.get('why', '?')})")
    if history:
        lines.append("last events:")
        for e in history[-events:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0)))
            details = ", ".join(f"{k}={v}" for k, v in e.items()
                                if k not in ("time", "event", "host", "pid", "argv"))
            lines.append(f"  {when}  {e.get('event', '?'):<11} {details}")
    return "\n".join(lines)


def _holder(store: CheckpointStore) -> dict | None:
    """Who holds the lock right now, or None (the lock file may be left from a dead process)."""
    import fcntl
    import json
    import os

    path = store.root / "lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        try:
            return json.loads(path.read_text() or "{}")
        except ValueError:
            return {}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
