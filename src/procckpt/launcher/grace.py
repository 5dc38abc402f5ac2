"""How early the deadline's checkpoint is asked for: the grace, or more if the training needs it.

The request is seen at the next safe point, and that may be a while off: a step, or a
validation pass and the epoch's end. So the launcher asks at ``deadline - max(grace, 1.5 x
the longest recent time to durable + the longest stretch between two safe points + 2 s)``,
both learned as the run goes (the journal's checkpoints, the heartbeat's steps). When that
exceeds the grace the user gave by a margin that matters, the launcher says so once, with the
grace to use. Under Slurm the job is killed ``KillWait`` seconds after its SIGTERM; a
preemption gives no more warning than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..durations import format_duration

__all__ = ["Lead", "deadline_lead"]

#: Safety factor on the longest recent time to durable, and a fixed margin on top.
FACTOR = 1.5
MARGIN = 2.0
#: A need above the grace by less than this (seconds, or this share of the grace) is met
#: without a word.
SLACK = 1.0
SLACK_SHARE = 0.1
#: However much the training needs, the deadline's checkpoint is asked for at most this share
#: of a cycle before its end, so that every cycle trains.
MAX_SHARE = 0.75


@dataclass(frozen=True)
class Lead:
    """Seconds before the deadline to ask for its checkpoint; ``warning`` when the given
    grace is too short for what checkpoints took here."""

    seconds: float
    warning: str | None = None


def deadline_lead(grace: float, durable: tuple[float, str] | None, step_seconds: float | None,
                  limit: float | None = None, kill_wait: float | None = None,
                  signal_lead: float | None = None, gap: float | None = None) -> Lead:
    """The lead for a cycle, from the grace, the longest recent ``durable`` time (and which
    checkpoint took it), the seconds per step, the longest ``gap`` seen between two safe
    points, and the cycle's time ``limit``."""
    between = max(step_seconds or 0.0, gap or 0.0)
    if durable is None and not gap:
        return Lead(grace)
    took, name = durable if durable is not None else (0.0, "")
    needed = FACTOR * took + between + MARGIN
    notes = []
    if kill_wait is not None and took > kill_wait:
        notes.append(f"a preemption leaves only KillWait={kill_wait:g}s between Slurm's SIGTERM "
                     f"and SIGKILL, less than the {took:.1f}s {name} took; lower that cost or "
                     "checkpoint more often (--interval)")
    if signal_lead is not None and signal_lead < needed:
        notes.append(f"the job's --signal comes {signal_lead:g}s before the end, less than the "
                     f"{math.ceil(needed)}s a checkpoint needs here: submit with "
                     f"--signal=B:USR1@{math.ceil(needed)} (procckpt sbatch --grace "
                     f"{math.ceil(needed)}s)")
    if needed <= grace + max(SLACK, SLACK_SHARE * grace):
        return Lead(max(grace, needed), "; ".join(notes) if notes else None)
    lead = needed if limit is None else min(needed, max(grace, MAX_SHARE * limit))
    use = math.ceil(needed)
    why = []
    if took * FACTOR >= between:
        why.append(f"checkpoint {name} took {took:.1f}s to become durable")
    if gap is not None and gap >= 2 * (step_seconds or 0.0) and gap * 2 >= took * FACTOR:
        why.append(f"the training went {gap:.0f}s without a safe point (a validation pass or "
                   "an epoch's end, where a request waits)")
    notes.insert(0, " and ".join(why or [f"a step takes {between:.1f}s"])
                 + f", so the deadline's checkpoint is asked for {format_duration(lead)} before "
                 f"the end, not {format_duration(grace)} (the grace): pass --grace {use}s to "
                 "say so"
                 + ("" if lead >= needed else
                    f" (and a longer time limit: a cycle of {format_duration(limit or 0)} "
                    "cannot spare that)"))
    return Lead(lead, "; ".join(notes))
