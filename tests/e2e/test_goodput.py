"""Goodput: where a run's time went (``procckpt status --json``), and its timeline page
(``procckpt report``) as a real browser renders it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from procckpt.inspect.report import COLOURS, PLOT_BACKGROUND

from ..conftest import PROGRAMS, PYTHON, procckpt_argv, run
from ..harness.processes import events

# One worker runs the module, so that its crashed run (a few minutes) runs once.
pytestmark = pytest.mark.xdist_group("goodput")

TINY = [PYTHON, str(PROGRAMS / "tiny_train.py")]
EPOCHS = 40
STEPS = EPOCHS * 8  # 8 batches an epoch
STEP_SLEEP = 0.05
FAIL_AT = 40


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A run with slow starts (3 s before the Checkpointer), 20 s cycles, and a crash (exit 3
    at step 40, two seconds into training, before any checkpoint) of the first cycle that
    reaches step 40: the first one, but where the imports took the cycle (47 s at the start
    of a loaded CI run), a later one. Without the memory tier, whose kept steps
    test_memory_tier.py counts: here the crash keeps nothing."""
    workdir = tmp_path_factory.mktemp("goodput")
    ckpt = workdir / "ckpt"
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "20s", "--grace",
               "3s", "--restart-on-failure", "--max-restarts", "20", "--no-memory-tier", "--",
               *TINY,
               "--epochs", str(EPOCHS), "--step-sleep", str(STEP_SLEEP), "--start-seconds", "3",
               "--fail-at-step", str(FAIL_AT), "--fail-once", str(workdir / "failed")],
              cwd=workdir, timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    status = run([*procckpt_argv(), "status", "--json", str(ckpt)], cwd=workdir)
    assert status.returncode == 0, status.stderr
    return ckpt, json.loads(status.stdout)


def test_the_parts_add_up_and_each_sees_what_happened(crashed_run: tuple[Path, dict]):
    ckpt, status = crashed_run
    goodput = status["goodput"]
    seconds, wall = goodput["seconds"], goodput["wall_seconds"]
    assert set(seconds) == {"training", "startup", "restore", "checkpoint_stall", "replay",
                            "lost", "idle", "queue"}
    assert abs(sum(seconds.values()) - wall) <= 0.03 * wall, goodput
    assert goodput["ettr"] == pytest.approx(seconds["training"] / wall, abs=1e-3)
    cycles = goodput["cycles"]
    ended = [(c["ended"], c["exit_code"]) for c in cycles]
    # The crash: "failed", or "unconfirmed" where a deadline's checkpoint was asked for when
    # it came (under load, where step 40 came late in its cycle).
    crashes = [i for i, c in enumerate(cycles) if c["exit_code"] == 3]
    assert len(crashes) == 1, ended
    crash = crashes[0]
    assert cycles[crash]["ended"] in ("failed", "unconfirmed"), ended
    # Before it, only cycles that ended short of step 40, under load (none on a quiet
    # machine); after it, time-limit cycles.
    assert all(c["ended"] in ("stopped", "unconfirmed") for c in cycles[:crash]), ended
    assert len(cycles) - crash >= 3, ended  # the crash, then time-limit cycles
    assert cycles[-1]["ended"] == "finished", ended
    # After it, time-limit cycles; under load some of them "unconfirmed" too (this session's
    # fresh-clone run: start-ups of 11-19 s against 20-s cycles, one whose training had not
    # connected when its deadline came).
    later = cycles[crash + 1:-1]
    assert all(c["ended"] in ("stopped", "unconfirmed") for c in later), ended
    assert any(c["ended"] == "stopped" for c in later), ended
    stopped = [i for i, c in enumerate(cycles) if i > crash and c["ended"] != "unconfirmed"]
    # The slow starts: 3 s of each cycle before the Checkpointer was ready, besides imports.
    # (A cycle whose training never connected before its deadline is lost whole.)
    assert all(c["seconds"]["startup"] >= 3.0 for c in cycles if c["ended"] != "unconfirmed"
               or c["seconds"]["lost"] < 0.9 * sum(c["seconds"].values())), \
        [c["seconds"]["startup"] for c in cycles]
    # The crashed cycle's steps (39, from a start anew) were trained again: lost, none of
    # them counted as training.
    began = next((e["step"] for e in events(ckpt, "resume") if e["restart"] == crash), 0)
    assert cycles[crash]["seconds"]["lost"] >= (FAIL_AT - 1 - began) * STEP_SLEEP, cycles
    assert cycles[crash]["seconds"]["training"] == 0, cycles[crash]
    # The crash left no checkpoint: the cycle after it began where the crashed one did
    # (anew, with nothing to restore, unless a cycle before it had stopped with one); every
    # later one resumed from a checkpoint.
    restores = [c["seconds"]["restore"] for c in cycles]
    if cycles[crash + 1]["ended"] != "unconfirmed":
        assert (restores[crash + 1] > 0) == (began > 0), (began, restores)
    assert all(restores[i] > 0 for i in stopped if i >= crash + 2), restores
    assert all(cycles[i]["checkpoints"] >= 1 for i in stopped), \
        [c["checkpoints"] for c in cycles]
    # Training time: at least the steps' sleeps of one uninterrupted pass.
    assert seconds["training"] >= STEPS * STEP_SLEEP, goodput
    assert seconds["queue"] == 0  # not a Slurm job

    text = run([*procckpt_argv(), "status", str(ckpt)], cwd=ckpt.parent)
    # The JSON's ratio is rounded to 4 places, the text's percentage to 1 from the unrounded
    # one: 0.42154 is 42.2 % there, while 0.4215 formats as 42.1.
    shown = re.search(r"goodput:\s+([0-9.]+) % of", text.stdout)
    assert shown and abs(float(shown.group(1)) - 100 * goodput["ettr"]) <= 0.051, text.stdout

    # The journal stays small: what a cycle adds to it.
    per_cycle = (ckpt / "events.jsonl").stat().st_size / len(cycles)
    print(f"journal: {per_cycle:.0f} bytes a cycle")
    assert per_cycle < 4000, per_cycle


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium to render the report with (apt-get install chromium)")


