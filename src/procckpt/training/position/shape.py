"""What a resume's position in an epoch depends on (the batch size, the batches of an epoch, the
samples), and the position mapped onto a loader whose batch size changed since the checkpoint."""

from __future__ import annotations

from typing import Any

from ...errors import UsageError

__all__ = ["loader_shape", "map_position"]


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
