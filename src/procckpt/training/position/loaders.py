"""Opening a data loader at a batch of its epoch without loading the batches before it.

A map-style ``DataLoader`` is opened past a resume's position by advancing its sampler alone:
no ``__getitem__`` runs for the batches already trained on, so the cost does not grow with the
position. That is exact when a sample is a function of its index and the random streams it
draws from:

- without worker processes, ``__getitem__`` draws from the main process's streams, which the
  checkpoint restores right after the skip;
- with worker processes, a worker's streams depend on every sample it loaded before (torch
  seeds each worker once per epoch), so a skip alone would change them. procckpt therefore
  re-seeds torch's, Python's and (when imported) NumPy's global streams before every sample,
  from the epoch's worker seed and the sample's index, in uninterrupted and resumed runs alike:
  a sample's random transform no longer depends on which worker loaded it or what came before.

Before skipping, a forked child loads a few samples twice each from the same random state and
watches the generators the data set holds (probe.py); if two loads differ or a generator moved
(the data set draws from a generator of its own, reads the clock...) the batches are replayed
instead: produced again and dropped, as for an ``IterableDataset`` or a plain iterable.
"""

from __future__ import annotations

import collections.abc
import contextlib
import hashlib
import itertools
import logging
import operator
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ...durations import format_duration
from ...errors import UsageError
from .probe import not_repeatable

__all__ = ["check_loader", "open_at", "advance", "loader_generators", "SeededSamples",
           "SeededFetches", "fetches_in_process",
           "wraps_a_loader", "usable_state", "stateful_source",
           "align_epoch", "streams_kept", "swapped"]

logger = logging.getLogger(__name__)

SKIPPED = "skipped the sampler's indices"


def check_loader(loader: object) -> None:
    """Refuse loader settings under which no resume can be exact.

    Raises:
        UsageError: with the setting to change.
    """
    if not isinstance(loader, DataLoader) or not loader.num_workers:
        return
    if loader.persistent_workers:
        raise UsageError(
            "DataLoader(persistent_workers=True) keeps its workers and their random state "
            "from one epoch to the next, where no checkpoint can reach them, so a resumed run "
            "would differ from an uninterrupted one: pass persistent_workers=False (workers "
            "then start each epoch from the checkpointed random state)")
    if getattr(loader, "in_order", True) is False:
        raise UsageError(
            "DataLoader(in_order=False) hands out batches in the order the workers finish "
            "them, which no checkpoint can repeat, so a resumed run would differ from an "
            "uninterrupted one: leave in_order at its default (True)")


def open_at(loader: Iterable[Any], skip: int, isolate_loads: bool = False,
            ) -> tuple[Iterator[Any], str]:
    """An iterator over ``loader`` whose next batch is batch ``skip`` of the epoch, and how
    the ones before it were passed over ("" when ``skip`` is 0). With ``isolate_loads``, a
    DataLoader's samples loaded in this process draw from streams of their own, as in a
    worker (for a caller that fetches ahead, see :func:`_open_wrapper`).

    The random streams in place when this is called are those the epoch started with; the
    sampler draws its order from them here, as it did in the uninterrupted run.
    """
    why = replay_reason(loader)
    if why is not None:
        iterator = iter(loader)
        return iterator, _replay(iterator, skip, why)
    if wraps_a_loader(loader):
        return _open_wrapper(loader, skip)
    loader = cast(DataLoader, loader)  # what replay_reason lets through is one
    swaps: dict[str, Any] = {}
    if loader.num_workers:
        swaps["dataset"] = SeededSamples(loader.dataset)
    elif isolate_loads:
        swaps["dataset"] = SeededSamples(loader.dataset, in_process_seed=_epoch_seed(loader))
    skipping: _SkipFirst | None = None
    reason = ""
    if skip:
        reason = not_repeatable(loader.dataset,
                                lambda index: seed_streams(sample_seed(0, index)),
                                loader.num_workers, loader.worker_init_fn)
        if not reason:
            field = "batch_sampler" if loader.batch_sampler is not None else "sampler"
            skipping = swaps[field] = _SkipFirst(getattr(loader, field), skip)
    with swapped(loader, swaps):
        iterator = iter(loader)
    if reason and not loader.num_workers:
        # Worker processes get the data set afresh each epoch; the main process keeps it, and
        # the generator it owns has moved on from where a restart re-creates it.
        logger.warning(
            "the data set's own random state is in no checkpoint (%s), so a resume after its "
            "first epoch may differ from an uninterrupted run: keep its generator's state in "
            "ckpt.extras, or draw from torch's global stream", reason.split(":")[0])
    if skipping is None:
        return iterator, _replay(iterator, skip, reason)
    assert skipping.current is not None
    skipping.current.skip_now()  # before the caller restores the streams of the saved step
    return iterator, SKIPPED


