"""``procckpt status DIR``: what a checkpoint directory holds and where the run's time went,
in a table a person can read or (``--json``) one JSON object."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..durations import format_duration
from ..errors import CheckpointReadError, ProcckptError, StoreError
from ..protocol.events import read_events, unreadable_lines
from ..store import MARKER, CheckpointStore
from ..store.directory import format_size
from .goodput import RECOVERY_PHASES, Goodput, compute_goodput

__all__ = ["render_status", "status_data", "LABELS"]


def status_data(root: Path, *, events: int = 8, verify: bool = True) -> dict[str, Any]:
    """What ``procckpt status --json`` prints: the run's state and goodput, its checkpoints
    (newest first) and its last ``events`` events."""
    store = opened_for_reading(root)
    now = time.time()
    history = list(read_events(store.events_path))
    complete = store.completion()
    holder = None if complete else _holder(store)
    if complete:
        state = "finished"
    elif holder:
        state = "running"
    else:
        state = "not running" if (store.root / "lock").exists() else "never run"
    goodput = compute_goodput(history, now=now if holder else None)
    return {
        "dir": str(store.root), "state": state,
        **({"finished": complete} if complete else {}),
        **({"holder": holder} if holder else {}),
        "goodput": goodput.as_json() if goodput is not None else None,
        "launches": _count(history, "start"), "restarts": _restarts(history),
        "hangs": _count(history, "hang"),
        "last_recovery": next((e for e in reversed(history) if e.get("event") == "recovery"),
                              None),
        "memory_tier": next((e for e in reversed(history) if e.get("event") == "memory-tier"),
                            None),
        "tier_kept": [e for e in history if e.get("event") == "tier-kept"],
        "audits": [{k: e.get(k) for k in ("checkpoint", "epoch", "batch", "step", "verdict")}
                   for e in history if e.get("event") == "audit"],
        "checkpoints": _checkpoints(store, history, verify),
        "events": history[-events:] if events > 0 else [],
    }


def _state(store: CheckpointStore, complete: dict[str, Any] | None,
           holder: dict[str, Any] | None, history: list[dict[str, Any]], now: float) -> str:
    """'finished 5m ago (step 400)', 'running (pid 7 on n1)', or 'not running' and how the
    last launch ended."""
    if complete:
        step = f" (step {complete['step']})" if complete.get("step") is not None else ""
        return f"finished {format_duration(now - complete.get('time', now))} ago{step}"
    if holder:
        return f"running (pid {holder.get('pid')} on {holder.get('host')})"
    return "not running" + ("" if (store.root / "lock").exists() else " (never run)") + \
        _last_exit(history)


def _last_exit(history: list[dict[str, Any]]) -> str:
    """How the last launch ended, and whose exit code that was: ' (last exit: 74, procckpt's:
    storage-failed)' or ' (last exit: 74, the command's own)'; '' before any."""
    ended = next((e for e in reversed(history) if e.get("event") == "exit"), None)
    if ended is None or "by" not in ended:
        return ""
    whose = f"procckpt's: {ended.get('reason')}" if ended["by"] == "procckpt" else \
        "the command's own"
    return f" (last exit: {ended.get('code')}, {whose})"


def _restarts(history: list[dict[str, Any]]) -> int:
    """How often the training was started again, as its log counts them ("restart 3"): by
    this launcher, by a requeue or by a rerun of the command."""
    resumed = [e.get("restart") for e in history if e.get("event") == "resume"]
    counted = resumed[-1] if resumed and isinstance(resumed[-1], int) else 0
    return max(counted, _count(history, "restart"))


def render_status(root: Path, *, events: int = 8, verify: bool = True) -> str:
    """Return the status report for the checkpoint directory ``root``."""
    store = opened_for_reading(root)
    now = time.time()
    lines = [f"checkpoint dir: {store.root}"]
    if store.remote_url is not None:
        lines.append(f"remote:         {_remote_line(store)}")
    complete = store.completion()
    holder = _holder(store)
    history = list(read_events(store.events_path))
    lines.append(f"state:          {_state(store, complete, holder, history, now)}")
    goodput = compute_goodput(history, now=now if holder and not complete else None)
    if goodput is not None and goodput.wall > 0:
        lines += _goodput_lines(goodput)
    if (damage := damaged_journal(store)) is not None:
        lines.append(f"journal:        {damage}")
    rows = [("CHECKPOINT", "STEP", "EPOCH", "SIZE", "WRITTEN", "WRITE", "AGE", "ENGINE", "REASON",
             "VALID")]
    for c in _checkpoints(store, history, verify):
        write = c["write_seconds"]
        valid = "corrupt" if c["corrupt"] else "?" if c["valid"] is None else \
            "yes" if c["valid"] else f"NO: {c['problem']}"
        rows.append((c["name"], _dash(c["step"]), _dash(c["epoch"]), format_size(c["bytes"]),
                     format_size(c["written"]), "-" if write is None else f"{write:.1f}s",
                     "-" if c["time"] is None else format_duration(now - c["time"]),
                     _dash(c["engine"]), _dash(c["reason"]), valid))
    lines += _table(rows)
    hangs, lost = _count(history, "hang"), _count(history, "node-lost")
    lines.append("")
    lines.append(f"launches: {_count(history, 'start')}   restarts: {_restarts(history)}   "
                 f"checkpoints saved: {_count(history, 'checkpoint')}"
                 + (f"   hangs: {hangs}" if hangs else "")
                 + (f"   nodes lost: {lost}" if lost else ""))
    node_lost = next((e for e in reversed(history) if e.get("event") == "node-lost"), None)
    if node_lost is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(node_lost.get("time", 0)))
        lines.append(f"last node lost: {', '.join(map(str, node_lost.get('nodes', [])))} "
                     f"(cycle {node_lost.get('cycle', '?')}, {when})")
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
    if (recovery := recovery_line(history)) is not None:
        lines.append(recovery)
    if (audits := audit_line(history)) is not None:
        lines.append(audits)
    period = next((e for e in reversed(history) if e.get("event") == "interval"), None)
    if period is not None:
        seconds = period.get("seconds")
        every = "none" if not isinstance(seconds, (int, float)) else \
            f"every {format_duration(seconds)}"
        lines.append(f"periodic checkpoints: {every} ({period.get('why', '?')})")
    if (tier := tier_line(history)) is not None:
        lines.append(tier)
    if history and events > 0:
        lines.append("last events:")
        for e in history[-events:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0)))
            details = ", ".join(f"{k}={v}" for k, v in e.items()
                                if k not in ("time", "event", "host", "pid", "argv"))
            lines.append(f"  {when}  {e.get('event', '?'):<11} {details}")
    return "\n".join(lines)


#: How the parts of the time are named in the status and the report.
LABELS = {"training": "training", "startup": "startup", "restore": "restore",
          "replay": "replay", "checkpoint_stall": "checkpoint stalls", "lost": "lost work",
          "idle": "idle", "queue": "queued"}


def recovery_line(history: list[dict[str, Any]]) -> str | None:
    """Where the time of the last restart went, from the end of the cycle before to the end
    of the first resumed step: 'last restart: 5.70s to the first resumed step: back-off
    2.00s, start 0.30s, ...'; None before any restart was timed."""
    last, cycle, warm = None, None, False
    for event in history:
        if event.get("event") == "cycle":
            cycle = event
        elif event.get("event") == "recovery":
            last, warm = event, bool(cycle is not None and cycle.get("warm"))
    if last is None or not isinstance(last.get("total"), (int, float)):
        return None
    parts = []
    for key, name in RECOVERY_PHASES:
        seconds = last.get(key)
        if isinstance(seconds, (int, float)):
            restored, source = last.get("bytes"), last.get("source")
            touched = last.get("touched")
            more = ", ".join(([format_size(restored)] if isinstance(restored, int) else [])
                             + ([f"from {source}"] if isinstance(source, str) else [])
                             + ([f"{format_size(touched)} of it into memory touched already"]
                                if isinstance(touched, int) else []))
            more = f" ({more})" if key == "restore" and more else ""
            parts.append(f"{name} {seconds:.2f}s{more}")
    return (f"last restart: {last['total']:.2f}s from the end of the cycle before to the end "
            f"of the first resumed step{' (warm: torch was imported)' if warm else ''}: "
            f"{', '.join(parts)}")


def tier_line(history: list[dict[str, Any]]) -> str | None:
    """The memory tier as the last cycle planned it, and what it gave (docs/crashes.md):
    'memory tier: 64.0 MB a slot, every 12 steps (the copy takes ...); 2 crashes resumed from
    it, the last at step 1841'; None where it never wrote a slot nor was turned off."""
    last = next((e for e in reversed(history) if e.get("event") == "memory-tier"), None)
    if last is None:
        return None
    kept = [e for e in history if e.get("event") == "tier-kept"]
    if "off" in last:
        line = f"memory tier: off, {last['off']}"
    else:
        every = last.get("every")
        line = (f"memory tier: {format_size(last.get('bytes') or 0)} a slot, every "
                f"{'step' if every == 1 else f'{every} steps'} ({last.get('why', '?')})")
    if kept:
        line += (f"; {len(kept)} crash{'es' if len(kept) > 1 else ''} resumed from it, the "
                 f"last at step {kept[-1].get('step', '?')}")
    return line


def audit_line(history: list[dict[str, Any]]) -> str | None:
    """How the resumes' first batches (and the state their first steps started from) compared
    with what the stopped runs were about to train on (training/audit.py): 'resume audits: 3
    same, 1 differs (last that differed: ckpt-00000004, batch 7 of epoch 1)', and why the last
    unaudited one could not be; None before any resume was audited."""
    audits = [e for e in history if e.get("event") == "audit"]
    if not audits:
        return None
    counts: dict[str, int] = {}
    for e in audits:
        verdict = str(e.get("verdict", "?")).split(" on rank")[0]  # a group's: differs
        counts[verdict] = counts.get(verdict, 0) + 1
    order = ["same", "differs", "refused", "unaudited", "unrecorded"]
    words = ", ".join(f"{counts[v]} {v}" for v in sorted(counts, key=lambda v: (
        order.index(v) if v in order else len(order), v)))
    bad = [e for e in audits if str(e.get("verdict")).startswith(("differs", "refused"))]
    unseen = [e for e in audits if e.get("verdict") == "unaudited"]
    if not bad:
        return f"resume audits: {words}" + (f" (last unaudited: {unseen[-1].get('why')})"
                                            if unseen and unseen[-1].get("why") else "")
    last = bad[-1]
    what = "the state its first step started from" if last.get("state") == "differs" else \
        f"batch {last.get('batch', '?')} of epoch {last.get('epoch', '?')}"
    return (f"resume audits: {words} (last that differed: {last.get('checkpoint', '?')}, "
            f"{what}; see docs/resume.md)")


def _goodput_lines(goodput: Goodput) -> list[str]:
    seconds, wall = goodput.seconds(), goodput.wall
    ettr = goodput.ettr or 0.0
    parts = [f"{LABELS[k]} {format_duration(v)} ({100 * v / wall:.1f} %)"
             for k, v in seconds.items() if k != "training" and v >= 0.05]
    lines = [f"goodput:        {100 * ettr:.1f} % of {format_duration(wall)} trained the model "
             f"({format_duration(seconds['training'])}; {len(goodput.cycles)} cycles)",
             "                " + (" · ".join(parts) if parts else "nothing else")]
    restarts = recoveries_line(goodput)
    if restarts is not None:
        lines.append("                " + restarts)
    return lines


def recoveries_line(goodput: Goodput) -> str | None:
    """'3 restarts timed, 12.40s from the cycles' ends to their first resumed steps:
    back-off 6.00s, ...'; None before any restart was timed."""
    sums, n = goodput.recovery_seconds(), len(goodput.recoveries)
    if "total" not in sums:
        return None
    parts = [f"{name} {sums[key]:.2f}s" for key, name in RECOVERY_PHASES if key in sums]
    return (f"{n} restart{'' if n == 1 else 's'} timed, {sums['total']:.2f}s from the "
            f"cycles' ends to their first resumed steps: {', '.join(parts)}")


def opened_for_reading(root: Path) -> CheckpointStore:
    """The checkpoint dir ``root``, read as it is (nothing created or changed).

    Raises:
        StoreError: it does not exist, or is no procckpt checkpoint dir.
    """
    store = CheckpointStore(root)
    if not store.root.exists():
        raise StoreError(f"{store.root} does not exist: give the checkpoint dir of a run (its "
                         "procckpt run --dir; by default ./procckpt-checkpoints)")
    if not store.root.is_dir():
        raise StoreError(f"{store.root} is a file, not a checkpoint dir")
    if not (store.root / MARKER).exists():
        raise StoreError(f"{store.root} is not a procckpt checkpoint dir (no {MARKER} marker)")
    return store


def damaged_journal(store: CheckpointStore) -> str | None:
    """'N lines of the journal are unreadable (...)', or None when every line reads."""
    bad = unreadable_lines(store.events_path)
    if not bad:
        return None
    return (f"{bad} line{'s' if bad > 1 else ''} of its journal ({store.events_path.name}) "
            f"{'are' if bad > 1 else 'is'} unreadable (cut short by a crash, or damaged): what "
            f"{'they' if bad > 1 else 'it'} said is left out")


def _count(history: list[dict[str, Any]], kind: str) -> int:
    return sum(1 for e in history if e.get("event") == kind)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _checkpoints(store: CheckpointStore, history: list[dict[str, Any]], verify: bool,
                 ) -> list[dict[str, Any]]:
    """The checkpoints on disk, newest first, with what their manifests say and (``verify``)
    whether their files still match their checksums."""
    # How long each checkpoint took to become durable: a DMTCP image's manifest says it, the
    # hooks engine's checkpoints are in the journal.
    took = {e.get("checkpoint"): e.get("seconds") for e in history
            if e.get("event") == "checkpoint" and isinstance(e.get("seconds"), (int, float))}
    out = []
    for path in sorted(store.ckpt_root.glob("ckpt-*"), key=lambda p: p.name, reverse=True):
        try:
            manifest = store._read_manifest(path, retry=False) or {}
        except CheckpointReadError:
            manifest = {}
        corrupt = path.name.endswith(".corrupt")
        problem: str | None = None
        valid: bool | None = None
        if not corrupt and verify:
            try:
                problem = store.verify(path)
            except CheckpointReadError as e:
                problem = f"unreadable ({e.__cause__ or e})"
            valid = problem is None
        # SIZE is the state's (its files and the chunks it lists), WRITTEN what writing it
        # cost (chunks an earlier checkpoint stored are not written again).
        size = sum(int(f.get("bytes", 0)) for f in manifest.get("files", {}).values()) + \
            sum(int(n) for n in (manifest.get("chunks") or {}).values())
        out.append({
            "name": path.name, "step": manifest.get("step"), "epoch": manifest.get("epoch"),
            "bytes": size, "written": int(manifest.get("written", size)),
            "write_seconds": manifest.get("write_seconds", took.get(path.name)),
            "time": manifest.get("time"), "engine": manifest.get("engine"),
            "reason": manifest.get("reason"), "corrupt": corrupt, "valid": valid,
            "problem": problem})
    return out


def _remote_line(store: CheckpointStore) -> str:
    """The remote dir and the checkpoints committed there (store/remote.py), and the local
    ones it lacks (a kill during their upload: the next launch publishes them)."""
    try:
        names = store.remote.committed()  # type: ignore[union-attr]
    except ProcckptError as e:
        return f"{store.remote_url} (cannot list it: {e})"
    line = f"{store.remote_url}: " + (", ".join(names) if names else "no checkpoint yet")
    local_only = [i.name for i in store.checkpoints() if i.name not in names]
    return line + (f"; here only: {', '.join(local_only)}" if local_only else "")


def remote_status_data(url: str) -> dict[str, Any]:
    """What an ``s3://`` prefix holds, read from the prefix alone (from a machine without its
    local dir): whether the run finished and its committed checkpoints, newest first."""
    from ..store.remote import S3Tier

    tier = S3Tier(url)
    rows = []
    for name in tier.committed():
        manifest = tier.manifest(name) or {}
        files = manifest.get("files") or {}
        rows.append({"name": name, "step": manifest.get("step"), "epoch": manifest.get("epoch"),
                     "reason": manifest.get("reason"), "time": manifest.get("time"),
                     "bytes": sum(int(f.get("bytes", 0)) for f in files.values())})
    return {"dir": url, "state": "finished" if tier.completion() else "not finished",
            "local_dir": None, "checkpoints": rows}


def render_remote_status(url: str) -> str:
    """:func:`remote_status_data` as the lines ``procckpt status`` prints."""
    data = remote_status_data(url)
    now = time.time()
    lines = [f"checkpoint dir: {url} (no local dir here: what the prefix holds)",
             f"state:          {data['state']}"]
    rows = [("CHECKPOINT", "STEP", "EPOCH", "SIZE", "AGE", "REASON")]
    for c in data["checkpoints"]:
        rows.append((c["name"], _dash(c["step"]), _dash(c["epoch"]), format_size(c["bytes"]),
                     "-" if not c["time"] else format_duration(now - float(c["time"])),
                     _dash(c["reason"])))
    lines += _table(rows)
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """The checkpoints' table: a blank line, then the header and rows in columns (the last
    one as it is); 'none yet' when only the header is there."""
    if len(rows) == 1:
        return ["checkpoints:    none yet"]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [""] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]
                   for r in rows]


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
