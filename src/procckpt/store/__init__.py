"""The checkpoint directory: atomic, verified, keep-N checkpoints, the lock and the markers.
Used by both sides; imports neither."""

from .store import (FORMAT_VERSION, MANIFEST, CheckpointInfo, CheckpointStore, DirLock,
                    PendingCheckpoint, lasting_write_error, read_small_file, read_with_retries)

__all__ = ["FORMAT_VERSION", "MANIFEST", "CheckpointInfo", "CheckpointStore", "DirLock",
           "PendingCheckpoint", "lasting_write_error", "read_small_file", "read_with_retries"]