def replay_reason(loader: Iterable[Any]) -> str | None:
    """Why a resume inside an epoch of a ``loader`` without a state of its own reads its
    batches again; None where it passes over them by index. Reads its type and fields."""
    if wraps_a_loader(loader):
        base = getattr(loader, "base_dataloader", None)
        if isinstance(base, DataLoader) and not isinstance(base.dataset, IterableDataset):
            return None
        return f"{type(loader).__name__} iterates a loader that is no map-style DataLoader"
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return None
    if isinstance(loader, DataLoader) and usable_state(loader.dataset):
        return ("the IterableDataset has a state_dict(), but each of the DataLoader's worker "
                "processes holds its own copy, out of reach: torchdata's StatefulDataLoader "
                "gathers them")
    return "a stream (an IterableDataset or a plain iterable) without a state of its own"


def replayed_on_resume(loader: Iterable[Any]) -> str | None:
    """:func:`replay_reason`, but None for a list of batches: replayed at no cost."""
    return None if isinstance(loader, collections.abc.Sequence) else replay_reason(loader)


def _open_wrapper(loader: Any, skip: int) -> tuple[Iterator[Any], str]:
    """:func:`open_at` for a wrapper that iterates a DataLoader it holds (Accelerate's
    ``DataLoaderShard``), and fetches one batch ahead of the one it hands out.

    Fetched ahead, batch k+1 is loaded before step k trains, so a checkpoint after step k
    holds streams that loading k+1 already drew from: a resume that loads it again draws
    other numbers. So the samples draw from streams of their own, seeded by the epoch and
    their index (in worker processes as elsewhere), and the training's streams never see a
    load: then passing over the sampler's indices is exact, as for a DataLoader.
    """
    base = loader.base_dataloader  # a map-style DataLoader (open_at replays any other)
    swaps: dict[str, Any] = {"dataset": SeededSamples(base.dataset,
                                                       in_process_seed=_epoch_seed(base))}
    reason = ""
    if skip:
        reason = not_repeatable(base.dataset, lambda index: seed_streams(sample_seed(0, index)),
                                base.num_workers, base.worker_init_fn)
        if not reason:
            field = "batch_sampler" if base.batch_sampler is not None else "sampler"
            swaps[field] = _SkipFirst(getattr(base, field), skip)

    def held() -> Iterator[Any]:
        # The wrapper reads the base loader's fields when its first batch is asked for.
        with swapped(base, swaps):
            yield from loader

    iterator = held()
    if not skip:
        return iterator, ""
    if reason:
        return iterator, _replay(iterator, skip, reason)
    # The sampler draws the epoch's order at the first fetch: while the epoch's streams
    # are in place, before the caller restores those of the saved step.
    try:
        first = next(iterator)
    except StopIteration:
        return iterator, SKIPPED
    return itertools.chain([first], iterator), SKIPPED


