"""procckpt.ShuffleBuffer: a stream shuffled through a buffer that is part of its state.

Each test stops a loader after some batches, takes its state, and reads the rest with a new
loader that loaded it, as a resumed process does; the two parts must be the uninterrupted
order, batch for batch. Worker processes are real (torchdata's StatefulDataLoader collects
their states); the Hugging Face streams read real JSON Lines and Parquet files."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from procckpt import ShuffleBuffer
from procckpt.errors import ProcckptError
from procckpt.training.position.loaders import stateful_source, usable_state

from .conftest import REPO

needs_torchdata = pytest.mark.skipif(importlib.util.find_spec("torchdata") is None,
                                     reason="torchdata is not installed (its "
                                            "StatefulDataLoader collects workers' states)")
needs_datasets = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                    reason="Hugging Face datasets is not installed")


class Counting(IterableDataset):
    """Samples 0..n-1 split over the workers, with the count read so far as its state. Like a
    Hugging Face stream, a loaded state takes effect when its next pass begins reading."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0
        self.done = 0

    def __iter__(self):
        info = get_worker_info()
        mine = range(info.id, self.n, info.num_workers) if info else range(self.n)
        self.done, start, self.start = self.start, self.start, 0
        for sample in list(mine)[start:]:
            self.done += 1
            yield sample

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["done"]  # taken when the next pass begins, as Hugging Face's are


def loader(data: Any, workers: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(data, batch_size=4, num_workers=workers)


def ids(batch: Any) -> list[int]:
    return (batch["id"] if isinstance(batch, dict) else batch).tolist()


def interrupted(make: Any, epoch: int, stop_after: int, workers: int) -> list[list[int]]:
    """The epoch's batches, read in two processes' worth: ``stop_after`` batches, the state,
    then the rest from a new data set and loader that loaded it."""
    data = make()
    data.set_epoch(epoch)
    first_loader = loader(data, workers)
    it = iter(first_loader)
    first = [ids(next(it)) for _ in range(stop_after)]
    state = first_loader.state_dict()
    del it
    saved = io.BytesIO()
    torch.save(state, saved)  # as a checkpoint holds it
    saved.seek(0)
    data = make()
    data.set_epoch(epoch)
    second_loader = loader(data, workers)
    second_loader.load_state_dict(torch.load(saved, weights_only=True))
    return first + [ids(b) for b in second_loader]


def whole(make: Any, epoch: int, workers: int) -> list[list[int]]:
    data = make()
    data.set_epoch(epoch)
    return [ids(b) for b in loader(data, workers)]


@needs_torchdata
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_anywhere_in_the_epoch_goes_on_with_the_same_order(workers: int):
    def make() -> ShuffleBuffer:
        return ShuffleBuffer(Counting(200), size=16, seed=3)

    for epoch in (0, 1):
        expected = whole(make, epoch, workers)
        assert sorted(sum(expected, [])) == list(range(200))  # each sample once
        assert sum(expected, []) != list(range(200))  # shuffled
        # Early, in the middle, and where the stream has ended and the buffer drains.
        for stop_after in (1, 23, len(expected) - 2):
            assert interrupted(make, epoch, stop_after, workers) == expected, (epoch, stop_after)
    assert whole(make, 0, workers) != whole(make, 1, workers)  # each epoch its own order


def hugging_face_orders(directory: str, fmt: str) -> dict[str, Any]:
    """Batch orders of a Hugging Face stream over four files, read whole and read with a stop
    after 3 and after 30 batches, each by two workers."""
    import datasets

    datasets.disable_progress_bars()
    files = []
    for f in range(4):
        records = [{"id": f * 50 + r, "text": f"text {f * 50 + r}"} for r in range(50)]
        path = Path(directory) / f"part-{f}.{fmt}"
        if fmt == "json":
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), path, row_group_size=10)
        files.append(str(path))

    def make() -> ShuffleBuffer:
        stream = datasets.load_dataset(fmt, data_files=files, split="train", streaming=True)
        stream = stream.map(lambda e: {"n": len(e["text"])}, remove_columns=["text"])
        return ShuffleBuffer(stream.with_format("torch"), size=20, seed=0)

    return {"whole": whole(make, 1, workers=2),
            **{str(n): interrupted(make, 1, n, workers=2) for n in (3, 30)}}


