"""Start-up checks of a Slurm job: settings that would lose a checkpoint or a requeue."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ...errors import EX_TEMPFAIL
from ...launcher.config import RunConfig
from ...store.files import MEMORY_FS_TYPES, fs_type, is_within
from .env import SlurmEnv
from .job import SlurmJob

__all__ = ["startup_warnings", "node_local_reason", "sbatch_directives", "signal_lead"]

_NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")


def node_local_reason(directory: Path, env: SlurmEnv, mounts_text: str | None = None,
                      ) -> str | None:
    """Why ``directory`` is likely on node-local storage that a requeue loses, or None."""
    path = directory.resolve()
    for prefix in _NODE_LOCAL_PREFIXES:
        if is_within(path, prefix):
            return f"it is under {prefix}"
    for tmp in env.tmpdirs:
        if is_within(path, tmp):
            return f"it is under the job's temporary dir {tmp}"
    fstype = fs_type(path, mounts_text)
    if fstype in MEMORY_FS_TYPES:
        return f"it is on a {fstype} (memory) filesystem"
    return None


def sbatch_directives(script: str) -> list[list[str]]:
    """The ``#SBATCH`` options of a job script, split into words; like sbatch, stop at the
    first line that is neither blank nor a comment."""
    found = []
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            try:
                found.append(shlex.split(stripped[len("#SBATCH"):], comments=True))
            except ValueError:
                found.append(stripped[len("#SBATCH"):].split())
        elif stripped and not stripped.startswith("#"):
            break
    return found


def _directive_value(directives: list[list[str]], *names: str) -> str | None:
    """The value of the last directive called one of ``names`` (``--x=v``, ``--x v``,
    ``-xv``, ``-x v``)."""
    value = None
    for words in directives:
        for i, word in enumerate(words):
            for name in names:
                if word == name and i + 1 < len(words):
                    value = words[i + 1]
                elif name.startswith("--") and word.startswith(name + "="):
                    value = word[len(name) + 1:]
                elif len(name) == 2 and word.startswith(name) and len(word) > 2 \
                        and not word.startswith("--"):
                    value = word[2:]
    return value


def _parent_cmdline(pid: int | None = None) -> list[str]:
    try:
        ppid = os.getppid() if pid is None else pid
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def signal_lead(script: str | None) -> float | None:
    """Seconds before the end at which the job script's ``--signal=[B:]SIG[@TIME]`` asks
    Slurm to signal (60 when no time is given); None without such a line."""
    spec = _directive_value(sbatch_directives(script), "--signal") if script else None
    if not spec:
        return None
    _, at, seconds = spec.partition("@")
    if not at:
        return 60.0
    return float(seconds) if seconds.strip().isdigit() else None


def startup_warnings(job: SlurmJob, config: RunConfig, *, parent_cmdline: list[str] | None = None,
                     mounts_text: str | None = None, script: str | None = None) -> list[str]:
    """Misconfigurations that would lose work, found at start, as one message each."""
    env = job.env
    warnings = []
    parent = _parent_cmdline() if parent_cmdline is None else parent_cmdline
    script = job.batch_script() if script is None else script
    directives = sbatch_directives(script) if script else []
    signal_spec = _directive_value(directives, "--signal") or ""
    under_batch_shell = (len(parent) >= 2 and os.path.basename(parent[0]) in ("bash", "sh", "zsh",
                         "dash", "ksh") and any(p.endswith("slurm_script") for p in parent[1:]))
    if under_batch_shell and signal_spec.upper().startswith(("B:", "RB:", "BR:")):
        warnings.append(
            f"procckpt runs under the job's batch shell, which gets the --signal={signal_spec} "
            "signal instead of procckpt: the shell dies of it (ending the job) or, with a "
            "trap, acts only after procckpt exits. Start procckpt with `exec procckpt run ...` "
            "in the job script")
    if script is not None and env.chain_position is None:
        open_mode = (_directive_value(directives, "--open-mode") or "").lower()
        if open_mode != "append" and (job.config_value("JobFileAppend") or "0") != "1":
            warnings.append(
                "the job script has no '#SBATCH --open-mode=append': unless it was given to "
                "sbatch on the command line, Slurm truncates the job's output file when it "
                "requeues the job, and the log of earlier cycles is lost")
    reason = node_local_reason(config.dir, env, mounts_text)
    if reason is not None:
        warnings.append(
            f"the checkpoint dir {config.dir.absolute()} looks node-local ({reason}): a "
            "requeued job may start on another node, or find it wiped; put --dir on a shared "
            "filesystem")
    if not job.has("scontrol"):
        warnings.append(
            f"scontrol not found (inside a container?): procckpt cannot requeue {env.label}; "
            f"after a checkpoint it exits with {EX_TEMPFAIL} for the job script outside to act on")
    elif env.chain_position is None:
        record = job.record()
        if record is not None and record.requeue_allowed is False:
            warnings.append(
                f"{env.label} cannot be requeued (Requeue=0: submitted with --no-requeue, or the "
                "site's JobRequeue=0 and no --requeue): submit with --requeue, or use procckpt "
                f"sbatch --chain N; until then a checkpointed stop exits with {EX_TEMPFAIL}")
    return warnings
