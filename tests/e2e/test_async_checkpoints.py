"""Background (async) checkpoints end to end: real processes, real signals, real files.

The training program is tests/harness/programs/async_train.py. Where a test must act while a write
is in flight, the program slows its own writes down (``--write-pause``): the write is real,
only longer. About 60 s in all, most of it interpreter and torch start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from procckpt.protocol.control import ControlChannel
from procckpt.protocol.events import read_events
from procckpt.store import CheckpointStore

from ..conftest import PROGRAMS
from ..harness.processes import wait_for

PROGRAM = PROGRAMS / "async_train.py"
#: Settings that make each background write take a couple of seconds.
SLOW = ["--width", "2048", "--chunk", "16384", "--write-pause", "0.08"]
EX_TEMPFAIL = 75


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PROCCKPT_")}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["PROCCKPT_LOG_LEVEL"] = "INFO"
    e.update(extra)
    return e


def program(*args: str) -> list[str]:
    return [sys.executable, str(PROGRAM), *args]


def partial_write(store: CheckpointStore) -> Path | None:
    """A checkpoint being written: a temporary dir whose payload has some bytes already."""
    if not store.ckpt_root.is_dir():
        return None
    for tmp in store.ckpt_root.glob(".tmp-ckpt-*"):
        payload = tmp / "state.pt"
        try:
            if payload.stat().st_size > 0:
                return tmp
        except FileNotFoundError:
            continue
    return None


def checkpoint_events(d: Path) -> list[dict[str, object]]:
    return [e for e in read_events(d / "events.jsonl") if e["event"] == "checkpoint"]


def assert_all_valid(store: CheckpointStore) -> list[int]:
    steps = []
    for info in store.checkpoints():
        assert store.verify(info.path) is None, info.name
        payload = torch.load(info.file("state.pt"), weights_only=True)
        steps.append(payload["progress"]["step"])
    return steps


def test_resume_after_sigkill_is_bit_identical(tmp_path: Path) -> None:
    common = ["--epochs", "3", "--samples", "160"]
    ref = subprocess.run(program(*common, "--dir", str(tmp_path / "ref"), "--out",
                                 str(tmp_path / "ref.pt")), env=env(), timeout=120,
                         capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr

    d = tmp_path / "run"
    args = program(*common, "--dir", str(d), "--out", str(tmp_path / "out.pt"),
                   "--interval", "0.05", "--step-sleep", "0.03")
    proc = subprocess.Popen(args, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for("three background checkpoints", lambda: len(checkpoint_events(d)) >= 3, proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert all(e.get("background") for e in checkpoint_events(d))

    again = subprocess.run(args, env=env(), timeout=120, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    start = int(again.stdout.split("start step ")[1].split()[0])
    assert start >= 3, "the second run did not resume"
    assert CheckpointStore(d).completion() is not None
    expected = torch.load(tmp_path / "ref.pt", weights_only=True)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key


def test_sigkill_during_a_background_write_leaves_no_loadable_partial(tmp_path: Path) -> None:
    d = tmp_path / "run"
    store = CheckpointStore(d)
    args = program("--dir", str(d), "--epochs", "20", "--interval", "0.2", "--step-sleep",
                   "0.05", *SLOW)
    proc = subprocess.Popen(args, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for("a first durable checkpoint", lambda: checkpoint_events(d), proc=proc)
    tmp = wait_for("a second write in flight", lambda: partial_write(store), proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)

    assert isinstance(tmp, Path) and tmp.exists()  # the half-written one is still there...
    listed = [i.path for i in store.checkpoints()]
    assert tmp not in listed and listed  # ...but it is not a checkpoint
    steps = assert_all_valid(store)

    again = subprocess.run(program("--dir", str(d), "--epochs", "0", "--width", "2048"),
                           env=env(), timeout=120,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"start step {max(steps)}" in again.stdout
    assert not tmp.exists(), "the next start cleans up the unfinished write"


def test_a_stop_request_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    d = tmp_path / "run"
    store = CheckpointStore(d)
    token = "t0ken"
    proc = subprocess.Popen(program("--dir", str(d), "--epochs", "20", "--step-sleep", "0.05",
                                    *SLOW),
                            env=env(PROCCKPT_TOKEN=token, PROCCKPT_DIR=str(d)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    channel = ControlChannel(d / "control", token)
    wait_for("the program's hello", channel.hello, proc=proc)
    channel.send(1, "checkpoint", "test")
    wait_for("the write in flight", lambda: partial_write(store), proc=proc)
    channel.send(2, "stop", "test")

    acks = []
    while proc.poll() is None:
        ack = channel.read_ack()
        if ack is not None and (not acks or acks[-1] != ack):
            acks.append(ack)
            # An ack is written only once its checkpoint is durable and in place.
            assert ack.checkpoint and (store.ckpt_root / ack.checkpoint / "MANIFEST.json").exists()
        time.sleep(0.01)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == EX_TEMPFAIL, err

    final = channel.read_ack()
    assert final is not None and final.seq == 2 and final.stopping
    assert [a.seq for a in acks if a.seq == 1], "the checkpoint request was acknowledged"
    first = next(a for a in acks if a.seq == 1)
    assert first.checkpoint != final.checkpoint
    newest = store.checkpoints()[0]
    assert newest.name == final.checkpoint and newest.step is not None
    assert first.step is not None and newest.step >= first.step  # resume takes the latest
    assert assert_all_valid(store)
    events = checkpoint_events(d)
    names = [e["checkpoint"] for e in events]
    assert names.index(first.checkpoint) < names.index(final.checkpoint)
    assert events[names.index(first.checkpoint)].get("background") is True
    assert events[names.index(final.checkpoint)].get("background") is None  # stop: sync


def test_launcher_stop_during_a_background_write(tmp_path: Path) -> None:
    d = tmp_path / "run"
    store = CheckpointStore(d)
    proc = subprocess.Popen(["procckpt", "run", "--dir", str(d), "--interval", "1s", "--",
                             *program("--dir", str(d), "--epochs", "50", "--step-sleep", "0.05",
                                      *SLOW)],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for("a background write in flight", lambda: partial_write(store), proc=proc)
    in_flight = len(checkpoint_events(d)) + 1
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EX_TEMPFAIL, err
    events = list(read_events(d / "events.jsonl"))
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert len(saved) >= in_flight + 1, "the write in flight and the stop's checkpoint"
    confirmed = [e for e in events if e["event"] == "confirmed"]
    assert confirmed and confirmed[-1]["checkpoint"] == saved[-1]["checkpoint"]
    assert saved[in_flight - 1].get("background") is True
    assert assert_all_valid(store)


def test_interpreter_exit_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    d = tmp_path / "run"
    crashed = subprocess.run(program("--dir", str(d), "--interval", "1e-9", "--crash-at", "5",
                                     *SLOW), env=env(), timeout=120, capture_output=True,
                             text=True)
    assert crashed.returncode == 1 and "crash at step 5" in crashed.stderr
    # Every safe point started a write; the one after step 4 was in flight when the script
    # raised. The interpreter waited for the (non-daemon) writer thread before exiting.
    assert assert_all_valid(CheckpointStore(d))[0] == 4
    assert json.loads(json.dumps(checkpoint_events(d)[-1]))["step"] == 4
