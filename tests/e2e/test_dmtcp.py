"""The DMTCP engine, end to end with real DMTCP, real processes and real signals.

Programs that know nothing about procckpt (tests/harness/programs/plain_*.py),
interrupted by --time-limit at least twice, continue from their process image (their printed
step counters go on where they were, never back to the start) and end with the same result as an
uninterrupted run; two runs at once both finish; an image killed while being written is never
restarted from; a damaged or unrestorable newest image falls back to the previous one; ``procckpt
status`` lists image sizes and write times. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from procckpt.protocol.events import read_events
from procckpt.store import file_crc32

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, REPO, assert_bit_identical, procckpt_argv, run

# auto takes DMTCP for a plain script only where CRIU cannot be used: CRIU is hidden here.
pytestmark = pytest.mark.usefixtures("without_criu")

NO_DMTCP = ("DMTCP is not installed (no dmtcp_launch on PATH); `module load dmtcp` or build "
            "it from https://github.com/dmtcp/dmtcp")


def needs_dmtcp(test: Callable[..., None]) -> Callable[..., None]:
    skip = pytest.mark.skipif(shutil.which("dmtcp_launch") is None, reason=NO_DMTCP)
    return pytest.mark.dmtcp(skip(test))

LOOP = [PYTHON, str(PROGRAMS / "plain_loop.py")]
TORCH = [PYTHON, str(EXAMPLES / "plain_torch_train.py")]


def steps(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("step ")]


def events(directory: Path) -> list[dict]:
    return list(read_events(directory / "events.jsonl"))


def loop_reference(workdir: Path, n: int) -> list[str]:
    out = workdir / "reference.txt"
    result = run([*LOOP, "--steps", str(n), "--step-sleep", "0", "--out", str(out)], cwd=workdir)
    assert result.returncode == 0, result.stderr
    return out.read_text().split()[:2]


def procckpt_run(workdir: Path, ckpt: Path, options: list[str], command: list[str],
                 timeout: float = 600, env: dict[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    return run([*procckpt_argv(), "run", "--dir", str(ckpt), *options, "--", *command],
               cwd=workdir, timeout=timeout, env=env)


def assert_resumed_from_images(result: subprocess.CompletedProcess[str], ckpt: Path,
                               total: int, min_restarts: int = 2) -> None:
    """Every step printed once, in order, across all cycles (the stop's image is taken with
    --kcheckpoint, so nothing runs past it), and at least ``min_restarts`` restarts that
    each resumed from an image."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps(result.stdout) == list(range(1, total + 1)), result.stdout[-2000:]
    history = events(ckpt)
    restarts = [e for e in history if e["event"] == "restart" and e["cause"] == "deadline"]
    resumes = [e for e in history if e["event"] == "resume" and e.get("engine") == "dmtcp"]
    assert len(restarts) >= min_restarts and len(resumes) == len(restarts), history
    assert history[-1]["event"] == "exit" and history[-1]["reason"] == "finished"


@needs_dmtcp
def test_plain_loop_continues_from_its_image_across_time_limits(workdir: Path):
    ckpt = workdir / "ckpt"
    # 240 steps of 50 ms: 12 s of work; 8 s cycles (checkpoint at 5 s) need >= 3 of them.
    result = procckpt_run(workdir, ckpt, ["--time-limit", "8s", "--grace", "3s"],
                          [*LOOP, "--steps", "240", "--ballast-mb", "16", "--out", "out.txt"])
    assert "engine: dmtcp (the command does not import procckpt and DMTCP is installed (not " \
           "CRIU: /nonexistent/criu is not an executable))" in result.stderr
    assert_resumed_from_images(result, ckpt, 240)
    final = (workdir / "out.txt").read_text().split()
    assert final[:2] == loop_reference(workdir, 240)
    # The random ballast drawn at the first start survived every restart: no cycle began anew.
    ballast = re.findall(r"^ballast (\w+)$", result.stdout, re.MULTILINE)
    assert ballast == [final[2]]

    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines() if line.startswith("ckpt-")]
    assert len(rows) == 2, status.stdout  # --keep 2: the older images were deleted
    for row in rows:
        # CHECKPOINT STEP EPOCH SIZE(2 words) WRITTEN(2 words) WRITE AGE ENGINE REASON VALID
        assert row[4] == "MB" and float(row[3]) > 16, status.stdout
        assert row[5:7] == row[3:5], status.stdout  # an image is written whole
        assert re.fullmatch(r"\d+\.\ds", row[7]) and row[9:] == ["dmtcp", "deadline", "yes"]