def test_the_report_renders_one_bar_per_cycle_and_a_legend(crashed_run: tuple[Path, dict]):
    Image = pytest.importorskip("PIL.Image", reason="pillow reads the rendered page")
    ckpt, status = crashed_run
    page = ckpt.parent / "report.html"
    res = run([*procckpt_argv(), "report", str(ckpt), "-o", str(page)], cwd=ckpt.parent)
    assert res.returncode == 0, res.stderr
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text and "<script" not in text  # nothing from the network

    png = ckpt.parent / "report.png"
    shot = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--window-size=1200,900",
                           f"--screenshot={png}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert png.exists(), shot.stderr[-2000:]
    image = Image.open(png).convert("RGB")
    width, height = image.size
    pixels = image.load()
    rgb = {kind: tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for kind, c in COLOURS.items()}
    backdrop = tuple(int(PLOT_BACKGROUND[i:i + 2], 16) for i in (1, 3, 5))

    # The chart is the grey plot area (rows wide with its grey: a stray pixel of the same grey
    # at a glyph's edge is no chart); in it, each cycle is a band of rows with bar colours.
    plot_rows = [y for y in range(height)
                 if sum(pixels[x, y] == backdrop for x in range(0, width, 2)) >= 100]
    assert plot_rows, "no plot area on the rendered page"
    top, bottom = min(plot_rows), max(plot_rows)
    plot_cols = [x for x in range(width)
                 if sum(pixels[x, y] == backdrop for y in plot_rows) >= len(plot_rows) // 4]
    left, right = min(plot_cols), max(plot_cols)
    colours = set(rgb.values())
    rows = [y for y in range(top, bottom + 1)
            if sum(pixels[x, y] in colours for x in range(left, right + 1)) >= 4]
    bands = sum(1 for i, y in enumerate(rows) if i == 0 or y != rows[i - 1] + 1)
    assert bands == len(status["goodput"]["cycles"]), (bands, rows)
    seen_in_bars = {kind for kind, c in rgb.items()
                    if any(pixels[x, y] == c for y in rows for x in range(left, right + 1, 2))}
    assert {"training", "startup", "lost"} <= seen_in_bars, seen_in_bars

    # The legend: a swatch of every colour, outside the chart.
    for kind, c in rgb.items():
        assert any(pixels[x, y] == c for y in range(0, top) for x in range(0, width)), \
            f"no legend swatch for {kind}"
