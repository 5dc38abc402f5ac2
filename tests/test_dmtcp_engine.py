"""The DMTCP engine's pieces that need no DMTCP: finding it, reading what it wrote, choosing
the image to restart from. tests/e2e/test_dmtcp.py runs the engine with the real DMTCP."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from procckpt.errors import UsageError
from procckpt.launcher.child import Child
from procckpt.launcher.engines import Confirmation
from procckpt.launcher.engines.dmtcp import (
    CKPT_SIGNAL,
    DmtcpEngine,
    DmtcpError,
    DmtcpTools,
    clean_env,
    find_dmtcp,
    forks,
    saved_files,
)
from procckpt.launcher.engines.dmtcp import engine as dmtcp_engine
from procckpt.launcher.engines.dmtcp.coordinator import Coordinator
from procckpt.launcher.engines.dmtcp.cycle import Cycle, Job
from procckpt.launcher.engines.dmtcp.forks import own_processes
from procckpt.protocol.events import read_events
from procckpt.store import CheckpointInfo, CheckpointStore

from .harness.processes import events, wait_for

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

TOOLS = DmtcpTools("dmtcp_launch", "dmtcp_restart", "dmtcp_command", "dmtcp_coordinator")


def fake_tool(directory: Path, name: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_find_dmtcp_takes_all_programs_from_dmtcp_launchs_directory(tmp_path: Path):
    one, other = tmp_path / "one", tmp_path / "other"
    for name in ("dmtcp_launch", "dmtcp_restart", "dmtcp_command", "dmtcp_coordinator"):
        fake_tool(one, name)
    fake_tool(other, "dmtcp_command")  # earlier on PATH, but another installation
    tools = find_dmtcp(f"{other}{os.pathsep}{one}")
    assert tools == DmtcpTools(*(str(one / n) for n in ("dmtcp_launch", "dmtcp_restart",
                                                        "dmtcp_command", "dmtcp_coordinator")))
    assert find_dmtcp(str(other)) is None
    (one / "dmtcp_restart").unlink()
    assert find_dmtcp(str(one)) is None, "a launch without a restart is no use"


def test_checkpoint_signal_is_off_usr1_and_usr2():
    assert CKPT_SIGNAL not in (10, 12) and CKPT_SIGNAL >= 34


def test_a_users_dmtcp_settings_never_reach_our_coordinator_commands():
    env = clean_env({"DMTCP_COORD_PORT": "7779", "DMTCP_COORD_HOST": "elsewhere",
                      "DMTCP_CHECKPOINT_INTERVAL": "60", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def test_only_the_saved_files_of_this_checkpoint_are_kept(tmp_path: Path):
    files = tmp_path / "ckpt_python_1234_files"
    files.mkdir()
    (files / "fd-info.txt").write_text("gconv-modules.cache_2:/usr/lib/gconv/gconv-modules.cache\n")
    (files / "gconv-modules.cache_1").write_bytes(b"left from the restore of this cycle")
    (files / "gconv-modules.cache_2").write_bytes(b"saved for this checkpoint")
    assert [p.name for p in saved_files(files)] == ["fd-info.txt", "gconv-modules.cache_2"]
    (files / "fd-info.txt").unlink()
    assert [p.name for p in saved_files(files)] == ["gconv-modules.cache_1",
                                                     "gconv-modules.cache_2"]
    assert saved_files(tmp_path / "missing") == []


@pytest.fixture
def engine(tmp_path: Path) -> DmtcpEngine:
    store = CheckpointStore(tmp_path / "ckpt").open()
    engine = DmtcpEngine(store, TOOLS, environ={})
    engine._reset_work_dir()
    return engine


def restart_script(engine: DmtcpEngine, names: list[str], executable: bool = True) -> Path:
    script = engine.images / "dmtcp_restart_script_98ff-40000-1.sh"
    given = " ".join(str(engine.images / n) for n in names)
    script.write_text(f'#!/bin/bash\nckpt_timestamp="now"\ngiven_ckpt_files=" {given}"\n')
    mode = script.stat().st_mode
    script.chmod(mode | stat.S_IXUSR if executable else mode & ~stat.S_IXUSR)
    return script


def test_images_are_complete_once_the_restart_script_is_executable(engine: DmtcpEngine):
    (engine.images / "ckpt_a_1.dmtcp").write_bytes(b"image a")
    (engine.images / "ckpt_b_2.dmtcp").write_bytes(b"image b")
    script = restart_script(engine, ["ckpt_a_1.dmtcp", "ckpt_b_2.dmtcp"], executable=False)
    assert engine.image_dir.finished_script() is None, "still being written by the coordinator"
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert engine.image_dir.finished_script() == script
    assert engine.image_dir.image_names(script) == ["ckpt_a_1.dmtcp", "ckpt_b_2.dmtcp"]
    (engine.images / "ckpt_b_2.dmtcp").unlink()
    with pytest.raises(DmtcpError, match="missing"):
        engine.image_dir.image_names(script)


def commit(store: CheckpointStore, engine: str, name: str = "ckpt_x.dmtcp") -> str:
    meta = {"engine": engine, "dmtcp": {"images": [name], "saved_files": {}}}
    with store.begin(meta) as pending:
        with pending.open(name) as f:
            f.write(os.urandom(100))
        return pending.commit().name


def test_the_newest_intact_image_not_known_to_fail_is_restarted(engine: DmtcpEngine):
    assert engine._newest_image() is None
    first = commit(engine.store, "dmtcp")
    second = commit(engine.store, "dmtcp")
    assert engine._newest_image().name == second
    engine._failed_images.add(second)
    assert engine._newest_image().name == first
    engine._failed_images.add(first)
    assert engine._newest_image(quiet=True) is None
    with pytest.raises(DmtcpError, match="refusing to start from scratch"):
        engine._newest_image()


def test_a_hooks_checkpoint_is_not_taken_for_an_image(engine: DmtcpEngine):
    commit(engine.store, "hooks", name="state.pt")
    with pytest.raises(UsageError, match="run with --engine hooks"):
        engine._newest_image()


def test_a_new_cycle_starts_with_an_empty_image_dir(engine: DmtcpEngine):
    (engine.images / "ckpt_a_1.dmtcp.temp").write_bytes(b"half an image")
    restart_script(engine, [])
    engine.port_file.write_text("7779")
    engine._reset_work_dir()
    assert list(engine.images.iterdir()) == [] and not engine.port_file.exists()


def test_one_stalled_image_is_passing_and_two_in_a_row_are_the_failure_that_repeats():
    from procckpt.launcher.engines.dmtcp.forks import StuckImages

    stuck = StuckImages()
    assert not stuck.stalled(16.0, 2) and stuck.message is None  # a short-lived child, maybe
    stuck.completed()  # the next cycle's image was complete
    assert not stuck.stalled(16.0, 2) and stuck.message is None
    assert stuck.stalled(17.0, 2)
    assert stuck.message is not None
    assert stuck.message.startswith("DMTCP could not checkpoint the command (twice in a row no "
                                    "byte of its image written for 15s, the last 17s after")
    assert "DataLoader workers, or a child it started?" in stuck.message


def test_stalls_refusals_and_stops_that_never_began_count_together_once_per_cycle():
    from procckpt.launcher.engines.dmtcp.forks import StuckImages

    stuck = StuckImages()
    # a stop whose image stalled: killed 16 s after the request, counted once, not twice
    assert not stuck.stalled(16.0, 3)
    stuck.stop_ended(False, False, 100.0, 116.0, 3, counted=True)
    assert stuck.message is None
    # the next cycle's stop had not begun its image at the deadline (a CI run: a refused
    # image, then this, then a third cycle before the run stopped)
    stuck.stop_ended(False, False, 200.0, 206.0, 3, counted=False)
    assert stuck.message is not None and "twice in a row no byte of its image written in " \
        "the 6s from the request to the deadline" in stuck.message
    python, true = "ckpt_python3.11_98ff-40000-1.dmtcp", "ckpt_true_98ff-41000-2.dmtcp"
    worker = "ckpt_python3.11_98ff-42000-3.dmtcp"
    stuck = StuckImages()
    assert stuck.refuse([python, worker], (2, 1)) is not None and stuck.message is None
    stuck.stop_ended(False, True, 100.0, 101.0, 2, counted=True)  # the refused stop image
    stuck.completed()  # an image taken between epochs was kept
    stuck.stop_ended(False, False, 200.0, 202.0, 2, counted=False)  # too brief to tell
    assert stuck.refuse([python, worker], (3, 1)) is None  # a wrapper shell and python
    # a subprocess.run that began just after the request: another program, no copy (CI)
    assert stuck.refuse([python, true], (1, 0)) is None
    # a worker forked just after the request: two images of one program
    assert stuck.refuse([python, worker], (1, 0)) is not None and stuck.message is None
    assert stuck.refuse([python, worker], (2, 1)) is not None
    assert stuck.message is not None and "held forked copies" in stuck.message


class FakeCoordinator:
    """Answers dmtcp_command as a coordinator would: --status from a script of peer counts,
    and records what else it was sent."""

    def __init__(self, peers: list[int]) -> None:
        self.peers = peers
        self.sent: list[tuple[str, int]] = []  # (command, peers when it was sent)
        self.now = 0

    def run(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        command = argv[-1]
        if command == "--status":
            self.now = self.peers.pop(0) if len(self.peers) > 1 else self.peers[0]
            return subprocess.CompletedProcess(argv, 0, f"NUM_PEERS={self.now}\nRUNNING=yes\n", "")
        self.sent.append((command, self.now))
        return subprocess.CompletedProcess(argv, 0, "", "")


def test_a_checkpoint_request_waits_for_a_short_lived_child_to_be_gone():
    # A subprocess.run under way when the request lands: DMTCP 4.2 never wrote that image.
    fake = FakeCoordinator([1, 2, 2, 2, 1])
    coordinator = Coordinator(TOOLS, subprocess.Popen(["true"]), 1, run=fake.run)
    assert coordinator.status() == (1, True)  # the command alone, as the cycle started
    assert coordinator.checkpoint("--bcheckpoint")
    assert fake.sent == [("--bcheckpoint", 1)]
    # Processes that stay (a wrapper shell, workers) are waited for a moment only.
    fake = FakeCoordinator([1, 3])
    coordinator = Coordinator(TOOLS, subprocess.Popen(["true"]), 1, run=fake.run)
    coordinator.status()
    started = time.monotonic()
    assert coordinator.checkpoint("--kcheckpoint", child_wait=0.3)
    assert 0.3 <= time.monotonic() - started < 5 and fake.sent == [("--kcheckpoint", 3)]
    # A command that always ran two processes is never waited for.
    fake = FakeCoordinator([2])
    coordinator = Coordinator(TOOLS, subprocess.Popen(["true"]), 1, run=fake.run)
    coordinator.status()
    started = time.monotonic()
    assert coordinator.checkpoint("--bcheckpoint") and time.monotonic() - started < 0.3


#: A command that forks a copy of itself (what a DataLoader worker is), may start another
#: program, and leaves a third child unreaped; it writes READY once all are there.
FAMILY = """
import os, subprocess, sys, time
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
if {program}:
    subprocess.Popen(["sleep", "60"])