def _epoch_seed(loader: DataLoader) -> int:
    """The epoch's seed for samples loaded in this process, drawn as a DataLoader draws its
    workers' seed: from the epoch's streams, so the same again on a resume."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())


def fetches_in_process(loader: Iterable[Any]) -> bool:
    """Whether ``loader`` is a stream whose batches are made in this process (no worker
    processes), drawing from its global random streams as they are fetched."""
    return replay_reason(loader) is not None and not getattr(loader, "num_workers", 0) \
        and not isinstance(loader, collections.abc.Sequence)


class SeededFetches:
    """A stream's batches fetched in this process by a caller that fetches ahead (a
    framework): each draws its randomness from streams seeded by the epoch's ``seed`` and the
    batch's number, which are put back afterwards. A batch is then the same whenever it is
    fetched, before a checkpoint's streams were captured or after the resume restored them, as
    :class:`SeededSamples` makes a map-style data set's samples. ``first``: the number of the
    first batch it hands out."""

    def __init__(self, inner: Iterator[Any], seed: int, first: int) -> None:
        self._inner, self._seed, self._index = inner, seed, first

    def __iter__(self) -> SeededFetches:
        return self

    def __next__(self) -> Any:
        with streams_kept():
            seed_streams(sample_seed(self._seed, self._index))
            item = next(self._inner)
        self._index += 1
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SeededSamples(Dataset):
    """A map-style data set whose samples, loaded in a worker process, draw their randomness
    from streams seeded by the epoch's worker seed and the sample's index alone.

    With ``in_process_seed``, samples loaded in this process too, from that seed; there the
    streams are put back after each sample, so that loading draws nothing from them.
    """

    def __init__(self, dataset: Any, in_process_seed: int | None = None) -> None:
        self.dataset = dataset
        self.in_process_seed = in_process_seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        info = get_worker_info()
        if info is not None:
            # torch gives worker k the seed base + k; the base alone is the same whichever
            # worker loads the sample, which a resume changes.
            seed_streams(sample_seed(info.seed - info.id, index))
        elif self.in_process_seed is not None:
            with streams_kept():
                seed_streams(sample_seed(self.in_process_seed, index))
                return self.dataset[index]
        return self.dataset[index]

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        batched = getattr(self.dataset, "__getitems__", None)
        if not batched or not indices:
            return [self[i] for i in indices]
        info = get_worker_info()
        if info is not None:
            seed_streams(sample_seed(info.seed - info.id, indices[0]))
        elif self.in_process_seed is not None:
            with streams_kept():
                seed_streams(sample_seed(self.in_process_seed, indices[0]))
                return batched(indices)
        return batched(indices)

    def __getattr__(self, name: str) -> Any:
        # A worker_init_fn may look at the data set's attributes; pickling (spawn) must not
        # recurse into a half-built object.
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # get_worker_info().dataset is this wrapper in a worker: what a worker_init_fn sets
        # there (a shard's range, a file handle, a generator) is the user's data set's.
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.dataset, name)


#: SeededSamples' own attributes; every other one is its data set's.
_OWN = frozenset({"dataset", "in_process_seed"})


def sample_seed(base: int, index: Any) -> int:
    """A 64-bit seed from an epoch's worker seed and a sample's index (stable across
    processes, unlike ``hash()`` of a string)."""
    try:
        key = str(operator.index(index))
    except TypeError:
        key = repr(index)
    digest = hashlib.blake2b(f"{base}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def seed_streams(seed: int) -> None:
    """Seed torch's CPU, Python's and (when imported) NumPy's global streams.

    ``torch.default_generator.manual_seed`` rather than ``torch.manual_seed``: the latter also
    seeds every accelerator and costs ~100x more, per sample.
    """
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFF_FFFF)


@contextlib.contextmanager
def streams_kept() -> Iterator[None]:
    """Put torch's CPU, Python's and NumPy's global streams back as they were."""
    np = sys.modules.get("numpy")
    saved = (torch.get_rng_state(), random.getstate(),
             np.random.get_state() if np is not None else None)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if np is not None and saved[2] is not None:
            np.random.set_state(saved[2])


def advance(iterator: Iterator[Any], skip: int, already: int = 0, of: int | None = None,
            ) -> None:
    """Take ``skip`` items (batches, or the sampler's index lists) from ``iterator``, of the
    ``of`` the checkpoint's position needs, ``already`` taken before.

    Raises:
        UsageError: it ran out first: the data is not what the checkpoint was taken on.
    """
    for done in range(already, already + skip):
        try:
            next(iterator)
        except StopIteration:
            raise UsageError(
                f"the data loader ran out after {done} batches, but the checkpoint was taken "
                f"after batch {of or skip} of this epoch: did the data set or batch size "
                "change? Use a new checkpoint dir to start over.") from None


def wraps_a_loader(loader: object) -> bool:
    """Whether ``loader`` passes for a DataLoader without being one: Accelerate's
    ``DataLoaderShard`` answers ``isinstance`` through a ``__class__`` property and iterates
    the DataLoader it holds, so fields set on it never reach the loader that reads."""
    return isinstance(loader, DataLoader) and not issubclass(type(loader), DataLoader)


def usable_state(loader: object) -> bool:
    """Whether ``loader`` can be put back where it was through its own
    ``state_dict()``/``load_state_dict()``. Having the methods is not enough: Accelerate's
    ``DataLoaderShard`` has both, and its ``state_dict()`` raises when the DataLoader it
    wraps keeps no state; such a loader is resumed as a plain one."""
    if getattr(loader, "_procckpt_positioned", False):
        return False  # its state_dict() is for a framework that asks (see driven.py)
    if not (callable(getattr(loader, "state_dict", None))
            and callable(getattr(loader, "load_state_dict", None))):
        return False
    try:
        loader.state_dict()  # type: ignore[attr-defined]
    except Exception as e:  # whatever it raises, it cannot be saved
        logger.debug("%s.state_dict() fails (%s: %s): resumed as a plain loader",
                     type(loader).__name__, type(e).__name__, e)
        return False
    return True


