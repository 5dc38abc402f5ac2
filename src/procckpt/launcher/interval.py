"""The period of checkpoints that do not stop training: fixed, off, or auto (Young/Daly).

With ``--interval auto`` (the default) the period follows from what one checkpoint costs the
training (the pause ``C``, see costs.py) and the expected time between failures ``M``
(``--mtbf``, 24 h by default): Daly's first-order optimum ``sqrt(2 C M) - C``, which minimizes
the work lost to a failure plus the time spent checkpointing. Two floors keep it sane: the
checkpoints take at most 1 % of the run (``100 C``), and a checkpoint never waits for the
previous one's write (twice the time to durable). Until a checkpoint was measured, ``C`` is
taken as 1 s, and the first periodic checkpoint comes 30 s after the start: a run killed in its
first minute loses at most that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..durations import format_duration

__all__ = ["Period", "choose_period", "young_daly"]

#: The cost assumed before one was measured, and the latest a first measurement comes.
ASSUMED_PAUSE = 1.0
FIRST_AUTO_MAX = 30.0
#: The share of the run that periodic checkpoints may take at most.
MAX_OVERHEAD = 0.01


@dataclass(frozen=True)
class Period:
    """Seconds between periodic checkpoints (None: none), and why, in words."""

    seconds: float | None
    why: str


def young_daly(cost: float, mtbf: float) -> float:
    """The checkpoint period that loses the least time, for checkpoints costing ``cost``
    seconds and failures every ``mtbf`` seconds on average (Daly 2006, first order)."""
    if cost >= mtbf / 2:
        return mtbf
    return math.sqrt(2 * cost * mtbf) - cost


def choose_period(setting: float | str | None, mtbf: float, pause: float | None,
                  durable: float | None = None) -> Period:
    """The period for ``--interval setting`` given the measured ``pause`` and time to
    ``durable`` of recent checkpoints (None: not measured yet)."""
    if setting is None:
        return Period(None, "--interval off")
    if not isinstance(setting, str):
        return Period(float(setting), f"--interval {format_duration(setting)}")
    if pause is None:
        first = min(FIRST_AUTO_MAX, young_daly(ASSUMED_PAUSE, mtbf))
        return Period(first, f"auto, MTBF {format_duration(mtbf)}: a first checkpoint to "
                             "measure what one costs")
    best = young_daly(pause, mtbf)
    seconds = max(best, pause / MAX_OVERHEAD, 2 * (durable or 0.0))
    bound = "" if seconds == best else (
        ", held at 1% of the run" if seconds == pause / MAX_OVERHEAD
        else ", held at twice the time to write one")
    return Period(seconds, f"auto: a checkpoint pauses training {pause:.3g}s, MTBF "
                           f"{format_duration(mtbf)} (Young/Daly{bound})")