subprocess.Popen(["true"]).pid  # never waited for: a zombie once it exits
time.sleep(0.5)
open({ready!r}, "w").close()
time.sleep(60)
"""


@pytest.fixture
def family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Start a FAMILY behind procckpt's keeper, as a run starts its command; yields a function
    that takes whether it starts a program and returns the keeper's pid. Every process below
    a keeper passes for one under DMTCP here (there, they map its library)."""
    started: list[Child] = []
    monkeypatch.setattr(forks, "_under_dmtcp",
                        lambda pid: pid not in [child.pid for child in started])

    def start(program: bool) -> int:
        ready = tmp_path / f"ready-{len(started)}"
        child = Child([sys.executable, "-c", FAMILY.format(program=program, ready=str(ready))],
                      os.environ)
        child.start()
        started.append(child)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        return child.pid

    yield start
    for child in started:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)


def test_own_processes_tells_forked_copies_from_programs_the_command_started(family):
    # below the keeper: the command, sleep, the command's copy; the zombie is not counted
    assert own_processes(family(program=True)) == (3, 1)
    assert own_processes(family(program=False)) == (2, 1)


def test_a_copy_that_lives_marks_the_run_as_one_dmtcp_cannot_checkpoint(family, tmp_path: Path):
    from procckpt.launcher.engines.dmtcp.forks import CopyWatch, StuckImages

    keeper = family(program=True)
    copy = [pid for pid, is_copy, _ in forks.command_processes(keeper) if is_copy]
    assert len(copy) == 1
    stuck = StuckImages(tmp_path / "events.jsonl")
    # restored: the processes there at first are the image's, however alike they read
    watch, done = CopyWatch(), threading.Event()
    done.set()  # one sample, then back
    watch.watch(keeper, restored=True, over=done, stuck=stuck)
    time.sleep(1.1)
    assert watch.sample(keeper) is None and watch.seen is None and stuck.message is None
    # launched: a copy 1 s old (a DataLoader worker; a child between fork and exec is younger)
    over = threading.Event()
    watcher = threading.Thread(target=CopyWatch().watch, args=(keeper, False, over, stuck))
    watcher.start()
    watcher.join(timeout=30)
    over.set()
    assert not watcher.is_alive() and stuck.message is not None
    assert f"a forked copy of it, pid {copy[0]}, lived 1s and more" in stuck.message
    assert "num_workers=0" in stuck.message and "--engine hooks" in stuck.message
    assert [e["pid"] for e in read_events(tmp_path / "events.jsonl")
            if e["event"] == "forked-copy"] == copy


