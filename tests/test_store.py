"""The checkpoint directory: atomic commits, verification, fallback, keep-N, lock, ownership."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procckpt.errors import CheckpointCorruptError, LockedError, StoreError
from procckpt.protocol.events import append_event
from procckpt.store import MARKER, CheckpointStore

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def commit(store: CheckpointStore, payload: bytes, **meta) -> str:
    with store.begin(meta) as pending:
        with pending.open("state.pt") as f:
            f.write(payload)
        return pending.commit().name


def test_commit_writes_manifest_and_leaves_no_temporaries(tmp_path: Path):
    store = CheckpointStore(tmp_path / "d").open()
    name = commit(store, b"x" * 1000, step=5)
    info = store.newest_for_resume()
    assert info is not None and info.name == name and info.step == 5 and info.nbytes == 1000
    manifest = json.loads((info.path / "MANIFEST.json").read_text())
    assert manifest["files"]["state.pt"]["bytes"] == 1000
    assert not [p for p in store.ckpt_root.iterdir() if p.name.startswith(".tmp")]


def test_abandoned_checkpoint_is_not_visible_and_is_cleaned(tmp_path: Path):
    store = CheckpointStore(tmp_path / "d").open()
    commit(store, b"a", step=1)
    pending = store.begin({"step": 2})
    with pending.open("state.pt") as f:
        f.write(b"b" * 10)
    # no commit: as if the process died here
    assert store.newest_for_resume().step == 1
    assert store.clean_temporaries()
    assert not any(p.name.startswith(".tmp") for p in store.ckpt_root.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "zero", "bitflip", "manifest", "missing"])
def test_damaged_newest_falls_back_to_previous_loudly(tmp_path: Path, damage: str, caplog):
    store = CheckpointStore(tmp_path / "d", journal=append_event).open()
    commit(store, os.urandom(5000), step=1)
    newest = commit(store, os.urandom(5000), step=2)
    target = store.ckpt_root / newest / "state.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:1234])
    elif damage == "zero":
        target.write_bytes(b"")
    elif damage == "bitflip":
        data = bytearray(target.read_bytes())
        data[2500] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "manifest":
        (target.parent / "MANIFEST.json").write_text("{not json")
    else:
        target.unlink()
    with caplog.at_level("WARNING"):
        info = store.newest_for_resume()
    assert info is not None and info.step == 1
    assert f"checkpoint {newest} is unusable" in caplog.text
    assert (store.ckpt_root / f"{newest}.corrupt").is_dir()  # kept for inspection
    events = [json.loads(line) for line in store.events_path.read_text().splitlines()]
    assert any(e["event"] == "corrupt" and e["checkpoint"] == newest for e in events)


def test_all_damaged_refuses_to_start_from_scratch(tmp_path: Path):
    store = CheckpointStore(tmp_path / "d").open()
    name = commit(store, b"abc", step=1)
    (store.ckpt_root / name / "state.pt").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="refusing to start from scratch"):
        store.newest_for_resume()


def test_prune_keeps_last_n_and_the_best(tmp_path: Path):
    store = CheckpointStore(tmp_path / "d", keep=2).open()
    for step, metric in enumerate([0.5, 0.9, 0.6, 0.7, 0.65], start=1):
        commit(store, b"x", step=step, metric=metric, metric_mode="max")
        store.prune()
    steps = sorted(i.step for i in store.checkpoints())
    assert steps == [2, 4, 5]  # the best (0.9 at step 2) plus the two newest


def test_foreign_directory_is_refused(tmp_path: Path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(StoreError, match="not a procckpt checkpoint dir.*thesis.tex"):
        CheckpointStore(foreign).open()
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_a_dir_that_another_procckpt_is_creating_is_opened_too(tmp_path: Path):
    # The pods of a run on several nodes start together: one finds the dir half made by the
    # other (its subdirs, its marker not yet renamed into place).
    import multiprocessing

    half = tmp_path / "half"
    for sub in ("checkpoints", "control"):
        (half / sub).mkdir(parents=True)
    (half / ".tmp-.procckpt-4242-0a1b2c3d").write_bytes(b"")
    assert CheckpointStore(half).open().checkpoints() == []
    # And for real: processes opening one new dir at once all succeed.
    new = tmp_path / "new"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        assert pool.map(_open_store, [str(new)] * 8) == ["ok"] * 8


def test_a_marker_that_comes_while_the_dir_is_looked_at_is_ours(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    # The race CI met between two pods: the marker was not there when looked for, and there,
    # with the lock and the journal of the launcher that made it, when the entries were listed.
    made = CheckpointStore(tmp_path / "made").open()
    racing = tmp_path / "racing"
    for sub in ("checkpoints", "control"):
        (racing / sub).mkdir(parents=True)
    listed = Path.iterdir

    def iterdir(self: Path):
        if self == racing and not (racing / MARKER).exists():  # the other launcher, meanwhile
            (racing / MARKER).write_bytes((made.root / MARKER).read_bytes())
            (racing / "lock").write_text("")
            (racing / "events.jsonl").write_text("")
        return listed(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert CheckpointStore(racing).open().checkpoints() == []


def _open_store(path: str) -> str:
    try:
        CheckpointStore(path).open()
    except StoreError as e:
        return str(e)
    return "ok"


def test_the_leaders_cleaning_spares_the_writes_of_launchers_starting_beside_it(tmp_path: Path):
    # Node 0's launcher removes what a crash left half-written while node 1's, which holds no
    # lock, opens the dir and beats in control/: its files in flight must not vanish.
    import multiprocessing
    import threading

    root = tmp_path / "d"
    store = CheckpointStore(root).open()
    stop = threading.Event()

    def clean() -> None:
        while not stop.is_set():
            store.clean_temporaries()

    cleaner = threading.Thread(target=clean)
    cleaner.start()
    try:
        with multiprocessing.get_context("spawn").Pool(4) as pool:
            assert pool.map(_open_and_beat, [str(root)] * 8) == ["ok"] * 8
    finally:
        stop.set()
        cleaner.join()
    # What a crash left goes: in checkpoints/ at once, elsewhere once it is a minute old.
    old = time.time() - 120
    for where in (root, store.control_dir, store.ckpt_root):
        for age in ("new", "old"):
            (where / f".tmp-{age}-4242-0a1b2c3d").write_bytes(b"x")
            if age == "old":
                os.utime(where / f".tmp-{age}-4242-0a1b2c3d", (old, old))
    store.clean_temporaries()
    left = sorted(str(p.relative_to(root)) for p in root.rglob(".tmp-*"))
    assert left == [".tmp-new-4242-0a1b2c3d", "control/.tmp-new-4242-0a1b2c3d"]


def _open_and_beat(path: str) -> str:
    from procckpt.protocol.control import write_json

    try:
        store = CheckpointStore(path).open()
        for i in range(100):
            write_json(store.control_dir, f"node-{os.getpid()}.json", {"beat": i},
                       durable=False)
    except (StoreError, OSError) as e:
        return str(e)
    return "ok"


def test_unusable_paths(tmp_path: Path):
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(StoreError, match="is a file"):
        CheckpointStore(afile).open()
    with pytest.raises(StoreError):
        CheckpointStore(afile / "sub").open()
    with pytest.raises(StoreError):
        CheckpointStore("/proc/procckpt-test").open()


def test_lock_held_by_live_process_is_refused_and_dead_one_taken_over(tmp_path: Path, caplog):
    store = CheckpointStore(tmp_path / "d").open()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from procckpt.store import CheckpointStore as S; "
         "l = S(sys.argv[1]).open().lock(); print('locked', flush=True); time.sleep(60)",
         str(store.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError, match=f"pid {holder.pid}"):
            store.lock()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without cleaning up: its lock file is still there, naming it.
    assert json.loads((store.root / "lock").read_text())["pid"] == holder.pid
    lock = store.lock()
    assert json.loads((store.root / "lock").read_text())["pid"] == os.getpid()
    # Taken over in one line that names whose it was.
    (line,) = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert f"pid {holder.pid} on " in line and "ended without releasing it" in line, line
    lock.release()
    caplog.clear()
    store.lock().release()  # released cleanly before: nothing to say
    assert "taking over" not in caplog.text


def test_another_user_cannot_block_the_lock_and_a_refusal_names_the_real_holder(caplog):
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user (nobody)")
    top = Path(tempfile.mkdtemp(prefix="procckpt-lock-", dir="/tmp"))  # reachable by nobody
    try:
        top.chmod(0o755)
        store = CheckpointStore(top / "d").open()
        store.root.chmod(0o755)
        store.lock().release()
        assert (store.root / "lock").stat().st_mode & 0o777 == 0o600
        # A user who could read the lock file could flock it and block every run: not so.
        flock = shutil.which("flock")
        if flock is None:
            pytest.skip("needs util-linux's flock(1) to lock as another user")
        blocker = subprocess.run([flock, "--nonblock", str(store.root / "lock"), "true"],
                                 user=65534, capture_output=True, text=True)
        assert blocker.returncode != 0 and "Permission denied" in blocker.stderr, blocker
        # A process that holds the flock without writing its note is the one named.
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); "
             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
             str(store.root / "lock")], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(LockedError, match=f"in use by pid {holder.pid} [(]"):
                store.lock()
        finally:
            holder.kill()
            holder.wait()
    finally:
        shutil.rmtree(top, ignore_errors=True)
