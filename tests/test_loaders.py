"""Opening a DataLoader at a batch of its epoch: the skip loads nothing, gives the batches the
whole epoch would have given from there, with worker processes too; a data set that is not a
function of its index is replayed, and the test of that leaves it untouched."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from procckpt.errors import UsageError
from procckpt.training.position.loaders import SKIPPED, check_loader, open_at
from procckpt.training.position.rng import capture_rng, restore_rng

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


class Noisy(Dataset):
    """A random transform per sample, from torch's global stream or a generator of its own."""

    def __init__(self, n: int = 64, own: bool = False) -> None:
        self.x = torch.arange(n, dtype=torch.float64).unsqueeze(1).repeat(1, 4)
        self.rng = torch.Generator().manual_seed(3) if own else None
        self.loads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads += 1
        return self.x[i] + torch.randn(4, dtype=torch.float64, generator=self.rng)


def epoch(loader: DataLoader, skip: int, streams: dict) -> tuple[list[torch.Tensor], str]:
    """The batches of one epoch from ``skip`` on, started from ``streams``."""
    restore_rng(streams)
    iterator, how = open_at(loader, skip)
    return list(iterator), how


@pytest.mark.parametrize("workers", [0, 2])
def test_a_skip_gives_the_rest_of_the_epoch_without_loading_the_skipped_samples(workers: int):
    torch.manual_seed(0)
    data = Noisy()
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=workers)
    start = capture_rng()
    restore_rng(start)
    iterator, how = open_at(loader, 0)
    whole = [next(iterator) for _ in range(10)]
    after_ten = capture_rng()  # what a checkpoint after batch 10 holds
    whole += list(iterator)
    assert how == ""
    data.loads = 0
    restore_rng(start)  # as a resume does: the epoch's start, the skip, then the saved streams
    rest_iterator, how = open_at(loader, 10)
    restore_rng(after_ten)
    rest = list(rest_iterator)
    assert how == SKIPPED
    assert len(rest) == len(whole) - 10
    assert all(torch.equal(a, b) for a, b in zip(whole[10:], rest))
    if workers == 0:  # loaded in this process: only the batches after the skip
        assert data.loads == 4 * len(rest)


def test_with_workers_a_sample_is_the_same_whichever_worker_loads_it():
    torch.manual_seed(0)
    start = capture_rng()
    one, _ = epoch(DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=1), 0, start)
    two, _ = epoch(DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2), 0, start)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_a_data_set_with_its_own_generator_is_replayed_and_left_untouched_by_the_test():
    torch.manual_seed(0)
    data = Noisy(own=True)
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    start = capture_rng()
    before = data.rng.get_state()
    whole, _ = epoch(loader, 0, start)
    rest, how = epoch(loader, 5, start)
    assert how.startswith("replayed the 5 batches") and "differed" in how
    assert torch.equal(data.rng.get_state(), before)  # the workers had copies; so had the test
    assert data.loads == 0
    assert all(torch.equal(a, b) for a, b in zip(whole[5:], rest))


def test_without_workers_a_data_set_with_its_own_generator_is_warned_about(caplog):
    data = Noisy(own=True)
    loader = DataLoader(data, batch_size=4)
    _, how = epoch(loader, 3, capture_rng())
    assert how.startswith("replayed the 3 batches")
    assert "ckpt.extras" in caplog.text


def test_a_skip_past_the_end_says_the_data_changed():
    loader = DataLoader(Noisy(8), batch_size=4, num_workers=2)
    with pytest.raises(Exception, match="ran out after 2 batches"):
        epoch(loader, 5, capture_rng())


def test_loader_settings_no_resume_can_repeat_are_refused():
    for kwargs in ({"persistent_workers": True}, {"in_order": False}):
        with pytest.raises(UsageError, match=next(iter(kwargs))):
            check_loader(DataLoader(Noisy(), num_workers=1, **kwargs))


