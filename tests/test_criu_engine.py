"""The CRIU engine's bookkeeping around its dumps: one image at a time, a stop that comes
during a running image gets an image of its own after it (never the running one: the tree
goes on past it), and a dump that fails makes the engine stuck (a stop whose image failed
ends the run in one line). The dump itself is a seam here; tests/e2e/test_criu.py runs CRIU."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from procckpt.launcher.engines import Confirmation
from procckpt.launcher.engines.criu import CriuEngine, CriuTools
from procckpt.launcher.engines.criu.engine import _Job
from procckpt.store import CheckpointStore

from .harness.processes import events

pytestmark = pytest.mark.unit


def _engine(tmp_path: Path, dump) -> CriuEngine:
    engine = CriuEngine(CheckpointStore(tmp_path / "ckpt").open(), CriuTools("criu", (4, 2)))
    engine.start_cycle(["python", "train.py"], "token")
    engine._dump = dump  # type: ignore[method-assign]
    return engine


def _confirmed(engine: CriuEngine, seq: int) -> Confirmation:
    deadline = time.monotonic() + 10
    while (c := engine.confirmation(seq)) is None:
        assert time.monotonic() < deadline, "no confirmation"
        time.sleep(0.01)
    return c


def test_a_stop_during_a_running_image_gets_its_own_image_after_it(tmp_path: Path):
    release = threading.Event()
    taken: list[tuple[str, bool]] = []

    def dump(job):
        if not job.stop:
            release.wait(10)
        taken.append((job.reason, job.stop))
        return Confirmation(f"ckpt-{job.seq}", None, job.stop, job.seq)

    engine = _engine(tmp_path, dump)
    periodic = engine.request("checkpoint", "interval")
    assert engine.request("checkpoint", "interval") == periodic  # shares the running one
    started = time.monotonic()
    stop = engine.request("stop", "deadline")
    assert time.monotonic() - started < 1  # (the supervisor's loop is not held up)
    assert stop != periodic and engine.confirmation(stop) is None
    release.set()
    c = _confirmed(engine, stop)
    assert c.stopping and c.checkpoint == f"ckpt-{stop}"
    assert taken == [("interval", False), ("deadline", True)]
    assert engine.stuck is None


def test_a_dump_that_fails_makes_the_engine_stuck(tmp_path: Path):
    def dump(job):
        return Confirmation(None, None, job.stop, job.seq,
                            "criu dump failed: Error (criu/sk-inet.c): Connected TCP socket")

    engine = _engine(tmp_path, dump)
    c = _confirmed(engine, engine.request("stop", "deadline"))
    assert c.checkpoint is None
    assert engine.stuck == ("CRIU cannot image this command: Error (criu/sk-inet.c): "
                            "Connected TCP socket")


def test_no_image_while_nothing_runs_is_not_stuck(tmp_path: Path):
    engine = CriuEngine(CheckpointStore(tmp_path / "ckpt").open(), CriuTools("criu", (4, 2)))
    engine.start_cycle(["python", "train.py"], "token")
    c = _confirmed(engine, engine.request("checkpoint", "interval"))
    assert c.checkpoint is None and c.error == "the command is not running"
    assert engine.stuck is None


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A function of a stand-in criu's script (after the lines that find ROOT, IMAGES and
    WORK in its arguments) and a shell TREE: the engine that uses that criu, with TREE
    started behind a keeper (host pids) and its ``processes`` below the keeper running."""
    monkeypatch.setenv("PROCCKPT_CRIU_PID_NAMESPACE", "0")
    keepers: list[subprocess.Popen[bytes]] = []

    def start(script: str, tree: str, processes: int) -> CriuEngine:
        criu = tmp_path / "criu"
        criu.write_text("#!/bin/sh\n"
                        "while [ \"$1\" != -t ]; do shift; done; root=$2\n"
                        "while [ \"$1\" != -D ]; do shift; done; images=$2\n"
                        "while [ \"$1\" != -W ]; do shift; done; work=$2\n" + script)
        criu.chmod(0o755)
        keeper = subprocess.Popen(["sh", "-c", f"sh -c '{tree}' & wait"])
        keepers.append(keeper)
        engine = CriuEngine(CheckpointStore(tmp_path / "ckpt").open(),
                            CriuTools(str(criu), (4, 2)))
        engine.start_cycle(["python", "train.py"], "token")
        engine.child_started(keeper.pid)
        deadline = time.monotonic() + 10
        while len(psutil.Process(keeper.pid).children(recursive=True)) < processes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return engine

    yield start
    for keeper in keepers:
        keeper.kill()
        keeper.wait()


