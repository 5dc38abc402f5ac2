"""What the two image engines (DMTCP, CRIU) share: their images are checkpoints of the store,
the one a cycle restores is the newest intact one that has not failed to restore, and a
restored command that a fault ends at once failed to restore too."""

from __future__ import annotations

import signal

from ...errors import ProcckptError, UsageError
from ...store import CheckpointInfo, CheckpointStore

__all__ = ["newest_image", "fault_after_restore", "FAULT_AFTER_RESTORE_S"]

#: Signals of a fault: a restored command that one ends within FAULT_AFTER_RESTORE_S of its
#: restore, before any image of its own, is a failed restore of that image.
_FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                     signal.SIGABRT})
FAULT_AFTER_RESTORE_S = 30.0


def newest_image(store: CheckpointStore, engine: str, title: str, failed: set[str],
                 error: type[ProcckptError], quiet: bool = False) -> CheckpointInfo | None:
    """The newest intact checkpoint of ``engine`` not in ``failed``; checksums are verified
    first (a truncated image must never be restored), damaged ones set aside.

    Raises:
        UsageError: the newest checkpoint was written by another engine.
        ``error``: every image failed to restore (unless ``quiet``): no fresh start over them.
    """
    for info in store.intact_setting_aside_damaged():
        written_by = info.manifest.get("engine")
        if written_by != engine:
            raise UsageError(
                f"the newest checkpoint in {store.root} ({info.name}) was written by the "
                f"{written_by} engine, not by {title}: run with --engine {written_by}, or "
                "use a new --dir")
        if info.name not in failed:
            return info
    if failed and not quiet:
        raise error(f"every {title} image in {store.ckpt_root} failed to restore "
                    f"({', '.join(sorted(failed))}); refusing to start from scratch: move the "
                    "directory away to train anew")
    return None


def fault_after_restore(exit_code: int, signalled: bool, ran_for: float) -> str | None:
    """The fault (``SIGSEGV``, ...) that ended a restored command ``ran_for`` seconds after
    its restore, within :data:`FAULT_AFTER_RESTORE_S`; None for any other end, and for a
    signal the launcher passed on (``signalled``).

    Seen with DMTCP in CI under load (2026-12-01): an image of 634 MB, taken moments after
    the restored process it images ran again, died of SIGSEGV 3 s into every restart of it,
    while the image before it restarted and trained on. Ended there, the run would need a
    person; falling back costs the work between the two images. A fault of the command's
    own, soon after every restore, falls back image by image to the oldest and then ends the
    run with the usual error. The engine tells whether the command began an image of its
    own since (then the fault is the command's)."""
    signum = exit_code - 128 if exit_code > 128 else 0
    if signalled or signum not in _FAULTS or not 0 <= ran_for <= FAULT_AFTER_RESTORE_S:
        return None
    return signal.Signals(signum).name