# -- a loader that changed since the checkpoint ----------------------------------------------
def test_a_changed_batch_size_passes_over_the_same_samples_or_is_refused():
    from procckpt.training.position.shape import loader_shape, map_position

    saved = loader_shape(DataLoader(Noisy(320), batch_size=32))
    assert saved == {"batch_size": 32, "batches": 10, "samples": 320}
    same = loader_shape(DataLoader(Noisy(320), batch_size=32))
    assert map_position(saved, same, 5) == (5, None)
    halved = loader_shape(DataLoader(Noisy(320), batch_size=16))
    skip, said = map_position(saved, halved, 5)
    assert skip == 10 and said is not None
    assert "from 32 to 16" in said and "passing over 10 batches of 16 (the 160 samples" in said
    with pytest.raises(UsageError, match="160 samples are no whole number of batches of 48"):
        map_position(saved, loader_shape(DataLoader(Noisy(320), batch_size=48)), 5)
    longer = loader_shape(DataLoader(Noisy(400), batch_size=32))
    skip, said = map_position(saved, longer, 5)
    assert skip == 5 and "has 400 samples, 320 when the checkpoint was taken" in said
    assert "not exact" in said
    assert map_position(None, halved, 5) == (5, None)  # a checkpoint from before shapes were kept


class CoinFlip(Dataset):
    """An augmentation applied with probability 1/2, from a NumPy generator of the data set's
    own: with seed 5 its first draws are 0.805 and 0.808, so sample 0 loaded twice in a row
    comes out the same, and a probe of two loads alone is fooled."""

    def __init__(self, n: int = 64) -> None:
        import numpy as np

        self.x = torch.arange(n, dtype=torch.float64).unsqueeze(1).repeat(1, 4)
        self.rng = np.random.default_rng(5)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return -self.x[i] if self.rng.random() < 0.5 else self.x[i]


class WithNaN(Noisy):
    def __getitem__(self, i: int) -> torch.Tensor:
        sample = super().__getitem__(i)
        sample[0] = float("nan")
        return sample


class LazyFile(Noisy):
    """Opens its 'file' on the first read (and counts reads, as Noisy does): samples are still
    a function of their index."""

    def __init__(self) -> None:
        super().__init__()
        self.handle = None

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.handle is None:
            self.handle = object()
        return super().__getitem__(i)


class TransformWithItsOwnRandom(Noisy):
    """A generator two attributes down: a transform object of the data set holds it."""

    def __init__(self) -> None:
        import random

        super().__init__()
        self.transform = type("Flip", (), {})()
        self.transform.rng = random.Random(4)

    def __getitem__(self, i: int) -> torch.Tensor:
        flip = self.transform.rng.random() < 0.5
        return -super().__getitem__(i) if flip else super().__getitem__(i)


def test_the_probe_is_not_fooled_by_a_coin_flip_and_takes_nan_for_the_same_sample():
    from procckpt.training.position.loaders import sample_seed, seed_streams
    from procckpt.training.position.probe import not_repeatable

    def _not_repeatable(dataset: Dataset) -> str:
        return not_repeatable(dataset, lambda i: seed_streams(sample_seed(0, i)))

    flips = CoinFlip()
    assert flips.rng.random() >= 0.5 and flips.rng.random() >= 0.5  # the same outcome twice
    why = _not_repeatable(CoinFlip())
    assert "own state changed as samples were read (self.rng)" in why, why
    assert _not_repeatable(WithNaN()) == ""  # the same sample, NaN and all: skip
    assert _not_repeatable(Noisy()) == ""
    assert "self.rng" in _not_repeatable(Noisy(own=True)) or "differed" in \
        _not_repeatable(Noisy(own=True))
    assert _not_repeatable(LazyFile()) == ""  # no replay for a lazy open or a read counter
    from procckpt.training.position.probe import own_state

    assert list(own_state(TransformWithItsOwnRandom())) == ["self.transform.rng"]
    assert _not_repeatable(TransformWithItsOwnRandom()) != ""


