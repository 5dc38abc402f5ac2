"""Parsing and printing of durations: ``90s``, ``15m``, ``2h``, ``1:30:00``, ``2-00:00:00``."""

from __future__ import annotations

import re

from .errors import UsageError

__all__ = ["parse_duration", "format_duration"]

_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_UNIT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|[smhd]?)\s*$", re.IGNORECASE)
#: Longer than any queue allows, short enough that deadline arithmetic stays exact.
MAX_SECONDS = 10 * 366 * 86400.0
_CLOCK_RE = re.compile(r"^\s*(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\s*$")


def parse_duration(text: str | int | float, *, what: str = "duration") -> float:
    """Return the number of seconds in ``text``.

    Accepted forms: a number with an optional unit (``45``, ``2500ms``, ``90s``, ``15m``,
    ``2h``, ``1d``; a bare number is seconds), or a clock ``[D-]H:MM:SS`` / ``MM:SS`` /
    ``D-H[:MM]``.
    Slurm's bare-number "minutes" form is deliberately not accepted: ``procckpt sbatch``
    passes ``-t`` to Slurm untouched instead.

    Raises:
        UsageError: the text is none of these forms, negative, not finite, or over ten years.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UsageError(f"bad {what} {text!r}: use e.g. 90s, 15m, 2h or 1:30:00")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        seconds = _parse_text(text, what)
    shown = text if len(str(text)) <= 40 else f"{str(text)[:37]}..."
    if seconds != seconds:  # NaN
        raise UsageError(f"bad {what} {shown!r}: use e.g. 90s, 15m, 2h or 1:30:00")
    if seconds < 0:
        raise UsageError(f"bad {what} {shown!r}: it must not be negative")
    if seconds > MAX_SECONDS:
        raise UsageError(f"bad {what} {shown!r}: more than ten years; leave it out for no limit")
    return seconds


def _parse_text(text: str, what: str) -> float:
    if text.strip().startswith("-"):
        raise UsageError(f"bad {what} {text[:40]!r}: it must not be negative")
    match = _UNIT_RE.match(text)
    if match:
        return float(match.group(1)) * _UNIT_SECONDS[(match.group(2) or "s").lower()]
    match = _CLOCK_RE.match(text)
    if match and (":" in text or "-" in text):
        days, first, second, third = match.groups()
        if "-" in text:  # D-H, D-H:MM, D-H:MM:SS
            hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        elif third is not None:  # H:MM:SS
            hours, minutes, seconds = int(first), int(second), int(third)
        else:  # MM:SS
            hours, minutes, seconds = 0, int(first), int(second)
        if minutes >= 60 or seconds >= 60:
            raise UsageError(f"bad {what} {text!r}: minutes and seconds must be below 60")
        return float(((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds)
    raise UsageError(f"bad {what} {text[:40]!r}: use e.g. 90s, 15m, 2h, 1:30:00 or 2500ms")


def format_duration(seconds: float) -> str:
    """Return a short human form such as ``1h02m``, ``3m05s`` or ``4.2s``."""
    if seconds != seconds or abs(seconds) == float("inf"):
        return str(seconds)
    if seconds < 0:
        return f"-{format_duration(-seconds)}"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"
