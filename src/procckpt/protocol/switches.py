"""On/off switches the training reads from its environment, checked by the launcher first."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["Switch", "ASYNC", "OVERLAP", "DIRECT_IO", "FROZEN_ONCE", "TRAINING_SWITCHES"]

_ON = ("", "1", "true", "yes", "on")  # unset is on: every switch here defaults to on
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """An environment variable that turns a default-on behaviour off with 0."""

    name: str
    on: str  # what 1 does, in the error message's words
    off: str  # what 0 does

    def read(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the switch is on (it is, unset).

        Raises:
            UsageError: a value that is neither on nor off, with what each one does.
        """
        value = (os.environ if environ is None else environ).get(self.name, "").strip().lower()
        if value in _ON:
            return True
        if value in _OFF:
            return False
        raise UsageError(f"bad {self.name}={value!r}: expected 1 ({self.on}) or 0 ({self.off})")


ASYNC = Switch("PROCCKPT_ASYNC", on="write checkpoints in the background",
               off="write them synchronously")
OVERLAP = Switch("PROCCKPT_OVERLAP", on="copy GPU state beside the next forward and backward",
                 off="wait for the whole copy at the safe point")
DIRECT_IO = Switch("PROCCKPT_DIRECT_IO", on="write checkpoint files around the page cache "
                   "where the file system allows", off="write them through the page cache")
FROZEN_ONCE = Switch("PROCCKPT_FROZEN_ONCE", on="store frozen parameters once, in chunks "
                     "that checkpoints share", off="write them into every checkpoint")
#: What the launcher checks before it starts the command.
TRAINING_SWITCHES = (ASYNC, OVERLAP, DIRECT_IO, FROZEN_ONCE)
