"""training/position/progress.py through the Checkpointer, in one process, a real checkpoint dir:
``steps()`` resumes at the saved step with the saved random streams, alone and inside
``epochs()``, and a resume says when the script drew random numbers before its loop."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from procckpt import Checkpointer
from procckpt.protocol.events import read_events

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def run_steps(d: Path, total: int, stop_after: int | None = None) -> tuple[list[int], list]:
    """Steps done and the numbers drawn in each; with ``stop_after``, a checkpoint is taken
    after that step (at its safe point) and the loop is left in the next one."""
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(d, model=model, async_save=False)
    done, draws = [], []
    for step in ckpt.steps(total):
        if stop_after is not None and step == stop_after + 1:
            ckpt.close()
            break
        done.append(step)
        draws.append(torch.rand(1).item())
        if step == stop_after:
            ckpt.request_checkpoint()
    return done, draws


def test_steps_alone_resume_at_the_saved_step_with_the_saved_streams(tmp_path: Path, caplog):
    torch.manual_seed(0)
    _, uninterrupted = run_steps(tmp_path / "a", 8)
    torch.manual_seed(0)
    first, draws = run_steps(tmp_path / "b", 8, stop_after=4)
    torch.manual_seed(0)  # a restarted process seeds again
    second, more = run_steps(tmp_path / "b", 8)
    assert first == [0, 1, 2, 3, 4] and second == [5, 6, 7]
    assert draws + more == uninterrupted
    assert "drew random numbers" not in caplog.text
    assert any(e["event"] == "complete" for e in read_events(tmp_path / "b" / "events.jsonl"))


def test_steps_inside_epochs_count_the_epochs_steps(tmp_path: Path):
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, model=model, async_save=False)
    seen = [(epoch, step, ckpt.step) for epoch in ckpt.epochs(2) for step in ckpt.steps(3)]
    assert seen == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4), (1, 2, 5)]
    assert ckpt.finished and ckpt.step == 6


def test_a_draw_between_the_resume_and_the_loop_is_warned_about(tmp_path: Path, caplog):
    run_steps(tmp_path, 8, stop_after=2)
    caplog.set_level(logging.WARNING, logger="procckpt")
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, model=model, async_save=False)
    torch.randint(10, (4,))  # nanoGPT's pre-loop get_batch()
    for _ in ckpt.steps(8):
        pass
    assert "drew random numbers after procckpt.Checkpointer() resumed" in caplog.text
    assert any(e["event"] == "warning" for e in read_events(tmp_path / "events.jsonl"))


def run_epochs(d: Path, epochs: int, stop_at_end: bool = False) -> torch.Tensor:
    """Epochs of two steps each; with ``stop_at_end``, a stop is asked for in the last one (its
    checkpoint is the end of training's). Returns what the script draws after the loop, or
    nothing where it stopped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(d, model=model, async_save=False)
    try:
        for epoch in ckpt.epochs(epochs):
            for _ in ckpt.steps(2):
                torch.rand(1)
            if stop_at_end and epoch == epochs - 1:
                ckpt.request_checkpoint(stop=True)
    except SystemExit:
        return torch.empty(0)
    draws = torch.rand(4)
    ckpt.close()  # a later run of this test opens the same dir
    return draws


def test_a_stop_asked_at_the_last_epochs_end_lets_the_training_finish_there(tmp_path: Path):
    expected = run_epochs(tmp_path / "uninterrupted", 3)
    # No resume may start in a loop with nothing left: the end of training takes the
    # checkpoint, and the code after the loop runs in this process, drawing as it would have.
    assert torch.equal(run_epochs(tmp_path / "stopped", 3, stop_at_end=True), expected)
    assert (tmp_path / "stopped" / "COMPLETE").exists()


class Stream(torch.utils.data.IterableDataset):
    """A sharded stream that counts its own position (webdataset-style): a pass's order comes
    from the pass number, each sample gets a random transform, and a state taken after a pass
    ended starts the next one. It counts what it reads."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.passes, self.reads = n, 0, 0, 0

    def __iter__(self):
        if self.pos >= self.n:
            self.pos, self.passes = 0, self.passes + 1
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes))
        while self.pos < self.n:
            index = int(order[self.pos])
            self.pos += 1
            self.reads += 1
            yield torch.tensor([float(index)]) + torch.rand(1)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "passes": self.passes}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.passes = state["pos"], state["passes"]


def run_stream(d: Path, stop_after: int | None = None, workers: int = 0) -> tuple[list, int]:
    """Batches of two epochs of a 12-sample stream in batches of 3; with ``stop_after``, a
    checkpoint after that many batches, and the loop left at the next one."""
    torch.manual_seed(0)
    stream = Stream(12)
    loader = torch.utils.data.DataLoader(stream, batch_size=3, num_workers=workers)
    ckpt = Checkpointer(d, model=torch.nn.Linear(2, 2), async_save=False)
    seen: list = []
    for _ in ckpt.epochs(2):
        for batch in ckpt.batches(loader):
            if stop_after is not None and len(seen) == stop_after:
                ckpt.close()
                return seen, stream.reads
            seen.append(batch)
            if len(seen) == stop_after:
                ckpt.request_checkpoint()
    return seen, stream.reads


@pytest.mark.parametrize("stop_after", [6, 4], ids=["mid-epoch", "epoch-boundary"])
def test_a_stream_with_its_own_state_resumes_by_it_reading_nothing_again(tmp_path: Path,
                                                                          stop_after: int):
    whole, _ = run_stream(tmp_path / "a")
    first, _ = run_stream(tmp_path / "b", stop_after)
    rest, reads = run_stream(tmp_path / "b")
    assert len(whole) == 8 and len(first) == stop_after
    assert all(torch.equal(x, y) for x, y in zip(first + rest, whole, strict=True))
    assert reads == 3 * len(rest)  # the resumed process read only what it trained on
    if stop_after % 4:
        (skip,) = [e for e in read_events(tmp_path / "b" / "events.jsonl")
                   if e["event"] == "resume-skip"]
        assert skip["how"] == "restored the data set's own state (nothing read again)"


def run_ahead(d: Path, stop_after: int | None = None) -> list:
    """run_stream's two epochs driven as a framework drives them (DrivenLoop): the next batch
    is fetched before the one in hand is trained on and its safe point passed."""
    from procckpt.training.driven import DrivenLoop

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Stream(12), batch_size=3)
    ckpt = Checkpointer(d, model=torch.nn.Linear(2, 2), async_save=False)
    loop, seen = DrivenLoop(ckpt), []
    for epoch in range(ckpt.epoch, 2):
        batches = loop.open(loader, epoch)
        ahead = next(batches, None)
        while ahead is not None:
            batch, ahead = ahead, next(batches, None)
            if stop_after is not None and len(seen) == stop_after:
                ckpt.close()
                return seen
            seen.append(batch)
            if len(seen) == stop_after:
                ckpt.request_checkpoint()
            loop.batch_done()
    loop.finish()
    return seen


def test_a_stream_fetched_ahead_is_saved_as_it_was_after_the_batches_trained_on(
        tmp_path: Path):
    """The samples, and the random transform drawn in this process as each batch is fetched:
    a batch fetched ahead of a checkpoint draws from streams seeded by the epoch and its number
    (loaders.SeededFetches), so the resumed run's first batch is the same. (The first-batch
    audit, strict in the suite, found it drawn anew from the restored streams before.)"""
    whole = run_ahead(tmp_path / "a")
    first = run_ahead(tmp_path / "b", 6)
    rest = run_ahead(tmp_path / "b")
    assert len(whole) == 8 and len(first) == 6
    assert all(torch.equal(x, y) for x, y in zip(first + rest, whole, strict=True))
