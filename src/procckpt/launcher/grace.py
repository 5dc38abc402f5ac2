"""How early the deadline's checkpoint is asked for: the given grace, or more if checkpoints take longer.

The launcher asks at ``deadline - max(grace, 1.5 x the longest recent time to durable + one
step + 2 s)``: the request is seen at the next safe point, and a checkpoint that took 40 s
last time may take longer this time. When that is more than the grace the user gave, the
cycle's start says so, with the grace to use. Under Slurm the job is killed ``KillWait``
seconds after its SIGTERM; a preemption gives no more warning than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..durations import format_duration

__all__ = ["Lead", "deadline_lead"]

#: Safety factor on the longest recent time to durable, and a fixed margin on top.
FACTOR = 1.5
MARGIN = 2.0


@dataclass(frozen=True)
class Lead:
    """Seconds before the deadline to ask for its checkpoint; ``warning`` when the given
    grace is too short for what checkpoints took here."""

    seconds: float
    warning: str | None = None


def deadline_lead(grace: float, durable: tuple[float, str] | None, step_seconds: float | None,
                  limit: float | None = None, kill_wait: float | None = None,
                  signal_lead: float | None = None) -> Lead:
    """The lead for a cycle, from the grace, the longest recent ``durable`` time (and which
    checkpoint took it), the seconds per step, and the cycle's time ``limit``."""
    if durable is None:
        return Lead(grace)
    took, name = durable
    needed = FACTOR * took + (step_seconds or 0.0) + MARGIN
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
    if needed <= grace:
        return Lead(grace, "; ".join(notes) if notes else None)
    lead = needed if limit is None else min(needed, max(grace, limit / 2))
    use = math.ceil(needed)
    notes.insert(0, f"checkpoint {name} took {took:.1f}s to become durable, so the deadline's "
                    f"checkpoint is asked for {format_duration(lead)} before the end instead of "
                    f"the {format_duration(grace)} grace: pass --grace {use}s to say so"
                 + ("" if lead >= needed else
                    f" (and a longer time limit: a cycle of {format_duration(limit or 0)} "
                    "cannot spare that)"))
    return Lead(lead, "; ".join(notes))
