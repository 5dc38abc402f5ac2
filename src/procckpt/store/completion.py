"""Whether a run finished (``COMPLETE``), and ``--force``'s archive of an earlier run."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .files import fsync_dir, read_small_file, write_file_atomic

__all__ = ["Completion", "COMPLETE", "AUDIT_DIR"]

COMPLETE = "COMPLETE"
#: Where the training records the batch that follows each checkpoint (training/audit.py).
AUDIT_DIR = "audit"


class Completion:
    """The completion marker of a checkpoint dir (a part of :class:`CheckpointStore`)."""

    root: Path
    ckpt_root: Path
    complete_path: Path
    remote: Any
    _ckpt_dirs: Callable[..., list[Path]]
    _record: Callable[..., None]

    def completion(self) -> dict[str, Any] | None:
        """What the finished run noted in ``COMPLETE``; None while training is not done
        (with a remote dir, its ``COMPLETE`` counts too: the run may have ended elsewhere)."""
        try:
            record = json.loads(read_small_file(self.complete_path))
        except FileNotFoundError:
            return None if self.remote is None else self.remote.completion()
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict):
            return record
        try:
            return {"time": os.lstat(self.complete_path).st_mtime}
        except OSError:
            return {"time": time.time()}

    def mark_complete(self, **fields: Any) -> None:
        record = json.dumps({"time": time.time(), **fields}).encode()
        write_file_atomic(self.complete_path, record)
        if self.remote is not None:
            self.remote.mark_complete(record)

    def archive(self) -> Path | None:
        """Move checkpoints and the completion marker into ``previous-<time>/`` (for --force):
        training starts anew without deleting what an earlier run produced."""
        if not self._ckpt_dirs(include_bad=True) and not self.complete_path.exists():
            return None
        if self.remote is not None:
            raise StoreError(f"--force cannot archive the checkpoints in {self.remote.url}: "
                             "give the new run a new prefix instead")
        dest = self.root / time.strftime("previous-%Y%m%d-%H%M%S")
        dest.mkdir()
        os.rename(self.ckpt_root, dest / "checkpoints")
        if (self.root / AUDIT_DIR).exists():  # the batches after those checkpoints go with them
            os.rename(self.root / AUDIT_DIR, dest / AUDIT_DIR)
        if self.complete_path.exists():
            os.rename(self.complete_path, dest / COMPLETE)
        self.ckpt_root.mkdir()
        fsync_dir(self.root)
        self._record("archive", to=dest.name)  # a new run starts here
        return dest
