"""training/state/rehearsal.py: the restore a warm restart's spare rehearses while it waits
leaves nothing a script could see (issue 55)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from procckpt.training.state.rehearsal import rehearse

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def _tasks() -> set[str]:
    """The threads of this process the kernel sees (Python's and native ones)."""
    return set(os.listdir("/proc/self/task"))


def test_a_rehearsal_restores_and_leaves_no_trace(tmp_path: Path):
    rng, tasks = torch.get_rng_state(), _tasks()
    threads = {t.ident for t in threading.enumerate()}
    assert rehearse(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # its checkpoint dir is gone
    assert torch.equal(torch.get_rng_state(), rng)  # no random stream was drawn
    # No thread of its own left (the checksum's joined); one of earlier tests' objects may
    # have ended meanwhile, as the garbage collector took them.
    assert _tasks() <= tasks and {t.ident for t in threading.enumerate()} <= threads


def test_a_rehearsal_that_cannot_write_is_skipped_without_a_word(tmp_path: Path, caplog):
    """A temporary directory it cannot use: False, nothing raised, nothing said above debug
    (the spare's restore then pays its first calls, as a cold start does)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    caplog.set_level("INFO", logger="procckpt")
    assert not rehearse(str(not_a_dir))
    assert caplog.text == ""



def test_a_rehearsal_leaves_the_region_for_the_restore_alone(tmp_path: Path):
    """Once the memory for the restore is touched (reserve.py), a rehearsal would carve from
    it and give the rest back: it declines, and the region stays whole."""
    from procckpt.training.state import reserve

    assert reserve.prepare(1 << 20)
    try:
        held, carved = reserve.held(), reserve.carved()
        assert not rehearse(str(tmp_path))
        assert (reserve.held(), reserve.carved()) == (held, carved)
    finally:
        reserve.release()


def test_what_a_rehearsal_copies_is_not_counted_in_the_restore_after_it(tmp_path: Path):
    """The spare rehearses with a stepped optimizer, whose moments its restore writes over;
    the script's restore after it, into an optimizer with no state, touched nothing."""
    from procckpt import Checkpointer

    assert rehearse(str(tmp_path))
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()  # a momentum buffer to save
    saving = Checkpointer(tmp_path / "ck", model=model, optimizer=optimizer, save_every=None)
    saving.save()
    saving.close()
    fresh = torch.nn.Linear(8, 8)
    resumed = Checkpointer(tmp_path / "ck", model=fresh, save_every=None,
                           optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    assert resumed.resumed_from is not None
    assert resumed._restored()[2] == 0
    resumed.close()
