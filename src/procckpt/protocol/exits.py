"""How a training process tells its launcher that procckpt, not the script, ended it.

procckpt's own exit codes (65: no usable checkpoint, 66: the resume audit refused, 74: the
checkpoint dir's storage failed) are ordinary numbers a script may exit with too, and under
torchrun a rank's code does not come through at all (torchrun exits 1). So a training process
that procckpt ends with one of them leaves a note: ``exit-<rank>.json`` (the code, the one-line
error) in a folder the launcher makes for each cycle and names in ``PROCCKPT_EXITS``. The
folder is in memory (``/dev/shm`` where there is one), not in the checkpoint dir: a full disk
is one of the reasons to leave a note.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from .leftovers import make_owned_dir, sweep_dead

__all__ = ["ENV_EXITS", "ExitNotes", "leave_exit_note"]

ENV_EXITS = "PROCCKPT_EXITS"
_PREFIX = "exit-"
_DIR_PREFIX = "procckpt-exits-"
#: Where a launcher's notes folder goes, first that is a writable directory.
_MEMORY = ("/dev/shm",)


class ExitNotes:
    """The launcher's side: a fresh folder for one cycle's notes, read after it ended."""

    def __init__(self) -> None:
        where = next((d for d in _MEMORY if os.path.isdir(d) and os.access(d, os.W_OK)), None)
        root = Path(where or tempfile.gettempdir())
        sweep_dead(root, _DIR_PREFIX)  # what killed launchers left
        self.dir = make_owned_dir(root, _DIR_PREFIX)

    def read(self) -> list[dict[str, Any]]:
        """The notes the cycle's ranks left, by rank."""
        notes = []
        with contextlib.suppress(OSError):
            for path in sorted(self.dir.glob(f"{_PREFIX}*.json")):
                with contextlib.suppress(OSError, ValueError):
                    note = json.loads(path.read_text())
                    if isinstance(note, dict) and isinstance(note.get("code"), int):
                        notes.append(note)
        return notes

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def leave_exit_note(rank: int, code: int, error: str) -> None:
    """The training's side: say that procckpt ends this rank with ``code`` (nothing when not
    launched by ``procckpt run``, or when even memory takes no file)."""
    folder = os.environ.get(ENV_EXITS)
    if not folder:
        return
    note = {"rank": rank, "code": code, "error": error[:2000], "host": socket.gethostname(),
            "pid": os.getpid()}
    path = Path(folder) / f"{_PREFIX}{rank}.json"
    with contextlib.suppress(OSError):
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(note))
        os.replace(tmp, path)