def test_a_replay_says_how_long_it_will_take_then_how_far_it_got(caplog):
    import logging

    from procckpt.training.position import loaders

    now = [0.0]

    def clock() -> float:  # a quarter of a second a batch
        now[0] += 0.25
        return now[0]

    caplog.set_level(logging.INFO, logger="procckpt")
    how = loaders._replay(iter(range(1000)), 400, "an IterableDataset or a plain iterable",
                          clock=clock)
    assert how.startswith("replayed the 400 batches trained before the restart")
    (estimate,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert estimate.startswith("replaying the 400 batches trained before the restart (an "
                               "IterableDataset or a plain iterable): about 1m39s at 4 "
                               "batches/s; to resume without reading them again"), estimate
    assert "StatefulDataLoader" in estimate
    progress = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert progress == ["replayed 124 of 400 batches, about 1m09s left",
                        "replayed 244 of 400 batches, about 39.0s left",
                        "replayed 364 of 400 batches, about 9.0s left"], progress
    caplog.clear()
    assert loaders._replay(iter(range(10)), 5, "quick", clock=lambda: 0.0).startswith("replayed")
    assert not caplog.records  # done within a second: nothing to say
    with pytest.raises(UsageError, match="ran out after 3 batches, but the checkpoint was "
                                         "taken after batch 5"):
        loaders._replay(iter(range(3)), 5, "short", clock=lambda: 0.0)


def test_a_stream_with_a_state_read_by_worker_processes_is_replayed_with_what_to_use():
    from procckpt.training.position.loaders import open_at, stateful_source

    from .test_progress import Stream

    loader = torch.utils.data.DataLoader(Stream(6), batch_size=2, num_workers=1)
    assert stateful_source(loader) is None
    assert stateful_source(torch.utils.data.DataLoader(Stream(6), batch_size=2)) is not None
    iterator, how = open_at(loader, 1)
    assert how.startswith("replayed the 1 batches") and "StatefulDataLoader gathers" in how
    assert len(list(iterator)) == 2


@pytest.mark.parametrize("before,after,batches", [(2, 3, 5), (3, 2, 4), (2, 3, 6), (4, 4, 3)])
def test_the_rest_of_an_epoch_is_dealt_out_over_other_ranks_each_sample_once(
        before: int, after: int, batches: int):
    from torch.utils.data import DistributedSampler

    from procckpt.training.position.resplit import RemainderSampler, resplit_position

    data, batch_size = list(range(60)), 2
    trained: list[int] = []
    for rank in range(before):
        sampler = DistributedSampler(data, num_replicas=before, rank=rank, seed=7)
        sampler.set_epoch(1)
        trained += list(sampler)[:batches * batch_size]
    payload = {"progress": {"epoch": 1, "batch": batches, "loader": {"batch_size": batch_size}}}
    progress = resplit_position(payload, before, after, log=False)["progress"]
    assert progress["batch"] == 0 and progress["epoch_samples_before"] == len(trained)
    rest: list[int] = []
    for rank in range(after):
        sampler = DistributedSampler(data, num_replicas=after, rank=rank, seed=7)
        sampler.set_epoch(1)
        rest += list(RemainderSampler(sampler, progress["epoch_samples_before"]))
    counts = {i: (trained + rest).count(i) for i in data}
    pad = -(len(data) - len(trained)) % after
    assert set(counts.values()) <= {1, 2} and list(counts.values()).count(2) == pad
    # A second change in the same epoch adds to what was trained before it.
    again = resplit_position({"progress": {**progress, "batch": 1}}, after, before, log=False)
    assert again["progress"]["epoch_samples_before"] == len(trained) + batch_size * after


def test_a_rest_that_cannot_be_dealt_out_again_is_refused_with_what_to_do():
    from procckpt.training.position.resplit import remainder_batches, resplit_position

    with pytest.raises(UsageError, match="did not say its batch size"):
        resplit_position({"progress": {"epoch": 0, "batch": 3, "loader": None}}, 2, 3)
    with pytest.raises(UsageError, match="give the DataLoader sampler=DistributedSampler"):
        remainder_batches(torch.utils.data.DataLoader(list(range(8)), batch_size=2), 4)


def test_which_loaders_a_resume_reads_again_is_told_from_their_type_alone():
    from procckpt.training.position.loaders import replayed_on_resume

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(4)

    class StatefulStream(Stream):
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert replayed_on_resume(DataLoader(list(range(8)), batch_size=2)) is None  # by index
    assert replayed_on_resume([1, 2, 3]) is None  # a list of batches: nothing worth a word
    assert "without a state" in replayed_on_resume(DataLoader(Stream(), batch_size=2))
    assert "without a state" in replayed_on_resume(x for x in range(3))
    assert "worker processes holds its own copy" in replayed_on_resume(
        DataLoader(StatefulStream(), batch_size=2, num_workers=2))
