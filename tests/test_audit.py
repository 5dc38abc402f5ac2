"""The first-batch audit's parts (training/audit.py): the fingerprint, and a rank's record and
comparison driven through a loader's pass with the position a Progress would hold. The whole
path, through real scripts, loaders, frameworks and procckpt run, is in
tests/e2e/test_resume_audit.py."""

from __future__ import annotations

import json
from collections import UserDict
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from procckpt.errors import UsageError
from procckpt.training.audit import BatchAudit, audit_mode, fingerprint

pytestmark = pytest.mark.unit


class Position:
    """What the audit reads of Progress: the epoch, the batches of it trained, the steps, and
    whether the pass deals the data out anew (another world size or batch size)."""

    def __init__(self, epoch: int = 0, batch: int = 0, step: int = 0,
                 remapped: bool = False) -> None:
        self.epoch, self.batch, self.step = epoch, batch, step
        self.remapped = remapped

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.batch, self.step

    def batch_done(self) -> None:
        self.batch += 1
        self.step += 1


class Refused(Exception):
    pass


def refuse(message: str) -> NoReturn:
    raise Refused(message)


def batches(n: int, offset: float = 0.0) -> list[dict[str, Any]]:
    return [{"x": torch.arange(4.0) + 10 * i + offset, "index": torch.tensor([i])}
            for i in range(n)]


def audit_for(root: Path, mode: str = "warn", group: Any = None) -> BatchAudit:
    return BatchAudit(root, 0, mode, root / "events.jsonl", refuse, group)


def events(root: Path) -> list[dict[str, Any]]:
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_and_stop(root: Path, data: list[Any], stop_after: int, ahead: int = 0) -> None:
    """A run that checkpoints after ``stop_after`` batches and exits; ``ahead``: batches its
    loader has fetched beyond the one in training (Lightning's fetcher: 1)."""
    audit, progress = audit_for(root), Position()
    it = audit.wrap(iter(data), progress)
    fetched = [next(it) for _ in range(ahead)]
    for _ in range(stop_after):
        fetched.append(next(it))
        fetched.pop(0)  # trained on
        progress.batch_done()
    audit.saved(progress.position)
    audit.before_exit()


def resume(root: Path, data: list[Any], at: int, mode: str = "warn") -> tuple[BatchAudit, Any]:
    audit, progress = audit_for(root, mode), Position(0, at, at)
    audit.resumed("ckpt-00000001", progress.position)
    first = next(audit.wrap(iter(data[at:]), progress))
    return audit, first


def test_a_fingerprint_sees_values_dtypes_shapes_and_order_but_no_addresses():
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": [1, 2]}
    assert fingerprint(a) == fingerprint({"x": torch.arange(6.0).reshape(2, 3), "y": [1, 2]})
    assert fingerprint(a)[1] == "1 tensor: 2x3 float32"
    for other in ({"x": torch.arange(6.0).reshape(3, 2), "y": [1, 2]},
                  {"x": torch.arange(6).reshape(2, 3), "y": [1, 2]},
                  {"x": torch.arange(6.0).reshape(2, 3) + 1, "y": [1, 2]},
                  {"x": torch.arange(6.0).reshape(2, 3), "y": [2, 1]}):
        assert fingerprint(other)[0] != fingerprint(a)[0]
    # A mapping that is no dict (Hugging Face's BatchEncoding), and an object whose repr
    # holds its address: alike in two processes.
    assert fingerprint(UserDict(a)) == fingerprint(a)
    assert fingerprint([object(), torch.ones(2)]) == fingerprint([object(), torch.ones(2)])


def test_the_mode_comes_from_the_environment_and_a_bad_one_is_refused():
    assert audit_mode({}) == "warn"
    assert audit_mode({"PROCCKPT_AUDIT": " Strict "}) == "strict"
    with pytest.raises(UsageError, match="PROCCKPT_AUDIT='loud'.*strict.*warn.*off"):
        audit_mode({"PROCCKPT_AUDIT": "loud"})


@pytest.mark.parametrize("ahead", [0, 1], ids=["plain", "fetches-one-ahead"])
def test_a_stop_records_the_next_batch_and_a_faithful_resume_agrees(tmp_path: Path, ahead: int):
    data = batches(8)
    train_and_stop(tmp_path, data, stop_after=3, ahead=ahead)
    [entry] = json.loads((tmp_path / "audit" / "rank-0.json").read_text())["next"]
    assert (entry["epoch"], entry["batch"], entry["step"]) == (0, 3, 3)
    assert entry["crc"] == fingerprint(data[3])[0]
    audit, first = resume(tmp_path, data, at=3)
    assert first is data[3] and audit.verdict == "same"
    assert [e["verdict"] for e in events(tmp_path)] == ["same"]


