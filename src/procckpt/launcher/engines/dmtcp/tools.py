"""Finding DMTCP: its four programs, from one installation, and the message when it is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ....errors import ProcckptError

__all__ = ["DmtcpError", "DmtcpTools", "find_dmtcp", "missing_dmtcp_message"]


class DmtcpError(ProcckptError):
    """DMTCP could not be started or driven."""


def missing_dmtcp_message(reason: str) -> str:
    return (f"{reason}, but dmtcp_launch is not on PATH: on a cluster try `module load dmtcp`; "
            "elsewhere build DMTCP from https://github.com/dmtcp/dmtcp (./configure && make && "
            "make install), or use --engine hooks")


@dataclass(frozen=True)
class DmtcpTools:
    """Where the DMTCP programs are; all four come from one installation."""

    launch: str
    restart: str
    command: str
    coordinator: str

    def version(self) -> str:
        try:
            out = subprocess.run([self.launch, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        first = out.splitlines()[0] if out else ""
        return first.rsplit(" ", 1)[-1] if first else "unknown"


def find_dmtcp(path: str | None = None) -> DmtcpTools | None:
    """The DMTCP installation on ``path`` (default $PATH), or None if ``dmtcp_launch`` is missing.

    The other programs are taken from ``dmtcp_launch``'s own directory when they are there, so
    that one run never mixes two installed versions.
    """
    launch = shutil.which("dmtcp_launch", path=path)
    if launch is None:
        return None
    home = Path(launch).parent
    found: list[str] = []
    for name in ("dmtcp_restart", "dmtcp_command", "dmtcp_coordinator"):
        sibling = home / name
        where = str(sibling) if os.access(sibling, os.X_OK) else shutil.which(name, path=path)
        if where is None:
            return None
        found.append(where)
    return DmtcpTools(launch, *found)
