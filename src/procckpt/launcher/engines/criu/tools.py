"""Finding CRIU and checking, before any training, that it can image a process here.

Each problem is one line that says what to do: no ``criu`` on PATH, a CRIU too old for this
kernel (Debian 12's 3.17 fails ``criu check`` on kernels from 6.13: "vdso: Unexpected rt vDSO
area bounds"), one whose ``criu check`` fails for another reason, or a launcher that is not
root and a binary without the file capabilities of CRIU's ``--unprivileged`` mode.

A launcher that is not root uses ``--unprivileged`` (Linux 5.9 or newer) when ``criu check
--unprivileged`` passes: the binary carries ``cap_checkpoint_restore`` and ``cap_sys_ptrace``
(and ``cap_setpcap`` where the bounding set is trimmed) as file capabilities, set once by an
administrator (``setcap cap_checkpoint_restore,cap_sys_ptrace,cap_setpcap+eip criu``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ....errors import ProcckptError

__all__ = ["CriuError", "CriuProblem", "CriuTools", "find_criu", "criu_problem", "criu_usable",
           "MIN_VERSION", "ENV_CRIU"]

#: The criu binary to use, where it is not the one on PATH.
ENV_CRIU = "PROCCKPT_CRIU"

#: The first CRIU that knows the ``[vvar_vclock]`` mapping of kernels from 6.13.
MIN_VERSION = (4, 1)
#: Where ../shared/tools/build-criu.sh (and many sites) install it, when it is not on PATH.
_ALSO = ("/opt/criu/sbin", "/usr/local/sbin", "/usr/sbin")
_BUILD = ("build CRIU 4.1 or newer from https://github.com/checkpoint-restore/criu (make criu; "
          "install criu/criu into PATH)")


class CriuError(ProcckptError):
    """CRIU could not be used or driven."""


@dataclass(frozen=True)
class CriuTools:
    """One CRIU binary and its version."""

    criu: str
    version: tuple[int, ...]
    #: Not root: CRIU runs with ``--unprivileged`` on the binary's file capabilities.
    unprivileged: bool = False

    @property
    def options(self) -> list[str]:
        """What every dump and restore adds to its command line."""
        return ["--unprivileged"] if self.unprivileged else []

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def find_criu(path: str | None = None) -> str | None:
    """The ``criu`` binary: ``$PROCCKPT_CRIU`` if set, else on ``path`` (default $PATH, then
    the usual sbin folders)."""
    named = os.environ.get(ENV_CRIU)
    if named:
        return named if os.access(named, os.X_OK) else None
    found = shutil.which("criu", path=path)
    if found is not None or path is not None:
        return found
    for folder in _ALSO:
        candidate = Path(folder) / "criu"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def criu_problem(binary: str | None, *, euid: int | None = None,
                 timeout: float = 60.0) -> tuple[CriuTools | None, str | None]:
    """The tools, or why ``--engine criu`` cannot run here (one line, what to do)."""
    tools, problem = criu_usable(binary, euid=euid, timeout=timeout)
    return tools, None if problem is None else problem.message


@dataclass(frozen=True)
class CriuProblem:
    """Why CRIU cannot image a process here: ``why`` (a clause: what ``auto`` says when it
    passes over CRIU) and ``message`` (the one line ``--engine criu`` ends with)."""

    why: str
    message: str


def criu_usable(binary: str | None, *, euid: int | None = None,
                timeout: float = 60.0) -> tuple[CriuTools | None, CriuProblem | None]:
    """The tools, or the problem that keeps CRIU from imaging processes here."""
    if binary is None:
        where = os.environ.get(ENV_CRIU)
        why = f"{where} is not an executable" if where else "criu is not on PATH"
        return None, CriuProblem(why, f"--engine criu needs CRIU, but {why}: {_BUILD}")
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        why = f"{binary} --version failed ({e})"
        return None, CriuProblem(why, f"{why}: {_BUILD}")
    found = re.search(r"Version:\s*(\d+(?:\.\d+)+)", out.stdout)
    if found is None:
        why = f"{binary} --version says no version"
        return None, CriuProblem(why, f"{why}: {_BUILD}")
    version = tuple(int(x) for x in found.group(1).split("."))
    if version < MIN_VERSION:
        why = (f"{binary} is CRIU {found.group(1)}, which cannot image processes on kernels "
               f"from 6.13 (this one: {os.uname().release})")
        return None, CriuProblem(why, f"{why}: {_BUILD}")
    unprivileged = (os.geteuid() if euid is None else euid) != 0
    check = [binary, "check", *(["--unprivileged"] if unprivileged else [])]
    try:
        checked = subprocess.run(check, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        why = f"`{' '.join(check)}` failed ({e})"
        return None, CriuProblem(why, why)
    if checked.returncode != 0:
        said = _first_error(checked.stdout + checked.stderr)
        why = f"`{' '.join(check)}` fails on this machine ({said})"
        if unprivileged:
            return None, CriuProblem(
                f"not root, and {why}",
                f"--engine criu as a user other than root needs CRIU's capabilities, and {why}: "
                f"run as root, or have an administrator give the binary its capabilities "
                f"(setcap cap_checkpoint_restore,cap_sys_ptrace,cap_setpcap+eip {binary}; "
                "Linux 5.9 or newer), or use --engine hooks")
        return None, CriuProblem(why, f"{why}: CRIU {found.group(1)} cannot image processes "
                                      "here; use --engine hooks")
    return CriuTools(binary, version, unprivileged), None


def _first_error(output: str) -> str:
    """The first line of CRIU's output that says what is wrong (its errors, else its first
    line that is not a warning)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    said = errors or [line for line in lines if not line.startswith("Warn")] or lines
    return said[0].rstrip(": ") if said else "no message"
