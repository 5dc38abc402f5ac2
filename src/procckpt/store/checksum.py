"""CRC-32 of checkpoint files, as fast as this machine allows.

Every byte of a checkpoint passes through CRC-32 twice in its life: once while it is written
(for the manifest) and once before it is loaded (to catch a damaged file). zlib's CRC-32 runs
at about 3 GB/s here, the same order as the disk, so it is a real part of a checkpoint's
cost. ISA-L's implementation (the optional ``isal`` package) computes the same polynomial with
carry-less multiplication, several times faster; both release the GIL for large buffers, so
a writer thread can checksum while the training thread runs.

The two give identical results: a checkpoint written with one verifies with the other.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["crc32", "IMPLEMENTATION", "ENV_CRC"]

#: ``PROCCKPT_CRC=zlib`` forces zlib's implementation (to compare the two).
ENV_CRC = "PROCCKPT_CRC"

crc32: Callable[[Any, int], int] = zlib.crc32
IMPLEMENTATION = "zlib"
if os.environ.get(ENV_CRC, "").strip().lower() != "zlib":
    try:
        from isal.isal_zlib import crc32 as _isal_crc32
    except ImportError:  # the optional extra (procckpt[fast]) is not installed
        pass
    else:
        crc32 = _isal_crc32
        IMPLEMENTATION = "isal"
