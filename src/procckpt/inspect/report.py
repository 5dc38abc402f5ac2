"""``procckpt report DIR``: the run's timeline as one self-contained HTML page.

Computed from the events journal alone (goodput.py), so it can be made after the fact on any
machine that has the directory; drawn as inline SVG with inline styles, nothing fetched from
the network, so the page opens from a login node after ``scp``. One row per cycle: the wait
before it (queued, idle, starting), then its time coloured by what it went to, checkpoints as
ticks above it, and how it ended.
"""

from __future__ import annotations

import bisect
import html
import itertools
import time
from pathlib import Path
from typing import Any

from ..durations import format_duration
from ..errors import StoreError
from ..protocol.events import read_events
from ..store.files import write_file_atomic
from .goodput import KINDS, Goodput, Segment, compute_goodput
from .status import LABELS, damaged_journal, opened_for_reading, recoveries_line, status_data

__all__ = ["render_report", "write_report", "COLOURS"]

#: One colour per part of the time, in the timeline and the legend.
COLOURS = {"training": "#2e7d32", "startup": "#f9a825", "restore": "#1565c0",
           "replay": "#8e24aa", "checkpoint_stall": "#00838f", "lost": "#d32f2f",
           "idle": "#9e9e9e", "queue": "#bcaaa4"}
#: The plot area's background: a person's eye (and the browser test) finds the chart by it.
PLOT_BACKGROUND = "#f4f4f4"

WIDTH = 1100
LABEL_WIDTH = 80
RIGHT_WIDTH = 210
#: The smallest width a cycle's bar is drawn with, however short the cycle.
MIN_BAR = 6

ENDINGS = {"finished": "finished", "stopped": "saved, stopped", "exited": "exited 0",
           "failed": "crashed", "hung": "hung", "unconfirmed": "stopped, no checkpoint",
           "killed": "vanished", "running": "running", "node-lost": "node lost"}
#: What came after a cycle: a restart's cause, or how the launch ended.
AFTER = {"deadline": "restart: time limit", "failure": "restart: crash", "hang": "restart: hang",
         "signal": "restart: signal", "child": "restart", "requeued": "requeued",
         "checkpointed": "exit 75 (resume later)", "finished": "", "already-complete": "",
         "ended-early": "exit 0, not finished"}


def write_report(root: Path, output: Path | None = None) -> Path:
    """Render the report of checkpoint dir ``root`` into ``output`` (default
    ``root/report.html``); return its path."""
    page = render_report(root)
    path = output if output is not None else root / "report.html"
    try:
        write_file_atomic(path, page.encode())
    except OSError as e:
        raise StoreError(f"cannot write {path}: {e.strerror or e}; pass -o with a writable "
                         "place") from e
    return path


def render_report(root: Path) -> str:
    """The HTML page for checkpoint dir ``root``."""
    store = opened_for_reading(root)
    data = status_data(root, events=0, verify=False)
    history = list(read_events(root / "events.jsonl"))
    goodput = compute_goodput(history, now=time.time() if data["state"] == "running" else None)
    title = f"procckpt: {root.resolve().name}"
    body = [f"<h1>{_e(title)}</h1>", f"<p class=dir>{_e(data['dir'])} · {_e(data['state'])}</p>"]
    damage = damaged_journal(store)
    if damage is not None:
        body.append(f"<p class=warn>{_e(damage[0].upper() + damage[1:])}.</p>")
    if goodput is None or goodput.wall <= 0:
        body.append("<p>No launch in the journal yet: run it under <code>procckpt run</code>.</p>")
    else:
        body += [_summary(goodput, data), _legend(goodput), _settings(goodput),
                 _timeline(goodput), _cycle_table(goodput)]
    return PAGE.format(title=_e(title), body="\n".join(body))


def _summary(g: Goodput, data: dict[str, Any]) -> str:
    seconds = g.seconds()
    launches = len({c.launch for c in g.cycles})
    ettr = 100 * (g.ettr or 0.0)
    return (f"<p class=ettr>Goodput (ETTR) <b>{ettr:.1f} %</b>: "
            f"{format_duration(seconds['training'])} of {format_duration(g.wall)} trained the "
            f"model, over {len(g.cycles)} cycles in "
            f"{launches} launch{'es' if launches != 1 else ''}; {data['restarts']} restarts, "
            f"{len(_all(g, 'checkpoints'))} checkpoints, {len(_all(g, 'hangs'))} hangs. "
            f"From {_clock(g.start)} to {_clock(g.end)}.</p>"
            + ("" if (timed := recoveries_line(g)) is None else f"<p>{_e(timed)}.</p>"))