def test_a_copy_held_by_a_checkpoint_under_way_does_not_count(family, tmp_path: Path):
    """DMTCP suspends a child between its fork and its exec for a checkpoint (a stalled one
    for 15 s): it reads as a lasting copy then, and must not end the run (a CI failure)."""
    from procckpt.launcher.engines.dmtcp.forks import LASTING_S, CopyWatch, StuckImages

    keeper = family(program=False)
    time.sleep(LASTING_S)
    watch, done, stuck = CopyWatch(), threading.Event(), StuckImages(tmp_path / "events.jsonl")
    done.set()  # one sample, then back
    with watch.checkpointing():
        watch.watch(keeper, restored=False, over=done, stuck=stuck)
        assert watch.seen is None and stuck.message is None
    assert watch.sample(keeper) is None  # only just ended
    time.sleep(LASTING_S + 0.1)
    copy = [pid for pid, is_copy, _ in forks.command_processes(keeper) if is_copy]
    assert watch.sample(keeper) == copy[0] == watch.seen


def test_no_image_is_taken_of_a_command_with_a_copy_that_lived(engine: DmtcpEngine, family):
    engine.copies.seen = 1234  # what CopyWatch found
    refused = take(engine, family(program=False), images=1)
    assert refused.checkpoint is None and "forked copies" in refused.error
    assert engine.store.checkpoints() == [] and list(engine.images.iterdir()) == []


