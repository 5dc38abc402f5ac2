"""The checkpoint directory: atomic, verified, keep-N checkpoints, the lock and the markers.
Used by both sides; imports neither."""

from .directory import COMPLETE, MARKER, CheckpointStore
from .files import (
    file_crc32,
    fsync_dir,
    lasting_write_error,
    read_small_file,
    read_with_retries,
    write_file_atomic,
)
from .lock import DirLock
from .manifest import FORMAT_VERSION, MANIFEST, CheckpointInfo
from .pending import PendingCheckpoint

__all__ = ["FORMAT_VERSION", "MANIFEST", "MARKER", "COMPLETE", "CheckpointInfo",
           "CheckpointStore", "DirLock", "PendingCheckpoint", "lasting_write_error",
           "read_small_file", "read_with_retries", "fsync_dir", "write_file_atomic",
           "file_crc32"]