def _all(g: Goodput, what: str) -> list[float]:
    return [t for c in g.cycles for t in getattr(c, what)]


def _legend(g: Goodput) -> str:
    seconds = g.seconds()
    items = []
    for kind in KINDS:
        share = 100 * seconds[kind] / g.wall
        items.append(f"<li><svg width=14 height=14><rect width=14 height=14 fill='{COLOURS[kind]}'"
                     f" shape-rendering=crispEdges /></svg> {_e(LABELS[kind])} "
                     f"<span>{_short(seconds[kind])} ({share:.1f} %)</span></li>")
    return f"<ul class=legend>{''.join(items)}</ul>"


def _settings(g: Goodput) -> str:
    last = g.cycles[-1] if g.cycles else None
    parts = []
    if g.interval is not None:
        seconds, why = g.interval
        every = "off" if seconds is None else f"every {format_duration(seconds)}"
        parts.append(f"periodic checkpoints {every} ({_e(why)})")
    elif last is not None and last.interval:
        parts.append(f"periodic checkpoints every {format_duration(last.interval)}")
    if last is not None and last.lead is not None:
        parts.append(f"the stop's checkpoint asked for {format_duration(last.lead)} before "
                     "the deadline")
    return f"<p class=settings>{'; '.join(parts)}.</p>" if parts else ""


def _timeline(g: Goodput) -> str:
    n = len(g.cycles)
    row = 24 if n <= 30 else max(8, 720 // n)
    bar = max(4, int(row * 0.6))
    plot_w = WIDTH - LABEL_WIDTH - RIGHT_WIDTH
    axis_h = 28
    height = n * row + axis_h + 8
    scale = plot_w / g.wall

    def x(t: float) -> float:
        return LABEL_WIDTH + (t - g.start) * scale

    parts = [f"<svg class=timeline width={WIDTH} height={height} "
             f"viewBox='0 0 {WIDTH} {height}' xmlns='http://www.w3.org/2000/svg'>",
             f"<rect x={LABEL_WIDTH} y=0 width={plot_w} height={n * row} "
             f"fill='{PLOT_BACKGROUND}' shape-rendering=crispEdges />"]
    waits = _waits_before(g)
    for i, c in enumerate(g.cycles):
        top = i * row + (row - bar) // 2
        parts.append(f"<text x={LABEL_WIDTH - 8} y={top + bar - 2} text-anchor=end "
                     f"class=label>cycle {c.number}</text>")
        for s in waits[i]:
            parts.append(_rect(x(s.start), x(s.end), top + bar // 4, bar // 2, s,
                               f"before cycle {c.number}"))
        left, right = x(c.start), max(x(c.end), x(c.start) + MIN_BAR)
        stretch = (right - left) / max(x(c.end) - left, 1e-9)
        for s in c.segments:
            a = left + (x(s.start) - left) * stretch
            b = left + (x(s.end) - left) * stretch
            parts.append(_rect(a, b, top, bar, s, f"cycle {c.number}"))
        for t in c.checkpoints:
            tx = left + (x(t) - left) * stretch
            parts.append(f"<path d='M{tx:.1f},{top - 1} l-3,-5 h6 z' fill='#212121'>"
                         f"<title>checkpoint at {_clock(t)}</title></path>")
        for t in c.hangs:
            tx = left + (x(t) - left) * stretch
            parts.append(f"<text x={tx:.1f} y={top - 1} class=mark text-anchor=middle>"
                         f"⏸<title>hang detected at {_clock(t)}</title></text>")
        if c.ended in ("failed", "killed", "hung", "unconfirmed", "node-lost"):
            parts.append(f"<text x={right + 2:.1f} y={top + bar - 1} class=crash>✕</text>")
        after = AFTER.get(c.then, c.then) if c.then else ""
        then = f" → {after}" if after else ""
        code = f" ({c.exit_code})" if c.ended == "failed" and c.exit_code is not None else ""
        parts.append(f"<text x={WIDTH - RIGHT_WIDTH + 8} y={top + bar - 2} class=label>"
                     f"{_e(ENDINGS.get(c.ended, c.ended) + code + then)}</text>")
    parts += _axis(g, n * row, plot_w, x)
    parts.append("</svg>")
    return "<h2>Timeline</h2>" + "".join(parts)


def _waits_before(g: Goodput) -> list[list[Segment]]:
    """The time outside cycles, each stretch drawn in the row of the cycle that follows it."""
    out: list[list[Segment]] = [[] for _ in g.cycles]
    # The first cycle that starts once the stretch ended, by bisection over the cycles' starts
    # (in order; a running maximum keeps the search right if a clock stepped back).
    starts = list(itertools.accumulate((c.start for c in g.cycles), max))
    for s in g.between:
        following = bisect.bisect_left(starts, s.end - 1e-6)
        if following < len(starts):
            out[following].append(s)
        elif g.cycles:
            out[-1].append(s)
    return out


def _rect(a: float, b: float, top: int, height: int, s: Segment, where: str) -> str:
    width = max(b - a, 0.0)
    return (f"<rect x={a:.2f} y={top} width={width:.2f} height={height} "
            f"fill='{COLOURS[s.kind]}' shape-rendering=crispEdges><title>{_e(where)}: "
            f"{_e(LABELS[s.kind])} {_short(s.seconds)} ({_clock(s.start)}–"
            f"{_clock(s.end)})</title></rect>")


def _axis(g: Goodput, y: int, plot_w: int, x: Any) -> list[str]:
    step = _nice_step(g.wall / 8)
    out = [f"<line x1={LABEL_WIDTH} x2={LABEL_WIDTH + plot_w} y1={y + 1} y2={y + 1} "
           "stroke='#616161' />"]
    t = 0.0
    while t <= g.wall + 1e-9:
        px = x(g.start + t)
        out.append(f"<line x1={px:.1f} x2={px:.1f} y1={y + 1} y2={y + 6} stroke='#616161' />"
                   f"<text x={px:.1f} y={y + 18} text-anchor=middle class=axis>"
                   f"{'0' if t == 0 else format_duration(t)}</text>")
        t += step
    return out


def _nice_step(seconds: float) -> float:
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600,
                 43200, 86400):
        if step >= seconds:
            return float(step)
    return 86400.0 * max(1, round(seconds / 86400))