class ImagingCoordinator(FakeCoordinator):
    """A FakeCoordinator that, asked for a checkpoint, writes complete images of ``images``
    processes as DMTCP would."""

    def __init__(self, engine: DmtcpEngine, images: int) -> None:
        super().__init__([1])
        self.engine, self.images = engine, images

    def run(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        done = super().run(argv, **kwargs)
        if argv[-1] != "--status":
            names = [f"ckpt_python3.11_98ff-{40000 + 1000 * i}-1.dmtcp"
                     for i in range(self.images)]
            for name in names:
                (self.engine.images / name).write_bytes(os.urandom(1000))
            restart_script(self.engine, names)
        return done


def take(engine: DmtcpEngine, pid: int, images: int,
         restored_from: CheckpointInfo | None = None, fake: ImagingCoordinator | None = None,
         ) -> Confirmation:
    """One interval checkpoint of the command ``pid`` whose image holds ``images`` processes
    (restored from an image, it began to run just now)."""
    fake = fake or ImagingCoordinator(engine, images)
    with subprocess.Popen(["sleep", "60"]) as coordinator_proc:
        coordinator = Coordinator(TOOLS, coordinator_proc, 1, run=fake.run)
        engine._cycle = Cycle("token", coordinator, restored_from, pid=pid)
        engine._cycle.running_at = time.monotonic()
        engine._cycle.running.set()
        try:
            return engine._checkpoint(Job(1, "interval", stop=False))
        finally:
            coordinator_proc.kill()


class StartingCoordinator(FakeCoordinator):
    """A FakeCoordinator that, asked for a checkpoint, starts an image (a ``.temp`` file)
    for the test to write on and complete."""

    NAME = "ckpt_python3.11_98ff-40000-1.dmtcp"

    def __init__(self, engine: DmtcpEngine) -> None:
        super().__init__([1])
        self.engine = engine

    def run(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        done = super().run(argv, **kwargs)
        if argv[-1] != "--status":
            (self.engine.images / f"{self.NAME}.temp").write_bytes(b"\0" * 1000)
        return done


def test_a_stops_image_counts_as_being_written_from_its_first_bytes_to_its_commit(
        engine: DmtcpEngine, family):
    """What the watch reads once a stop's lead has passed: an image that grows is waited
    for (stopping the command then would leave none); a request not yet begun is not."""
    fake = StartingCoordinator(engine)
    with subprocess.Popen(["sleep", "60"]) as coordinator_proc:
        coordinator = Coordinator(TOOLS, coordinator_proc, 1, run=fake.run)
        engine._cycle = Cycle("token", coordinator, None, pid=family(program=False))
        engine._cycle.running.set()
        try:
            seq = engine.request("stop", "deadline")
            temp = engine.images / f"{fake.NAME}.temp"
            wait_for("the checkpoint request", lambda: fake.sent, 30)
            assert not engine.writing(seq)  # asked, not a byte written since
            with temp.open("ab") as image:
                image.write(b"\1" * 1000)
            wait_for("the image to count as being written", lambda: engine.writing(seq), 30)
            assert not engine.writing(seq + 1)  # another request's image
            temp.rename(engine.images / fake.NAME)
            restart_script(engine, [fake.NAME])
            wait_for("the confirmation", lambda: engine.confirmation(seq), 30)
            assert engine.confirmation(seq).checkpoint is not None
            assert not engine.writing(seq)  # answered: nothing left to wait for
        finally:
            engine._cycle.over_at = time.monotonic()
            engine._cycle.over.set()
            coordinator_proc.kill()


def test_an_image_holding_forked_copies_is_not_kept_and_twice_in_a_row_ends_the_run(
        engine: DmtcpEngine, family):
    # An image of the command and its worker: DMTCP 4.2 restored such images with garbage
    # batches (a CI run) or a crash in multiprocessing's resource_sharer (here).
    workers = family(program=False)
    refused = take(engine, workers, images=2)
    assert refused.checkpoint is None and "forked copies of it (DataLoader" in refused.error
    assert engine.store.checkpoints() == [] and list(engine.images.iterdir()) == []
    assert engine.stuck is None, "once may be a passing worker"
    assert take(engine, workers, images=1).checkpoint is not None  # between epochs: kept
    assert take(engine, workers, images=2).checkpoint is None and engine.stuck is None
    assert take(engine, workers, images=2).checkpoint is None
    assert engine.stuck is not None and "twice in a row its image held forked copies" in \
        engine.stuck and "num_workers=0" in engine.stuck
    refusals = events(engine.store.root, "image-refused")
    assert [(e["processes"], e["copies"]) for e in refusals] == [(2, 1)] * 3


def test_an_image_of_the_command_and_a_program_it_started_is_kept(engine: DmtcpEngine, family):
    kept = take(engine, family(program=True), images=2)  # itself and `sleep` (the copy is gone)
    assert kept.checkpoint is not None and kept.error is None
    assert engine.store.newest_intact().manifest["dmtcp"]["images"] == [
        "ckpt_python3.11_98ff-40000-1.dmtcp", "ckpt_python3.11_98ff-41000-1.dmtcp"]


def restored(engine: DmtcpEngine, ran_for: float, job: Job | None = None) -> str:
    """A cycle restored from the newest of two images, ended ``ran_for`` seconds after DMTCP
    said it runs; the newest image's name."""
    commit(engine.store, "dmtcp")
    newest = commit(engine.store, "dmtcp")
    info = engine._newest_image()
    assert info is not None and info.name == newest
    with subprocess.Popen(["sleep", "60"]) as proc:
        engine._cycle = Cycle("token", Coordinator(TOOLS, proc, 1), info, pid=proc.pid)
        proc.kill()
    engine._cycle.running.set()
    engine._cycle.running_at = 100.0
    engine._cycle.over_at = 100.0 + ran_for
    engine._job = job
    return newest


def test_a_restored_command_that_faults_at_once_falls_back_to_the_image_before(
        engine: DmtcpEngine):
    newest = restored(engine, ran_for=2.6)
    said = engine.after_exit(128 + signal.SIGSEGV, requested=False)
    assert said is not None and said.startswith(f"restarting from {newest} failed (the restored "
                                                "command was killed by SIGSEGV 3s after")
    assert engine._newest_image().name != newest
    (failed,) = events(engine.store.root, "restore-failed")
    assert failed["checkpoint"] == newest and failed["exit_code"] == 139


@pytest.mark.parametrize("case", ["later", "own image begun", "not a fault", "signalled"])
def test_other_ends_of_a_restored_command_are_the_supervisors_to_judge(engine: DmtcpEngine,
                                                                       case: str):
    job = Job(1, "interval", stop=False)
    job.wrote = case == "own image begun"
    newest = restored(engine, ran_for=45.0 if case == "later" else 2.0, job=job)
    code = 128 + (signal.SIGKILL if case == "not a fault" else signal.SIGSEGV)
    assert engine.after_exit(code, requested=False, signalled=case == "signalled") is None
    assert engine._newest_image().name == newest


def test_a_restored_command_is_imaged_once_it_ran_a_moment(engine: DmtcpEngine, family,
                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dmtcp_engine, "SETTLE_AFTER_RESTORE_S", 0.5)
    commit(engine.store, "dmtcp")
    fake = ImagingCoordinator(engine, 1)
    asked: list[float] = []
    answer = fake.run

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        if argv[-1] != "--status":
            asked.append(time.monotonic())
        return answer(argv, **kwargs)

    fake.run = run  # type: ignore[method-assign]
    kept = take(engine, family(program=False), images=1,
                restored_from=engine._newest_image(), fake=fake)
    assert kept.checkpoint is not None and kept.error is None
    assert len(asked) == 1 and asked[0] - engine._cycle.running_at >= 0.5