@needs_torchdata
@needs_datasets
@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_a_hugging_face_stream_read_by_two_workers_resumes_exactly(tmp_path: Path, fmt: str):
    # The workers fork from a new process, as they do from a training script, not from a test
    # process that holds the threads other tests left (gloo's, tqdm's, Arrow's), and Arrow
    # allocates with the C library's allocator (conftest.py says why).
    code = ("import json, sys; from tests.test_shuffle_buffer import hugging_face_orders; "
            "print(json.dumps(hugging_face_orders(sys.argv[1], sys.argv[2])))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), fmt], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    orders = json.loads(done.stdout.splitlines()[-1])
    expected = orders["whole"]
    assert sorted(sum(expected, [])) == list(range(200))
    for stop_after in ("3", "30"):
        assert orders[stop_after] == expected, stop_after


def test_another_buffer_size_or_seed_or_data_set_is_refused_with_what_to_do():
    saved = ShuffleBuffer(Counting(10), size=4, seed=0).state_dict()
    with pytest.raises(ProcckptError, match="held 4 samples with seed 0, this one 8 with seed "
                                            "0: an exact resume needs the same"):
        ShuffleBuffer(Counting(10), size=8, seed=0).load_state_dict(saved)
    with pytest.raises(ProcckptError, match="not saved by a ShuffleBuffer"):
        ShuffleBuffer(Counting(10), size=4).load_state_dict({"done": 3})
    with pytest.raises(ValueError, match="at least one sample"):
        ShuffleBuffer(Counting(10), size=0)


def test_a_source_without_state_makes_the_loader_one_to_replay():
    plain = ShuffleBuffer(range(10), size=4)
    with pytest.raises(ProcckptError, match="has no state_dict"):
        plain.state_dict()
    assert stateful_source(DataLoader(plain, batch_size=2)) is None
    assert usable_state(ShuffleBuffer(Counting(10), size=4))


@needs_torchdata
def test_a_second_resume_one_batch_after_the_first_is_exact_too():
    """One batch after a resume, one worker has handed out nothing yet: the state it reports
    is the one it loaded, which must still hold its buffer."""
    def make() -> ShuffleBuffer:
        return ShuffleBuffer(Counting(200), size=16, seed=3)

    expected = whole(make, 0, workers=2)
    first = loader(make(), 2)
    it = iter(first)
    got = [ids(next(it)) for _ in range(10)]
    state = first.state_dict()
    del it
    second = loader(make(), 2)
    second.load_state_dict(state)
    it = iter(second)
    got.append(ids(next(it)))
    state = second.state_dict()
    del it
    third = loader(make(), 2)
    third.load_state_dict(state)
    got += [ids(b) for b in third]
    assert got == expected


class EpochCounting(Counting):
    """Counting whose pass reads its samples in an order given by the epoch (set_epoch), and
    whose state does not say the epoch (Hugging Face's loads no epoch back)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for sample in super().__iter__():
            yield (sample * (2 * self.epoch + 1)) % self.n  # odd factor: each sample once


@needs_torchdata
def test_a_resume_opened_before_the_script_sets_the_epoch_goes_on_in_the_saved_one():
    """Lightning opens the training loader of a resumed epoch before the hook where a script
    calls set_epoch(): the workers get a data set still at epoch 0."""
    def make() -> ShuffleBuffer:
        return ShuffleBuffer(EpochCounting(200), size=16, seed=3)

    expected = whole(make, 1, workers=2)
    data = make()
    data.set_epoch(1)
    first = loader(data, 2)
    it = iter(first)
    got = [ids(next(it)) for _ in range(10)]
    state = first.state_dict()
    del it
    second = loader(make(), 2)  # no set_epoch(1) before it is opened
    second.load_state_dict(state)
    got += [ids(b) for b in second]
    assert got == expected


class Shard(Counting):
    """Counting with a Hugging Face stream's way of saying where it is: a pass that read to
    the end says it is past its shard; one resumed at that end, reading nothing, says it is at
    the end of the shard. Two states for one position."""

    def __iter__(self):
        resumed_at_end = self.start == self.n
        yield from super().__iter__()
        if not resumed_at_end:
            self.done = ("past", self.n)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = self.n if isinstance(state["done"], tuple) else state["done"]


def test_once_the_source_ran_out_the_state_is_the_same_however_the_run_got_there():
    """After the source ended, the buffer still drains; a state taken then holds no source
    state, so a resumed run and an uninterrupted one save the same (procckpt check compares
    them), and a resume from it never reads the source again."""
    def drained(data: ShuffleBuffer, n: int) -> tuple[list[int], dict[str, Any]]:
        it = iter(data)
        return [next(it) for _ in range(n)], data.state_dict()

    a = ShuffleBuffer(Shard(12), size=4, seed=1)
    whole, _ = drained(a, 12)
    # Stopped where the source has just run out, resumed, and both go on to the same point.
    first, state = drained(ShuffleBuffer(Shard(12), size=4, seed=1), 9)
    assert state["source"] is None  # 12 read, 9 handed out, 3 in the buffer
    b = ShuffleBuffer(Shard(12), size=4, seed=1)
    b.load_state_dict(state)
    rest, resumed_state = drained(b, 2)
    a2 = ShuffleBuffer(Shard(12), size=4, seed=1)
    _, straight_state = drained(a2, 11)
    assert first + rest == whole[:11]
    assert resumed_state["source"] is None and straight_state["source"] is None
    assert resumed_state["rng"] == straight_state["rng"]
    assert resumed_state["buffer"] == straight_state["buffer"]