def _cycle_table(g: Goodput) -> str:
    head = "".join(f"<th>{_e(LABELS[k])}</th>" for k in KINDS if k != "queue")
    rows = []
    for c in g.cycles:
        secs = c.seconds()
        cells = "".join(f"<td>{_short(secs[k])}</td>" for k in KINDS if k != "queue")
        rows.append(f"<tr><td>{c.number}</td><td>{c.launch}</td><td>{_clock(c.start)}</td>"
                    f"<td>{format_duration(c.end - c.start)}</td>"
                    f"<td>{_e(ENDINGS.get(c.ended, c.ended))}</td>"
                    f"<td>{_e(AFTER.get(c.then or '', c.then or ''))}</td>"
                    f"<td>{len(c.checkpoints)}</td>{cells}</tr>")
    return ("<h2>Cycles</h2><table><tr><th>cycle</th><th>launch</th><th>started</th>"
            f"<th>length</th><th>ended</th><th>then</th><th>checkpoints</th>{head}</tr>"
            + "".join(rows) + "</table>")


def _short(seconds: float) -> str:
    """A duration, in milliseconds below a tenth of a second (a checkpoint's pause)."""
    return f"{1000 * seconds:.0f}ms" if 0 < seconds < 0.1 else format_duration(seconds)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #212121; background: #fff; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }} h2 {{ font-size: 16px; margin: 22px 0 8px; }}
.dir {{ color: #616161; margin: 0 0 12px; }} .ettr b {{ font-size: 18px; }}
.legend {{ list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 6px 22px; }}
.legend li {{ display: flex; align-items: center; gap: 6px; }} .legend span {{ color: #616161; }}
.label, .axis {{ font-size: 12px; fill: #424242; }} .crash {{ font-size: 13px; fill: #b71c1c; }}
.mark {{ font-size: 11px; fill: #b71c1c; }} .warn {{ color: #b71c1c; }}
table {{ border-collapse: collapse; font-size: 12px; }}
td, th {{ border-bottom: 1px solid #e0e0e0; padding: 3px 8px; text-align: right; }}
</style></head>
<body>
{body}
</body></html>
"""
