"""SIGKILL of the training process at random moments during saves never leaves a partial
checkpoint that the next start would load; with the state in chunks (a frozen parameter that
changes at every save: a new chunk written, the old one collected, each time), never a
checkpoint whose chunk is missing, and nothing left over once the next start collects."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from procckpt.store import CheckpointStore
from procckpt.training.state.payload import read_payload

from .conftest import PROGRAMS, PYTHON

ROUNDS = 60


@pytest.mark.parametrize("kind", ["file", "frozen"])
def test_sigkill_at_random_moments_during_saves(tmp_path: Path, kind: str):
    directory = tmp_path / "ckpt"
    zygote = subprocess.Popen([PYTHON, str(PROGRAMS / "save_zygote.py"), str(directory), kind],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rng = random.Random(1234)
    hit_mid_save = 0
    last_step = 0
    try:
        for _ in range(ROUNDS):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline().split()[1])
            ready = zygote.stdout.readline().strip()
            assert ready == "ready", f"the training process failed to resume: {ready!r}"
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write("reap\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline().split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"the training process ended with status {status} before it was killed")

            store = CheckpointStore(directory)
            if any(p.name.startswith(".tmp-") for p in store.ckpt_root.iterdir()):
                hit_mid_save += 1
            info = store.newest_for_resume()  # what the next start resumes from
            if info is None:
                continue
            state = read_payload(info)  # with its chunks, each checked against its hash
            saved = state["statefuls"]["holder"]
            assert info.step == saved["step"] == state["progress"]["step"]
            assert torch.all(saved["w"] == saved["step"]), "a torn checkpoint was loadable"
            assert saved["step"] >= last_step, "the newest checkpoint went backwards"
            last_step = saved["step"]
            assert not list(store.ckpt_root.glob("*.corrupt")), "a kill made a checkpoint corrupt"
        if kind == "frozen":  # the next start's collection leaves what kept ones list
            store = CheckpointStore(directory)
            store.clean_temporaries()
            store.prune()
            listed = set().union(*(i.chunks for i in store.checkpoints()))
            assert {cid for cid, _ in store.chunks.stored()} == listed and listed
            assert not list(store.chunks.root.glob(".tmp-*"))
    finally:
        zygote.kill()
        zygote.wait()
    assert last_step > ROUNDS, "the children did not get to save"
    # Most kills must land inside a save, or this test would not test what it claims.
    assert hit_mid_save >= ROUNDS // 2, f"only {hit_mid_save} of {ROUNDS} kills hit a save"