def test_a_resume_that_skips_a_batch_is_told_and_strict_refuses_it(tmp_path: Path, caplog):
    data = batches(8)
    train_and_stop(tmp_path, data, stop_after=3)
    skipped = data[:3] + data[4:]
    audit, _ = resume(tmp_path, skipped, at=3)
    assert audit.verdict == "differs"
    [line] = [r.getMessage() for r in caplog.records if "resume audit" in r.getMessage()]
    assert "batch 3 of epoch 0 (step 3), the first after ckpt-00000001, is not what the " \
           "interrupted run was about to train on" in line
    assert "--audit strict would stop here" in line
    with pytest.raises(Refused, match="stopped before training on it"):
        resume(tmp_path, skipped, at=3, mode="strict")
    assert [e["verdict"] for e in events(tmp_path)] == ["differs", "refused"]


def test_a_periodic_checkpoint_records_the_batch_the_loop_trains_next_and_reads_none(
        tmp_path: Path):
    audit, progress = audit_for(tmp_path), Position()
    read = []

    def loader():
        for b in batches(6):
            read.append(b)
            yield b

    it = audit.wrap(loader(), progress)
    for i, _ in enumerate(it):
        progress.batch_done()
        if i == 1:
            audit.saved(progress.position)  # periodic: the run goes on
            assert not (tmp_path / "audit").exists()  # batch 2 is not known yet
        if i == 2:
            audit.flush()  # (written by a thread of its own, off the training's path)
            entries = json.loads((tmp_path / "audit" / "rank-0.json").read_text())["next"]
            assert [(e["batch"], e["crc"]) for e in entries] == [(2, fingerprint(read[2])[0])]
    assert len(read) == 6  # nothing read for the audit


def test_nothing_recorded_nothing_compared(tmp_path: Path):
    # A stop at a pass's end (an epoch's last batch): the next batch is in a pass not opened.
    data = batches(3)
    train_and_stop(tmp_path, data, stop_after=3)
    assert not (tmp_path / "audit").exists()
    audit = audit_for(tmp_path)
    progress = Position(1, 0, 3)
    audit.resumed("ckpt-00000001", progress.position)
    next(audit.wrap(iter(data), progress))
    assert audit.verdict == "unrecorded"
    # Another world size or batch size deals the data out anew: no verdict at all.
    train_and_stop(tmp_path, batches(8), stop_after=3)
    audit = audit_for(tmp_path, "strict")
    audit.resumed("ckpt-00000002", (0, 3, 3))
    next(audit.wrap(iter(batches(8, offset=0.5)), Position(0, 3, 3, remapped=True)))
    assert audit.verdict is None


def test_an_earlier_runs_record_at_the_same_position_is_dropped(tmp_path: Path):
    train_and_stop(tmp_path, batches(8, offset=0.5), stop_after=3)  # a run since archived
    audit, progress = audit_for(tmp_path), Position(1, 0, 8)
    audit.saved(progress.position)  # (a stop at an epoch's end: nothing of its own follows)
    audit, progress = audit_for(tmp_path), Position(0, 3, 3)
    audit.saved(progress.position)
    audit.flush()
    assert json.loads((tmp_path / "audit" / "rank-0.json").read_text())["next"] == []


def test_in_a_group_every_rank_learns_which_ranks_differ(tmp_path: Path):
    data = batches(8)
    train_and_stop(tmp_path, data, stop_after=3)
    told = []

    def group(differs: bool) -> list[int]:  # the collective, as rank 0 sees it: rank 1 differs
        told.append(differs)
        return [1]

    audit, progress = audit_for(tmp_path, "warn", group), Position(0, 3, 3)
    audit.resumed("ckpt-00000001", progress.position)
    next(audit.wrap(iter(data[3:]), progress))
    assert told == [False] and audit.verdict == "differs on rank 1"
    audit, progress = audit_for(tmp_path, "strict", group), Position(0, 3, 3)
    audit.resumed("ckpt-00000001", progress.position)
    with pytest.raises(Refused, match="differs on rank 1 of the group"):
        next(audit.wrap(iter(data[3:]), progress))
