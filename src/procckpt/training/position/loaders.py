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

import contextlib
import hashlib
import itertools
import logging
import operator
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ...errors import UsageError
from .probe import not_repeatable

__all__ = ["check_loader", "open_at", "advance", "loader_generators", "SeededSamples",
           "loader_shape", "map_position", "wraps_a_loader", "usable_state",
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
    if wraps_a_loader(loader):
        return _open_wrapper(loader, skip)
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        iterator = iter(loader)
        return iterator, _replay(iterator, skip, "an IterableDataset or a plain iterable")
    swaps: dict[str, Any] = {}
    if loader.num_workers:
        swaps["dataset"] = SeededSamples(loader.dataset)
    elif isolate_loads:
        swaps["dataset"] = SeededSamples(loader.dataset, in_process_seed=_epoch_seed(loader))
    skipping: _SkipFirst | None = None
    reason = ""
    if skip:
        reason = not_repeatable(loader.dataset,
                                lambda index: seed_streams(sample_seed(0, index)))
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


def _open_wrapper(loader: Any, skip: int) -> tuple[Iterator[Any], str]:
    """:func:`open_at` for a wrapper that iterates a DataLoader it holds (Accelerate's
    ``DataLoaderShard``), and fetches one batch ahead of the one it hands out.

    Fetched ahead, batch k+1 is loaded before step k trains, so a checkpoint after step k
    holds streams that loading k+1 already drew from: a resume that loads it again draws
    other numbers. So the samples draw from streams of their own, seeded by the epoch and
    their index (in worker processes as elsewhere), and the training's streams never see a
    load: then passing over the sampler's indices is exact, as for a DataLoader.
    """
    base = getattr(loader, "base_dataloader", None)
    name = type(loader).__name__
    if not isinstance(base, DataLoader) or isinstance(base.dataset, IterableDataset):
        iterator = iter(loader)
        return iterator, _replay(iterator, skip, f"{name} iterates a loader that is no "
                                 "map-style DataLoader")
    swaps: dict[str, Any] = {"dataset": SeededSamples(base.dataset,
                                                       in_process_seed=_epoch_seed(base))}
    reason = ""
    if skip:
        reason = not_repeatable(base.dataset, lambda index: seed_streams(sample_seed(0, index)))
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
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


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


def advance(iterator: Iterator[Any], skip: int) -> None:
    """Take ``skip`` items (batches, or the sampler's index lists) from ``iterator``.

    Raises:
        UsageError: it ran out first: the data is not what the checkpoint was taken on.
    """
    for done in range(skip):
        try:
            next(iterator)
        except StopIteration:
            raise UsageError(
                f"the data loader ran out after {done} batches, but the checkpoint was taken "
                f"after batch {skip} of this epoch: did the data set or batch size change? Use "
                "a new checkpoint dir to start over.") from None


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


def align_epoch(loader: object, epoch: int) -> None:
    """Tell a loader that counts its own passes (Accelerate's ``DataLoaderShard``: its
    ``iteration`` picks a seedable sampler's order) which epoch this is: a resumed process
    creates it afresh at pass 0, where the uninterrupted run was at ``epoch``."""
    if wraps_a_loader(loader) and isinstance(getattr(loader, "iteration", None), int) \
            and callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(epoch)  # type: ignore[attr-defined]


def loader_shape(loader: object) -> dict[str, int | None]:
    """What a resume's position depends on: the batch size, the batches of an epoch and the
    samples (None where the loader does not say)."""
    def size(obj: object) -> int | None:
        try:
            return len(obj)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return None

    batch_size = getattr(loader, "batch_size", None)
    return {"batch_size": batch_size if isinstance(batch_size, int) else None,
            "batches": size(loader), "samples": size(getattr(loader, "dataset", None))}


def map_position(saved: dict[str, Any] | None, now: dict[str, int | None], skip: int,
                 ) -> tuple[int, str | None]:
    """The batches to pass over for a checkpoint taken after batch ``skip`` of a loader of the
    ``saved`` shape, in a loader of shape ``now``; and what to say about it (None: nothing
    changed).

    Raises:
        UsageError: the samples trained on are no whole number of the new batches.
    """
    if not saved or not skip:
        return skip, None
    old_bs, new_bs = saved.get("batch_size"), now["batch_size"]
    notes = []
    if old_bs and new_bs and old_bs != new_bs:
        trained = skip * old_bs
        if trained % new_bs:
            raise UsageError(
                f"the batch size changed from {old_bs} to {new_bs} since the checkpoint, taken "
                f"after {skip} batches ({trained} samples) of this epoch, and {trained} samples "
                f"are no whole number of batches of {new_bs}: resume with batch size {old_bs}, "
                "or use a new checkpoint dir to start over")
        notes.append(f"the batch size changed from {old_bs} to {new_bs} since the checkpoint: "
                     f"passing over {trained // new_bs} batches of {new_bs} (the {trained} "
                     f"samples trained on), not {skip}")
        skip = trained // new_bs
    inexact = ("the batches passed over are not the ones trained on, so the resume is not "
               "exact; use a new checkpoint dir to start over")
    old_n, new_n = saved.get("samples"), now["samples"]
    old_b, new_b = saved.get("batches"), now["batches"]
    if old_n is not None and new_n is not None and old_n != new_n:
        notes.append(f"the data set has {new_n} samples, {old_n} when the checkpoint was "
                     f"taken: {inexact}")
    elif not notes and old_b is not None and new_b is not None and old_b != new_b:
        notes.append(f"the data loader has {new_b} batches an epoch, {old_b} when the "
                     f"checkpoint was taken: {inexact}")
    return skip, "; ".join(notes) or None


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
def _replay(iterator: Iterator[Any], skip: int, why: str) -> str:
    """Produce the first ``skip`` batches again and drop them; say so and why."""
    if not skip:
        return ""
    advance(iterator, skip)
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