def stateful_source(loader: object) -> Any:
    """What puts ``loader`` back where it was by its own state, or None: the loader itself
    (torchdata's ``StatefulDataLoader``, a stateful iterator of the script's own), or, for a
    ``DataLoader`` without worker processes over an ``IterableDataset`` that has
    ``state_dict()``/``load_state_dict()`` (a sharded stream that counts its own position,
    Hugging Face's streaming ``datasets``), the data set: without workers the DataLoader reads
    a batch's samples when the batch is asked for, so at a safe point the data set's state is
    exactly after the batches trained on. (With workers, each holds its own copy of the data
    set, out of reach: :func:`open_at` replays and says to use ``StatefulDataLoader``.)"""
    if usable_state(loader):
        return loader
    if isinstance(loader, DataLoader) and not wraps_a_loader(loader) \
            and isinstance(loader.dataset, IterableDataset) and not loader.num_workers \
            and usable_state(loader.dataset):
        return loader.dataset
    return None


def align_epoch(loader: object, epoch: int) -> None:
    """Tell a loader that counts its own passes (Accelerate's ``DataLoaderShard``: its
    ``iteration`` picks a seedable sampler's order) which epoch this is: a resumed process
    creates it afresh at pass 0, where the uninterrupted run was at ``epoch``."""
    if wraps_a_loader(loader) and isinstance(getattr(loader, "iteration", None), int) \
            and callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(epoch)  # type: ignore[attr-defined]


def loader_generators(loader: object) -> list[torch.Generator]:
    """Generators a DataLoader draws its order from besides torch's global one: its own, and
    its samplers' (a few levels down: Accelerate's ``BatchSamplerShard`` holds the batch
    sampler that holds the sampler whose generator it seeded), in a fixed order."""
    found: list[torch.Generator] = []

    def visit(owner: object, depth: int) -> None:
        if owner is None or depth > 3:
            return
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
        for name in ("sampler", "batch_sampler"):
            visit(getattr(owner, name, None), depth + 1)

    visit(loader, 0)
    return found


# -- internals -------------------------------------------------------------------------------
#: After this long into a replay, it says how long the rest will take; then, this often, how
#: far it got (a replay of hours of streamed data must not look like a hang).
REPLAY_ESTIMATE_AFTER = 1.0
REPLAY_PROGRESS_EVERY = 30.0
REPLAY_HINT = ("to resume without reading them again, give the data set state_dict() and "
               "load_state_dict() and load it with torchdata's StatefulDataLoader, or use a "
               "map-style data set")


def _replay(iterator: Iterator[Any], skip: int, why: str,
            clock: Callable[[], float] = time.monotonic) -> str:
    """Produce the first ``skip`` batches again and drop them; say so and why. After a second,
    say how long the rest will take at the rate so far, and then every half minute how far
    it got."""
    if not skip:
        return ""
    started = last_said = clock()
    estimated = False
    for done in range(1, skip + 1):
        advance(iterator, 1, already=done - 1, of=skip)
        now = clock()
        if done == skip:
            break
        if not estimated and now - started >= REPLAY_ESTIMATE_AFTER:
            estimated, last_said = True, now
            rate = done / (now - started)
            logger.warning("replaying the %d batches trained before the restart (%s): about %s "
                           "at %.3g batches/s; %s", skip, why,
                           format_duration((skip - done) / rate), rate, REPLAY_HINT)
        elif estimated and now - last_said >= REPLAY_PROGRESS_EVERY:
            last_said = now
            rate = done / (now - started)
            logger.info("replayed %d of %d batches, about %s left", done, skip,
                        format_duration((skip - done) / rate))
    return (f"replayed the {skip} batches trained before the restart ({why}: its cost grows "
            "with the position)")


@contextlib.contextmanager
def swapped(loader: DataLoader, swaps: dict[str, Any]) -> Iterator[None]:
    """Give ``loader`` other values for fields it freezes after construction, for the
    creation of one iterator (which keeps what it read); then put them back."""
    saved = {name: getattr(loader, name) for name in swaps}
    try:
        for name, value in swaps.items():
            object.__setattr__(loader, name, value)
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(loader, name, value)


class _SkipFirst:
    """A sampler (or batch sampler) whose iterators pass over their first ``skip`` items."""

    def __init__(self, sampler: Iterable[Any], skip: int) -> None:
        self.sampler, self.skip = sampler, skip
        #: The newest iterator: a DataLoader iterator opens one, then opens it again.
        self.current: _SkippingIterator | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> _SkippingIterator:
        self.current = _SkippingIterator(iter(self.sampler), self.skip)
        return self.current


class _SkippingIterator:
    """Skips on the first ``next()`` (a worker loader's first prefetch), or when told."""

    def __init__(self, inner: Iterator[Any], skip: int) -> None:
        self._inner, self._skip = inner, skip

    def skip_now(self) -> None:
        if self._skip:
            skip, self._skip = self._skip, 0
            advance(self._inner, skip)

    def __iter__(self) -> _SkippingIterator:
        return self

    def __next__(self) -> Any:
        self.skip_now()
        return next(self._inner)
