"""Where a run's time went, computed from its events journal alone.

The run's wall time, from its first launch to its end (or now, while it runs), is cut into
parts that add up to it:

- ``training``: time in steps whose results survived;
- ``startup``: a cycle's start up to the Checkpointer being ready (imports, the script's own
  set-up), the launcher's own start, a job's start before the launcher's, and what the first
  step of a cycle took beyond the second (compiling, warming caches);
- ``restore``: finding, verifying and loading a checkpoint;
- ``replay``: passing over the batches already trained on when resuming mid-epoch;
- ``checkpoint_stall``: the training's pauses for checkpoints;
- ``lost``: work after the last checkpoint of a cycle that ended without keeping it (a crash,
  a kill, a hang, a stop whose checkpoint never came);
- ``idle``: a cycle's end after its last checkpoint (the exit, the term wait), the waits
  between cycles (a restart's back-off), the gap before a launch by hand;
- ``queue``: a Slurm job waiting between a requeue and its next start (Slurm's start time).

Each cycle is painted: its whole span first as training, then (in rising priority) the end it
did not keep, its start-up, restores and replays, and checkpoint pauses; what each stretch is
painted last counts. ``ettr`` (effective training time ratio) is training ÷ wall.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "Segment", "Cycle", "Goodput", "compute_goodput"]

#: A restart's phases, in order, as the training journals them (training/link/timing.py;
#: ``spawn_and_imports`` where no process start time splits them), and their names in the
#: status and the report.
RECOVERY_PHASES = (("backoff", "back-off"), ("spawn", "start"), ("imports", "imports and model"),
                   ("spawn_and_imports", "start, imports and model"),
                   ("checkpointer", "Checkpointer"), ("restore", "restore"),
                   ("first_step", "first step"))

#: The parts of the wall time, in the order they are shown.
KINDS = ("training", "startup", "restore", "replay", "checkpoint_stall", "lost", "idle", "queue")

#: How a cycle ended (the launcher's ``cycle-end`` event): the work up to its last moment was
#: kept in these cases; otherwise only up to its last checkpoint.
KEPT_ENDINGS = ("finished", "stopped", "exited")

# Painting priorities: a higher one wins where marks overlap.
_PRIORITY = {"training": 1, "lost": 2, "idle": 2, "startup": 3, "restore": 4, "replay": 4,
             "checkpoint_stall": 5}


@dataclass
class Segment:
    start: float
    end: float
    kind: str

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class Cycle:
    """One start of the command, as the journal tells it."""

    number: int  #: 1, 2, ... across the whole run
    launch: int  #: which ``procckpt run`` (1, 2, ...: one per requeue)
    start: float
    end: float = 0.0
    #: finished, stopped, exited, failed, node-lost, hung, unconfirmed; killed (the launcher
    #: vanished with it); running.
    ended: str = "killed"
    exit_code: int | None = None
    #: What came after: a restart's cause, or how the launch ended (requeued, finished...).
    then: str | None = None
    lead: float | None = None
    interval: float | None = None
    checkpoints: list[float] = field(default_factory=list)
    hangs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def seconds(self) -> dict[str, float]:
        return _sums(self.segments)


@dataclass
class Goodput:
    start: float
    end: float
    cycles: list[Cycle]
    #: The time outside the cycles: a launch's start, waits between cycles and launches.
    between: list[Segment]
    #: The period of checkpoints and its basis, as last journalled.
    interval: tuple[float | None, str] | None = None
    #: Each restart's phases, as the resumed training timed them (``recovery`` events).
    recoveries: list[dict[str, Any]] = field(default_factory=list)

    def recovery_seconds(self) -> dict[str, float]:
        """The restarts' phases added up (``total``: from each cycle's end before to the end
        of its first resumed step); empty before any restart was timed."""
        sums: dict[str, float] = {}
        for r in self.recoveries:
            for key in (*(k for k, _ in RECOVERY_PHASES), "total"):
                if isinstance(r.get(key), (int, float)):
                    sums[key] = sums.get(key, 0.0) + float(r[key])
        return sums

    @property
    def wall(self) -> float:
        return max(0.0, self.end - self.start)

    def seconds(self) -> dict[str, float]:
        return _sums([s for c in self.cycles for s in c.segments] + self.between)

    @property
    def ettr(self) -> float | None:
        return self.seconds()["training"] / self.wall if self.wall > 0 else None

    def as_json(self) -> dict[str, Any]:
        seconds = self.seconds()
        return {
            "ettr": None if self.ettr is None else round(self.ettr, 4),
            "wall_seconds": round(self.wall, 3),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "recoveries": {"restarts": len(self.recoveries),
                           "seconds": {k: round(v, 3)
                                       for k, v in self.recovery_seconds().items()}},
            "cycles": [{"cycle": c.number, "launch": c.launch, "start": c.start, "end": c.end,
                        "ended": c.ended, "exit_code": c.exit_code, "then": c.then,
                        "checkpoints": len(c.checkpoints),
                        "seconds": {k: round(v, 3) for k, v in c.seconds().items()}}
                       for c in self.cycles],
        }


def _sums(segments: Iterable[Segment]) -> dict[str, float]:
    sums = dict.fromkeys(KINDS, 0.0)
    for s in segments:
        sums[s.kind] += s.seconds
    return sums


@dataclass
class _Launch:
    start: float
    job_id: str | None
    end: float | None = None
    reason: str | None = None
    job_started: float | None = None
    cycles: list[Cycle] = field(default_factory=list)


def compute_goodput(events: Iterable[dict[str, Any]], now: float | None = None,  # noqa: C901 (one pass over the journal, a branch per event)
                    ) -> Goodput | None:
    """The breakdown of the run the journal ``events`` tells; None before its first launch.

    Args:
        events: the journal's events, in order.
        now: the time to end an unfinished cycle at (the run is still going), or None to end
            it at its last event (the launcher died with it).
    """
    launches: list[_Launch] = []
    recoveries: list[dict[str, Any]] = []
    interval: tuple[float | None, str] | None = None
    cycle: Cycle | None = None
    numbered = 0
    last_time = None
    for e in events:
        t = e.get("time")
        if not isinstance(t, (int, float)):
            continue
        last_time = t
        kind = e.get("event")
        if kind == "archive":  # --force: the journal's run so far ended; a new one begins
            launches, interval, cycle, numbered, recoveries = [], None, None, 0, []
            continue
        if kind == "recovery":
            recoveries.append(e)
        if kind == "start":
            cycle = None
            launches.append(_Launch(t, e.get("job_id")))
            continue
        if not launches:
            continue  # a script run on its own before any launch
        launch = launches[-1]
        if kind == "cycle":
            numbered += 1
            cycle = Cycle(numbered, len(launches), t, lead=e.get("lead"),
                          interval=e.get("interval"))
            launch.cycles.append(cycle)
            if isinstance(e.get("job_started"), (int, float)):
                launch.job_started = e["job_started"]
        elif kind == "exit":
            launch.end, launch.reason = t, e.get("reason")
            last = launch.cycles[-1] if launch.cycles else None
            if last is not None and last.then is None:
                last.then = e.get("reason")
            if last is not None and not last.end:  # a journal from before cycle-end events
                last.ended = _OLD_EXITS.get(str(e.get("reason")), "killed")
            cycle = None
        elif kind == "interval":
            interval = (e.get("seconds"), str(e.get("why", "")))
        elif cycle is not None:
            if kind == "cycle-end":
                cycle.end, cycle.ended = t, str(e.get("ended", "killed"))
                cycle.exit_code = e.get("code")
            elif kind == "restart":
                cycle.then = str(e.get("cause", "restart"))
                if not cycle.end:  # a journal from before cycle-end events
                    cycle.end, cycle.ended = t, _old_ending(e)
            cycle.events.append(e)
    if not launches or last_time is None:
        return None
    cycles = [c for launch in launches for c in launch.cycles]
    for i, c in enumerate(cycles):
        if not c.end:
            following = cycles[i + 1].start if i + 1 < len(cycles) else None
            if following is None and now is not None:
                c.end, c.ended = max(now, c.start), "running"
            else:
                own = [e["time"] for e in c.events]
                c.end = max([c.start, *own])
        _paint(c)
    end = max(last_time, now or last_time, *(c.end for c in cycles)) if cycles else last_time
    return Goodput(launches[0].start, end, cycles, _between(launches, end), interval,
                   recoveries)


_OLD_EXITS = {"finished": "finished", "requeued": "stopped", "checkpointed": "stopped",
              "budget-exhausted": "stopped", "hung": "hung", "failed": "failed"}


def _old_ending(restart: dict[str, Any]) -> str:
    cause = restart.get("cause")
    return {"failure": "failed", "hang": "hung"}.get(str(cause), "stopped")


def _paint(c: Cycle) -> None:  # noqa: C901 (a branch per part of a cycle)
    """Cut the cycle ``c`` into segments from its training-side events."""
    marks: list[tuple[float, float, str]] = [(c.start, c.end, "training")]
    ready = restore = None
    replays: list[tuple[float, float]] = []
    kept_to: float | None = None
    complete: float | None = None
    warm: dict[str, Any] | None = None
    for e in c.events:
        kind, t = e.get("event"), e["time"]
        seconds = e.get("seconds") if isinstance(e.get("seconds"), (int, float)) else None
        if kind == "ready":
            ready, restore = t, float(e.get("restore") or 0.0)
        elif kind == "resume" and seconds is not None and ready is None:
            ready, restore = t, seconds  # (a journal from before ready events)
        elif kind == "resume-skip" and seconds:
            replays.append((t - seconds, t))
        elif kind == "checkpoint":
            took = seconds or 0.0
            if e.get("background"):
                began = t - took
                paused = float(e.get("stall") or 0.0)
                marks.append((began, began + paused, "checkpoint_stall"))
                kept_to = max(kept_to or began, began + paused)
            else:
                marks.append((t - took, t, "checkpoint_stall"))
                kept_to = t
            c.checkpoints.append(t)
        elif kind == "tier-kept" and isinstance(e.get("saved_at"), (int, float)):
            kept_to = max(kept_to or c.start, float(e["saved_at"]))  # (after the cycle's end)
        elif kind == "complete":
            complete = t
        elif kind == "warm":
            warm = e
        elif kind == "hang":
            c.hangs.append(t)
    if c.ended == "running":
        pass  # what it trained since its last checkpoint is not lost (yet)
    elif c.ended in KEPT_ENDINGS:
        done = complete if c.ended == "finished" and complete is not None else \
            kept_to if c.ended == "stopped" and kept_to is not None else c.end
        marks.append((done, c.end, "idle"))
    else:
        marks.append((kept_to if kept_to is not None else c.start, c.end, "lost"))
    if ready is not None:
        marks.append((c.start, ready - (restore or 0.0), "startup"))
        if restore:
            marks.append((ready - restore, ready, "restore"))
    if warm is not None:
        second = float(warm.get("second") or 0.0)
        first_done = warm["time"] - second
        replayed = sum(b - a for a, b in replays if (ready or c.start) <= a < first_done)
        excess = float(warm.get("first") or 0.0) - replayed - second
        if excess > 0:
            marks.append((first_done - excess, first_done, "startup"))
    for a, b in replays:
        marks.append((a, b, "replay"))
    c.segments = _flatten(marks, c.start, c.end)


def _flatten(marks: list[tuple[float, float, str]], start: float, end: float) -> list[Segment]:
    """The stretches of [start, end], each of the kind of the highest-priority mark over it
    (the later mark among equals); adjacent stretches of one kind are joined."""
    cuts = sorted({start, end, *(min(max(x, start), end) for a, b, _ in marks for x in (a, b))})
    out: list[Segment] = []
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        best, rank = "idle", 0
        for m_start, m_end, kind in marks:
            if m_start <= a and b <= m_end and _PRIORITY[kind] >= rank:
                best, rank = kind, _PRIORITY[kind]
        if out and out[-1].kind == best and out[-1].end == a:
            out[-1].end = b
        else:
            out.append(Segment(a, b, best))
    return out


def _between(launches: list[_Launch], end: float) -> list[Segment]:
    """The time outside the cycles: before a launch's first cycle (startup), between its
    cycles and after its last one (idle), and between launches (queue under Slurm)."""
    out: list[Segment] = []
    previous_end: float | None = None
    for launch in launches:
        if previous_end is not None and launch.start > previous_end:
            if launch.job_id:
                # Slurm's start time splits the wait: queued until then, starting after.
                began = launch.job_started if launch.job_started is not None else launch.start
                began = min(max(began, previous_end), launch.start)
                out.append(Segment(previous_end, began, "queue"))
                out.append(Segment(began, launch.start, "startup"))
            else:
                out.append(Segment(previous_end, launch.start, "idle"))
        at = launch.start
        for i, c in enumerate(launch.cycles):
            out.append(Segment(at, max(at, c.start), "startup" if i == 0 else "idle"))
            at = max(at, c.end)
        launch_end = launch.end if launch.end is not None else at
        out.append(Segment(at, max(at, launch_end), "idle"))
        previous_end = max(at, launch_end)
    if previous_end is not None and end > previous_end:
        out.append(Segment(previous_end, end, "idle"))
    return [s for s in out if s.end > s.start]
