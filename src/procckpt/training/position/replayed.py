"""Whether a resume inside an epoch reads a loader's batches again, told before the first run trains."""

from __future__ import annotations

import collections.abc
from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from .loaders import usable_state, wraps_a_loader

__all__ = ["replayed_on_resume"]


def replayed_on_resume(loader: Iterable[Any]) -> str | None:
    """Why a resume inside an epoch of ``loader`` (one without a state of its own: see
    :func:`stateful_source`) will read the batches before it again, or None where it passes
    over them by index. Reads only the loader's type and fields: nothing is loaded. A list
    or other sequence of batches is replayed too, at no cost worth a word."""
    if isinstance(loader, collections.abc.Sequence):
        return None
    if wraps_a_loader(loader):
        base = getattr(loader, "base_dataloader", None)
        if isinstance(base, DataLoader) and not isinstance(base.dataset, IterableDataset):
            return None
        return f"{type(loader).__name__} iterates a loader that is no map-style DataLoader"
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return None
    if isinstance(loader, DataLoader) and usable_state(loader.dataset):
        return ("its IterableDataset has a state_dict(), but each of the DataLoader's worker "
                "processes holds its own copy, out of reach")
    return "a stream (an IterableDataset or a plain iterable) without a state of its own"
