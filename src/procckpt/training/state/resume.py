"""Finding the checkpoint to resume from: the newest that verifies and loads, falling back loudly.

The payload is memory-mapped, not read into fresh memory: its tensors are views of the page
cache until ``load_state_dict`` copies them into the model, so a restore never holds the state
twice. Its checksum is computed on the same mapping while the state loads (one read of the
file); a checkpoint that fails it is quarantined and the next older one is loaded over it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ...errors import CheckpointCorruptError, CheckpointReadError, UsageError
from ...protocol.events import append_event
from ...store import CheckpointInfo, CheckpointStore, read_with_retries
from .. import group as dist_
from ..link.context import force_requested
from ..position.resplit import resplit_position
from .first_step import restored_state
from .mapped import MappedVerification, private_copy
from .payload import PAYLOAD, Stateful, load_statefuls, read_payload

__all__ = ["load_newest_verified", "single_process_view", "announce_resume", "resume_newest",
           "apply_payload", "finished_already"]

logger = logging.getLogger(__name__)

#: Loads a payload into the statefuls; returns the payload as the caller should keep using it.
Apply = Callable[[CheckpointInfo, dict[str, Any]], dict[str, Any]]


def load_newest_verified(store: CheckpointStore, apply: Apply,
                         ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """Apply the newest checkpoint that verifies *and* loads safely; None if there is none.

    Raises:
        CheckpointReadError: a file cannot be read (the storage's fault): nothing is renamed.
        CheckpointCorruptError: there are checkpoints, but none can be loaded.
    """
    started = time.monotonic()
    # The payload's checksum is verified on the mapping below, before any of it is used; the
    # other files (if any) and all sizes are checked here.
    for info in store.intact_setting_aside_damaged(skip_crc=frozenset({PAYLOAD}),
                                                   hash_chunks=False):  # read_payload does
        try:
            payload = read_with_retries(info.file(PAYLOAD),
                                        lambda: read_payload(info, mmap=True))  # noqa: B023
        except CheckpointReadError:
            raise  # the storage failed, not the checkpoint: stop, rename nothing
        except Exception as e:  # UnpicklingError for a foreign pickle, and worse
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            store.quarantine(info.path, f"it cannot be loaded safely ({reason})")
            continue
        mapped = time.monotonic()
        expect = info.manifest["files"].get(PAYLOAD, {})
        check = MappedVerification(payload, info.file(PAYLOAD), int(expect.get("bytes", -1)),
                                   int(expect.get("crc32", -1)))
        try:
            # Loading runs alongside the checksum. If the checksum then fails, the next
            # checkpoint's load overwrites all of it, or we give up.
            with _a_core_left_for(check):
                payload = apply(info, payload)
        except Exception:
            if check.result() is None:
                raise  # a genuine mismatch between script and checkpoint
        problem = check.result()
        if check.read_error is not None:
            error = check.read_error
            raise CheckpointReadError(
                f"cannot read {info.file(PAYLOAD)}: {error.strerror or error}; nothing was "
                "renamed or deleted: fix the file system and run again")
        if problem is not None:
            del payload
            store.quarantine(info.path, problem)
            continue
        logger.debug("%s mapped in %.2fs, loaded and verified in %.2fs", info.name,
                     mapped - started, time.monotonic() - mapped)
        return info, payload
    if any(store.ckpt_root.glob("ckpt-*")):
        raise CheckpointCorruptError(
            f"no checkpoint in {store.ckpt_root} can be loaded (see the warnings above);"
            " refusing to start from scratch: move the directory away to train anew")
    return None


@contextlib.contextmanager
def _a_core_left_for(check: MappedVerification) -> Iterator[None]:
    """Torch's intra-op threads one fewer while ``check``'s thread checksums the file.

    A load's copies are split over all of them; one that shares a core with the checksum
    finishes last, and every copy waits for it. On two cores, a 64-MB restore took 33 ms with
    both threads and 27-29 with one (BENCHMARKS.md)."""
    threads = torch.get_num_threads()
    if threads < 2 or not check.running():
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def announce_resume(store: CheckpointStore | None, info: CheckpointInfo,
                    position: tuple[int, int, int], restart: int, seconds: float) -> None:
    """Log the resume, and journal it in ``store`` (the writing rank's) for ``procckpt status``."""
    epoch, batch, step = position
    if store is not None:
        append_event(store.events_path, "resume", checkpoint=info.name, step=step, epoch=epoch,
                     batch=batch, restart=restart, bytes=info.nbytes, seconds=round(seconds, 4))
    # A steps() loop counts steps alone: its epoch and batch stay 0.
    where = f"step {step}" if (epoch, batch) == (0, 0) and step else \
        f"epoch {epoch}, batch {batch}, step {step}"
    logger.info("resumed from %s: %s (restart %d); %.1f MB restored in %.2fs", info.name, where,
                restart, info.nbytes / 1e6, seconds)


def single_process_view(info: CheckpointInfo, payload: dict[str, Any],
                        statefuls: Mapping[str, Stateful], allow_reshard: bool,
                        ) -> dict[str, Any]:
    """A checkpoint read outside a process group: refuse (or reshard) one of several ranks,
    and load its sharded state; return the payload with its position rescaled if needed."""
    saved_world = int(info.manifest.get("world_size", 1) or 1)
    if saved_world != 1:
        dist_.check_world_size(info, saved_world, 1, allow_reshard)
        payload = resplit_position(payload, saved_world, 1)
    dist_.load_sharded_state(statefuls, info, use_group=False)
    return payload


def resume_newest(ck: Any) -> CheckpointInfo | None:
    """Restore Checkpointer ``ck`` from its newest verified checkpoint (in a group, the one
    every rank has); None when there is none to resume."""
    started = time.monotonic()
    if ck._dist is not None:
        loaded = ck._dist.load_latest(ck._member)  # collective; the payload is read plainly
        if loaded is not None:
            loaded = loaded[0], apply_payload(ck, *loaded)
    elif not ck.is_writer and not ck.store.ckpt_root.is_dir():
        return None
    else:
        loaded = ck._load_latest()  # verified, memory-mapped and applied
    if loaded is None:
        return None
    info, mapped = loaded
    # What procckpt keeps of the payload gets memory of its own; the rest stays mapped.
    payload = private_copy({k: mapped.get(k) for k in ("progress", "extras", "rng",
                                                        "epoch_rng", "loader_state")})
    del mapped
    ck._progress.resume(payload["progress"], payload["rng"], payload["epoch_rng"],
                        payload.get("loader_state"))
    ck.best_metric = payload["progress"].get("best_metric")
    ck.extras = dict(payload.get("extras") or {})
    ck._saves.saved_at = ck._progress.position
    saved_restart = info.manifest.get("restart")
    if isinstance(saved_restart, int):  # a rerun by hand is a restart too
        ck.restart = max(ck.restart, saved_restart + 1)
    ck._saves.last = info
    ck.restore_seconds = time.monotonic() - started
    announce_resume(ck.store if ck.is_writer else None, info, ck._progress.position,
                    ck.restart, ck.restore_seconds)
    return info


def apply_payload(ck: Any, info: CheckpointInfo, payload: dict[str, Any]) -> dict[str, Any]:
    """Load Checkpointer ``ck``'s statefuls from a (possibly memory-mapped) payload; return
    the payload, its position rescaled if it was written by another number of ranks."""
    if ck._dist is None:
        payload = single_process_view(info, payload, ck._statefuls, ck.allow_reshard)
    prints: dict[int, tuple[int, int]] | None = {} if ck._audit.on else None
    ck._written_over = load_statefuls(info, payload, ck._statefuls, prints)
    if prints is not None:  # the state as restored, for the first step's audit (first_step.py)
        ck._restored_state = restored_state(ck._statefuls, payload, prints)
    return payload


def finished_already(store: CheckpointStore, token: str | None, is_writer: bool) -> bool:
    """Whether the run in ``store`` finished (``COMPLETE``), so that the loops train no more.

    Alone, a finished run trains nothing and says so, unless ``PROCCKPT_FORCE=1`` (then its
    checkpoints are archived and training starts anew). Launched, the launcher has decided
    already (it refuses a finished run; ``--force`` archives), but a second training of the
    same command (``token``) would resume from the first one's final checkpoint: refused.

    Raises:
        UsageError: a second training started in the same run after the first ended.
    """
    complete = store.completion()
    if complete is None:
        return False
    step = "" if complete.get("step") is None else f" (step {complete['step']})"
    if token and complete.get("token") == token:
        raise UsageError(
            f"a training in this command already finished in {store.root}{step}, and another "
            "one started with the same checkpoint dir; it would resume from the first one's "
            "final checkpoint: give each training its own dir (procckpt run --dir A -- python "
            "pretrain.py, then procckpt run --dir B -- python finetune.py)")
    if token:
        return False
    if force_requested():
        if is_writer:
            logger.info("PROCCKPT_FORCE: the finished run's checkpoints moved to %s; training "
                        "starts anew", store.archive())
        return False
    if is_writer:
        logger.info("the run in %s already finished%s; nothing to train. Set PROCCKPT_FORCE=1 "
                    "(or use a new dir) to train again", store.root, step)
    return True