@pytest.mark.parametrize("exits", ["later", "at once"])
def test_a_dump_cut_short_by_a_crash_in_the_tree_does_not_make_the_engine_stuck(stand_in,
                                                                                exits: str):
    """The OOM killer takes a process of the tree while CRIU dumps it: the image fails, but
    the command is no less imageable (its restart must go on from the last image), so the
    engine is not stuck. The dump is real code here, with a stand-in for criu that does what
    the kernel did: a process of the tree killed, CRIU's error (as seen in CI), exit 1; or
    exit 1 first, the process gone a moment later (CRIU gives up on the SIGCHLD of a process
    it seized, which is not gone yet: a CI run's SIGKILLed training)."""
    kill = "pkill -KILL -P \"$root\"; sleep 0.2" if exits == "later" else \
        "(sleep 0.3; pkill -KILL -P \"$root\") >/dev/null 2>&1 &"
    engine = stand_in(f"{kill}\n"
                      "echo 'Error (criu/parasite-syscall.c:87): si_code=2 si_pid=1 "
                      "si_status=9' > \"$work/dump.log\"\nexit 1\n", "sleep 60 & wait", 2)
    c = _confirmed(engine, engine.request("checkpoint", "interval"))
    assert c.checkpoint is None and c.error is not None
    assert c.error.startswith("pid ") and "ended during the image" in c.error, c.error
    assert engine.stuck is None


def test_a_stop_whose_dump_met_a_worker_ending_is_imaged_again(
        stand_in, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A DataLoader worker exits at an epoch's end while CRIU seizes the tree for the stop's
    image ("Zombies with threads are not supported", a CI run): the stop is imaged again once
    the tree settled, rather than losing the work since the last image. The stand-in criu
    ends a process of the real tree and fails the first time, and writes an image the next."""
    tries = tmp_path / "tries"
    engine = stand_in(f"echo x >> {tries}\n"
                      f"if [ $(wc -l < {tries}) = 1 ]; then\n"
                      "  pkill -KILL -n -P \"$root\"; sleep 0.2\n"
                      "  echo 'Error (criu/seize.c:882): Zombies with threads are not "
                      "supported' > \"$work/dump.log\"; exit 1\n"
                      "fi\n"
                      "echo image > \"$images/core-1.img\"\n",
                      "sleep 60 & sleep 60 & wait", 3)
    with caplog.at_level("WARNING"):
        c = _confirmed(engine, engine.request("stop", "deadline"))
    assert c.checkpoint is not None and c.stopping, c.error
    assert tries.read_text().count("x") == 2
    assert [info.name for info in engine.store.checkpoints()] == [c.checkpoint]
    assert "ended during the image" in caplog.text and "taking it again" in caplog.text
    assert engine.stuck is None


def _restored(tmp_path: Path, ran_for: float | None) -> tuple[CriuEngine, str]:
    """A cycle restored from the newest of two CRIU images, its tree's root back ``ran_for``
    seconds ago (None: CRIU never brought it back); the newest image's name."""
    engine = CriuEngine(CheckpointStore(tmp_path / "ckpt").open(), CriuTools("criu", (4, 2)))
    for _ in range(2):
        with engine.store.begin({"engine": "criu"}) as pending:
            with pending.open("pages-1.img") as f:
                f.write(b"\0" * 100)
            newest = pending.commit().name
    engine.start_cycle(["python", "train.py"], "token")
    assert engine._cycle is not None and engine._cycle.restored_from is not None
    assert engine._cycle.restored_from.name == newest
    if ran_for is not None:
        root_pid = engine.work / "root.pid"
        root_pid.write_text("4242")
        now = time.time()
        os.utime(root_pid, (now - ran_for, now - ran_for))
    return engine, newest


def test_a_restored_tree_that_faults_at_once_falls_back_to_the_image_before(tmp_path: Path):
    engine, newest = _restored(tmp_path, ran_for=2.6)
    said = engine.after_exit(128 + signal.SIGSEGV, requested=False)
    assert said is not None and said.startswith(
        f"restoring {newest} failed (the restored tree was killed by SIGSEGV 3s after CRIU "
        "restored it"), said
    assert said.endswith("falling back to the previous image, ckpt-00000001"), said
    assert engine._newest_image().name != newest
    (failed,) = events(engine.store.root, "restore-failed")
    assert failed["checkpoint"] == newest and failed["exit_code"] == 139


@pytest.mark.parametrize("case", ["later", "own image asked", "not a fault", "signalled"])
def test_other_ends_of_a_restored_tree_are_the_supervisors_to_judge(tmp_path: Path,
                                                                    case: str):
    engine, newest = _restored(tmp_path, ran_for=45.0 if case == "later" else 2.0)
    if case == "own image asked":
        engine._job = _Job(1, "interval", stop=False)
    code = 128 + (signal.SIGKILL if case == "not a fault" else signal.SIGSEGV)
    assert engine.after_exit(code, requested=False, signalled=case == "signalled") is None
    assert engine._newest_image().name == newest
    assert not events(engine.store.root, "restore-failed")


def test_a_restore_that_never_brought_the_tree_back_is_tried_once_more_first(tmp_path: Path):
    engine, newest = _restored(tmp_path, ran_for=None)
    said = engine.after_exit(75, requested=False)
    assert said == f"restoring {newest} failed; trying it once more"
    assert engine._newest_image().name == newest
