"""Warm restarts (issue 55): after a crash, the restart runs the script in a spare interpreter
that had already imported torch, and the script sees what a cold start shows it (argv,
__file__, __name__, sys.path[0], the environment, its process group, its signal handlers);
the run is bit-identical to an uninterrupted one, and no spare outlives the run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil
import pytest

from ..conftest import PROGRAMS, PYTHON, assert_bit_identical, memory_cgroup, procckpt_argv, run
from ..harness.processes import events

WARM = {"PROCCKPT_WARM_RESTARTS": "1", "WARM_TEST_VAR": "from the user's shell"}
SAME = ("argv", "orig_argv", "file", "name", "path0", "cwd", "var", "executable", "sigint",
        "sigterm", "undrawn", "threads", "scheduling")


def _reference(workdir: Path) -> Path:
    out = workdir / "reference.pt"
    done = run([PYTHON, str(PROGRAMS / "warm_train.py"), "--lives", str(workdir / "ref.jsonl"),
                "--out", str(out)], cwd=workdir, env={"PROCCKPT_DIR": str(workdir / "ref")})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _spares_gone(stderr: str) -> None:
    pids = [int(p) for p in re.findall(r"a spare interpreter \(pid (\d+)\)", stderr)]
    assert pids, stderr[-3000:]
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"spare {pid} lives"
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_restart_after_a_crash_starts_warm_and_the_script_cannot_tell(workdir: Path,
                                                                         how: str):
    """SIGKILLed at step 40, then at step 80, with the defaults (a crash after a checkpoint
    or a kept memory slot of its cycle is restarted): both restarts run in a spare."""
    expected = _reference(workdir)
    ckpt, out, lives = workdir / "ckpt", workdir / "out.pt", workdir / "lives.jsonl"
    args = ["--kill-at", "40", "80", "--lives", str(lives), "--out", str(out)]
    command = [PYTHON, str(PROGRAMS / "warm_train.py"), *args] if how == "script" else \
        [PYTHON, "-u", "-m", "warm_train", *args]
    done = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "1s", "--",
                *command], cwd=workdir if how == "script" else PROGRAMS,
               env=WARM, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    said = [json.loads(line) for line in lives.read_text().splitlines()]
    assert [life["restart"] for life in said] == ["0", "1", "2"], said
    assert [life["preloaded"] for life in said] == [False, True, True], done.stderr[-3000:]
    for key in SAME:
        assert len({json.dumps(life[key]) for life in said}) == 1, (key, said)
    assert said[0]["undrawn"] is True, said[0]
    cycles = events(ckpt, "cycle")
    assert [c.get("warm", False) for c in cycles] == [False, True, True], cycles
    # Each life leads no group of its own: it is in its keeper's, as a cold start is.
    assert [life["pgid"] for life in said] == [c["pid"] for c in cycles]
    first = said[0]
    if how == "module":
        assert first["orig_argv"][1:4] == ["-u", "-m", "warm_train"], first
        assert first["argv"][0] == str(PROGRAMS / "warm_train.py"), first
        assert first["path0"] == str(PROGRAMS), first
    else:
        assert first["path0"] == str(PROGRAMS) and first["name"] == "__main__", first
    assert first["var"] == "from the user's shell"
    # Each resume's first step started from what the kept state recorded (its random
    # streams: the slot's own, as the audit noted them when the slot was copied).
    audits = events(ckpt, "audit")
    assert [a["verdict"] for a in audits] == ["same", "same"], audits
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert "(warm: torch was imported)" in status.stdout, status.stdout
    _spares_gone(done.stderr)
    assert_bit_identical(expected, out)


def test_a_command_a_spare_cannot_serve_starts_cold_and_says_why(workdir: Path):
    script = f"exec {PYTHON} {PROGRAMS / 'warm_train.py'} --kill-at 20 --lives l --out o.pt"
    done = run([*procckpt_argv(), "run", "--dir", "ckpt", "--restart-on-failure", "--", "sh",
                "-c", script], cwd=workdir, env=WARM, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm restarts: not for this command: the command is not `python script.py` or " \
           "`python -m module`; a restart starts a new interpreter" in done.stderr
    assert "a spare interpreter" not in done.stderr
    said = [json.loads(line) for line in (workdir / "l").read_text().splitlines()]
    assert [life["preloaded"] for life in said] == [False, False]
    assert os.path.exists(workdir / "o.pt")


def test_no_spare_where_the_cgroup_has_no_room_for_one(workdir: Path):
    """A real memory cgroup of 700 MB: the training (about 350 MB) fits, a spare (about 300
    MB, started only where 768 MB are left) would take it near its OOM killer, which would kill
    the training: the restart starts cold, and one line says why."""
    lives = workdir / "l"
    with memory_cgroup(700 << 20) as in_cgroup:
        done = run([*in_cgroup, *procckpt_argv(),
                    "run", "--dir", "ckpt", "--restart-on-failure", "--", PYTHON,
                    str(PROGRAMS / "warm_train.py"), "--kill-at", "40", "--lives", str(lives),
                    "--out", "o.pt"], cwd=workdir, env=WARM, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "no spare interpreter" in line]
    assert len(said) == 1 and "this process's cgroup may take " in said[0], said
    assert "a spare interpreter (pid" not in done.stderr
    assert [json.loads(line)["preloaded"] for line in lives.read_text().splitlines()] == \
        [False, False]
