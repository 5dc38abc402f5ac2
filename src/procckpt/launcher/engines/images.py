"""What the two image engines (DMTCP, CRIU) share: their images are checkpoints of the store,
and the one a cycle restores is the newest intact one that has not failed to restore."""

from __future__ import annotations

from ...errors import ProcckptError, UsageError
from ...store import CheckpointInfo, CheckpointStore

__all__ = ["newest_image"]


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