@pytest.mark.slow
@needs_dmtcp
def test_pytorch_training_continues_from_its_image_to_the_same_parameters(workdir: Path):
    reference = workdir / "reference.pt"
    plain = run([*TORCH, "--epochs", "12", "--out", str(reference)], cwd=workdir)
    assert plain.returncode == 0, plain.stderr
    ckpt = workdir / "ckpt"
    # 192 steps of >= 0.15 s: >= 29 s of training, more than two ~13 s windows on a quiet
    # machine; a torch image (~650 MB) takes seconds to write, hence 25 s cycles with the
    # checkpoint asked for 12 s before the end.
    result = procckpt_run(workdir, ckpt, ["--time-limit", "25s", "--grace", "12s"],
                          [*TORCH, "--epochs", "12", "--step-sleep", "0.15",
                           "--out", "resumed.pt"], timeout=900)
    assert_resumed_from_images(result, ckpt, 192)
    assert_bit_identical(reference, workdir / "resumed.pt")


@needs_dmtcp
def test_two_runs_at_once_on_one_machine_both_finish(workdir: Path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([*procckpt_argv(), "run", "--dir", f"ckpt{i}", "--time-limit", "8s",
                               "--grace", "3s", "--", *LOOP, "--steps", "200",
                               "--out", f"out{i}.txt"], cwd=workdir, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    reference = loop_reference(workdir, 200)
    ports = []
    for i, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        assert_resumed_from_images(result, workdir / f"ckpt{i}", 200)
        assert (workdir / f"out{i}.txt").read_text().split()[:2] == reference
        ports.append(set(re.findall(r"--coord-port (\d+)", stderr)))
    assert not ports[0] & ports[1], "the two runs shared a coordinator port"


@needs_dmtcp
def test_an_image_killed_while_being_written_is_never_restarted_from(workdir: Path):
    ckpt = workdir / "ckpt"
    images = ckpt / "dmtcp" / "images"
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--interval", "2s",
                             "--", *LOOP, "--steps", "300", "--ballast-mb", "200",
                             "--out", "out.txt"], cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        committed: set[str] = set()
        deadline = time.monotonic() + 180
        partial: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            # Wait for one committed image, then for the next one to be half-written.
            committed = {p.name for p in (ckpt / "checkpoints").glob("ckpt-*")}
            partial = list(images.glob("*.temp")) if committed else []
            if partial:
                break
            time.sleep(0.01)
        assert partial, "never saw an image being written after a committed one"
        tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:  # the launcher, the command and DMTCP's coordinator, all at once
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        first_stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any(images.glob("*.temp")), "the half-written image should still be on disk"

    result = procckpt_run(workdir, ckpt, [], [*LOOP, "--steps", "300", "--ballast-mb", "200",
                                              "--out", "out.txt"])
    assert result.returncode == 0, result.stderr[-3000:]
    resumes = [e for e in events(ckpt) if e["event"] == "resume"]
    assert [e["checkpoint"] for e in resumes] == [max(committed)], resumes
    assert not any(images.glob("*.temp"))
    # The restart went on from the committed image (it may predate the first step): the
    # steps continue without a gap, and the process never started anew (one ballast, kept).
    before, after = steps(first_stdout), steps(result.stdout)
    last_before = before[-1] if before else 0  # killed before its first step, on a slow day
    assert after[0] <= last_before + 1 and after == list(range(after[0], 301)), before[-5:]
    final = (workdir / "out.txt").read_text().split()
    assert final[:2] == loop_reference(workdir, 300)
    printed = [re.findall(r"^ballast (\w+)$", out, re.MULTILINE)
               for out in (first_stdout, result.stdout)]
    if after[0] > 1:  # the image holds a step, so the ballast too: the restart made none
        assert printed == [[final[2]], []]
    else:  # an image taken while the ballast was being drawn: the restart draws it again
        assert (printed[1] or printed[0]) == [final[2]], printed


@needs_dmtcp
def test_sigterm_checkpoints_and_stops_and_the_next_run_continues(workdir: Path):
    ckpt = workdir / "ckpt"
    proc = subprocess.Popen([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *LOOP,
                             "--steps", "160", "--out", "out.txt"], cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 40"):
            break
    proc.send_signal(signal.SIGTERM)  # what Slurm, scancel or a pod deletion send
    rest, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert "run the same command again to resume" in stderr
    before = [40, *steps(rest)]
    result = procckpt_run(workdir, ckpt, [], [*LOOP, "--steps", "160", "--out", "out.txt"])
    assert result.returncode == 0, result.stderr[-3000:]
    after = steps(result.stdout)
    assert after[0] == before[-1] + 1 and after == list(range(after[0], 161))
    assert (workdir / "out.txt").read_text().split()[:2] == loop_reference(workdir, 160)


@needs_dmtcp
def test_a_command_that_finishes_while_its_stop_is_asked_for_is_not_run_again(workdir: Path):
    # The command holds DMTCP's checkpoints off after its last step until the deadline's
    # stop was asked for, then finishes: DMTCP never writes the stop's image. Its exit code 0
    # is its own (DMTCP's exit after a stop image is 0 too, but comes only after the image),
    # so the run is complete; it was restarted from scratch before (a CI failure under
    # Slurm: a finished run requeued and its last steps run twice).
    ckpt = workdir / "ckpt"
    result = procckpt_run(workdir, ckpt, ["--time-limit", "8s", "--grace", "4s",
                                          "--max-restarts", "2"],
                          [*LOOP, "--steps", "5", "--out", "out.txt",
                           "--end-unsaveable-after-stop", str(ckpt / "events.jsonl")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done") == 1, result.stdout[-2000:]
    assert steps(result.stdout) == [1, 2, 3, 4, 5]
    history = events(ckpt)
    assert [e for e in history if e["event"] == "trigger" and e["action"] == "stop"], history
    assert not [e for e in history if e["event"] in ("restart", "checkpoint")], history
    assert history[-1]["event"] == "exit" and history[-1]["reason"] == "finished", history
    assert (workdir / "out.txt").read_text().split()[:2] == loop_reference(workdir, 5)


@needs_dmtcp
def test_a_command_that_exits_0_on_our_sigterm_is_not_taken_for_finished(workdir: Path):
    # No image can be taken, so procckpt sends SIGTERM after the grace; the command's own
    # handler exits 0. That exit was asked for: the run must not be marked complete.
    ckpt = workdir / "ckpt"
    result = procckpt_run(workdir, ckpt, ["--time-limit", "6s", "--grace", "3s",
                                          "--max-restarts", "0"],
                          [*LOOP, "--steps", "3", "--out", "out.txt", "--hold-unsaveable"])
    assert result.returncode != 0, result.stderr[-3000:]
    history = events(ckpt)
    assert [e for e in history if e["event"] == "unconfirmed"], history
    assert history[-1]["event"] == "exit" and history[-1]["reason"] != "finished", history
    assert not (ckpt / "COMPLETE").exists() and "training finished" not in result.stderr


def interrupted_twice(workdir: Path, ckpt: Path) -> subprocess.CompletedProcess[str]:
    """Two cycles, two images (ckpt-1, ckpt-2), then the restart budget ends the run (75)."""
    result = procckpt_run(workdir, ckpt, ["--time-limit", "8s", "--grace", "3s",
                                          "--max-restarts", "1"],
                          [*LOOP, "--steps", "300", "--out", "out.txt"])
    assert result.returncode == 75, result.stderr[-3000:]
    names = sorted(p.name for p in (ckpt / "checkpoints").glob("ckpt-*"))
    assert names == ["ckpt-00000001", "ckpt-00000002"], names
    return result


def newest_image(ckpt: Path) -> tuple[Path, dict]:
    directory = ckpt / "checkpoints" / "ckpt-00000002"
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    return directory / manifest["dmtcp"]["images"][0], manifest


@pytest.mark.parametrize("damage", ["truncated", "unrestorable", "hanging"])
@needs_dmtcp
def test_a_bad_newest_image_falls_back_to_the_previous_one(workdir: Path, damage: str):
    ckpt = workdir / "ckpt"
    first = interrupted_twice(workdir, ckpt)
    image, manifest = newest_image(ckpt)
    if damage == "truncated":
        # What a disk that lost the end of the file leaves: the checksum catches it (a
        # truncated image would make mtcp_restart spin forever).
        os.truncate(image, image.stat().st_size // 2)
    else:
        # An image that is intact on disk but cannot be restored (another DMTCP's, a changed
        # system): dmtcp_restart fails at once ("unrestorable"), or its restore never ends (a
        # cut image: mtcp_restart spins). The manifest is updated so that the checksum passes.
        if damage == "unrestorable":
            image.write_bytes(os.urandom(image.stat().st_size))
        else:
            os.truncate(image, image.stat().st_size // 2)
        crc, size = file_crc32(image)
        manifest["files"][image.name] = {"bytes": size, "crc32": crc}
        (image.parent / "MANIFEST.json").write_text(json.dumps(manifest))

    result = procckpt_run(workdir, ckpt, [], [*LOOP, "--steps", "300", "--out", "out.txt"],
                          env={"PROCCKPT_DMTCP_RESTORE_TIMEOUT": "8s"})
    assert result.returncode == 0, result.stderr[-3000:]
    if damage == "truncated":
        assert "checkpoint ckpt-00000002 is unusable" in result.stderr
        assert (ckpt / "checkpoints" / "ckpt-00000002.corrupt").is_dir()
    else:
        why = ("dmtcp_restart exited with 99" if damage == "unrestorable" else
               "the restore did not finish within 8s")
        assert (f"restarting from ckpt-00000002 failed ({why}); falling back to the previous "
                "image, ckpt-00000001") in result.stderr
        kinds = [e["event"] for e in events(ckpt)]
        assert "restore-failed" in kinds and "fallback" in kinds
    resumed = [e["checkpoint"] for e in events(ckpt) if e["event"] == "resume"]
    assert resumed[-1] == "ckpt-00000001"
    # Resumed from the first image: its steps continue what the first cycle printed.
    before, after = steps(first.stdout), steps(result.stdout)
    assert 1 < after[0] < before[-1] and after == list(range(after[0], 301))
    assert (workdir / "out.txt").read_text().split()[:2] == loop_reference(workdir, 300)


def test_engine_dmtcp_without_dmtcp_says_how_to_get_it(workdir: Path):
    bare_path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    if shutil.which("dmtcp_launch", path=bare_path):
        pytest.skip("dmtcp_launch is installed in /usr/bin or /bin: cannot hide it")
    result = run([*procckpt_argv(), "run", "--engine", "dmtcp", "--", *LOOP, "--out", "x"],
                 cwd=workdir, env={"PATH": bare_path})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("procckpt: error: --engine dmtcp needs DMTCP")
    assert "module load dmtcp" in lines[0]


def test_auto_keeps_a_script_that_imports_procckpt_on_hooks(workdir: Path):
    """(The Checkpointer scripts of the other end-to-end tests run under auto as well.)"""
    (workdir / "train.py").write_text("import procckpt\nprint('trained', flush=True)\n")
    result = run([*procckpt_argv(), "run", "--dir", "ckpt", "--", PYTHON, "train.py"],
                 cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "procckpt: engine: hooks (train.py imports procckpt)" in result.stderr
    assert "trained" in result.stdout


@needs_dmtcp
def test_auto_reads_through_an_inline_shell_to_the_script(workdir: Path):
    (workdir / "run").mkdir()
    (workdir / "run" / "train.py").write_text("import procckpt\nprint('trained', flush=True)\n")
    result = run([*procckpt_argv(), "run", "--dir", "ckpt", "--", "sh", "-c",
                  f"cd run && OMP_NUM_THREADS=1 exec {PYTHON} train.py"], cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "procckpt: engine: hooks (train.py imports procckpt)" in result.stderr
    assert "trained" in result.stdout


@needs_dmtcp
def test_a_checkpointer_under_the_dmtcp_engine_says_to_use_hooks(workdir: Path):
    result = procckpt_run(workdir, workdir / "ckpt", ["--engine", "dmtcp", "--time-limit", "60s"],
                          [PYTHON, str(PROGRAMS / "tiny_train.py")], timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "procckpt run is checkpointing it with DMTCP" in result.stderr
    assert "run it with --engine hooks" in result.stderr
    assert "step " not in result.stdout  # refused before training, not part-way


@needs_dmtcp
def test_benchmark_prints_the_write_ratio(workdir: Path):
    result = run([PYTHON, str(REPO / "benchmarks" / "dmtcp_images.py"), "--mb", "8",
                  "--reps", "1",
                  "--dir", str(workdir)], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    ratio = re.search(r"^ratio image write / raw write: +(\d+\.\d+)x$", result.stdout, re.M)
    assert ratio and float(ratio.group(1)) > 0, result.stdout
    assert not list(workdir.iterdir()), "the benchmark left files behind"
