"""``procckpt sbatch``: options + command -> a job script that survives any number of time limits.

    procckpt sbatch [PROCCKPT OPTIONS] [SBATCH OPTIONS] -- COMMAND [ARGS...]

:func:`parse_sbatch_args` sorts the words before ``--`` into procckpt's own options, the
``procckpt run`` options to pass on, Pyxis container options (for ``srun``), the few options
that change how ``sbatch`` submits (``--parsable``, ``--wait``, ...) and everything else, which
becomes ``#SBATCH`` lines untouched. :func:`render_job_script` is a pure function of the
result; ``jobscripts/`` holds its output for typical cases, checked by golden-file tests.

Three shapes of script:

- requeue (default): ``#SBATCH --requeue --open-mode=append --signal=B:USR1@<grace>`` and
  ``exec procckpt run ... -- COMMAND``; procckpt requeues the job itself.
- chain (``--chain N``, for sites that forbid requeue): ``#SBATCH --array=1-N%1``; each task
  resumes from the checkpoint dir, the tasks after the finish exit at once.
- container (any ``--container-*`` option): ``srun --container-... procckpt run ...``; the
  batch shell stays outside the container and requeues when procckpt exits with 75.

Why USR1 to the batch shell (``B:``) only: without ``B:`` Slurm signals every process of the
job, and NCCL installs its own SIGUSR1 handler (DMTCP uses SIGUSR2), so the training processes
must not get it. procckpt gets it as the batch shell (``exec``) and asks the training process
for the checkpoint through its control directory instead.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EX_TEMPFAIL, ProcckptError, UsageError
from ..launcher.config import (
    DEFAULT_GRACE,
    OPTIONS,
    PASSED_ON,
    SBATCH_OWN,
    RunConfig,
    check_grace,
    load_config,
)
from .slurm import ENV_CHAIN, ENV_END_TIME, parse_time_limit, sbatch_directives

__all__ = ["SbatchSpec", "parse_sbatch_args", "render_job_script", "submit", "sbatch_main"]

logger = logging.getLogger(__name__)

#: ``procckpt run`` options that ``procckpt sbatch`` passes on, and those it refuses and why
#: (from the run option table; --config, the file of both, is passed on too).
RUN_VALUE_OPTIONS = (*(o.flag for o in OPTIONS.values() if o.sbatch == PASSED_ON
                       and o.kind != "switch"), "--config")
RUN_FLAG_OPTIONS = tuple(f for o in OPTIONS.values() if o.sbatch == PASSED_ON
                         and o.kind == "switch" for f in o.flags())
#: Options of the sbatch command itself, not of the job: they stay on its command line.
SUBMIT_FLAGS = ("--parsable", "--test-only", "--wait", "-W", "--quiet", "-Q")
REFUSED = {
    **{o.flag: o.sbatch for o in OPTIONS.values() if o.sbatch not in (PASSED_ON, SBATCH_OWN)},
    "--wrap": "procckpt writes the job script: put the command after --",
}
SHELLS = ("bash", "sh", "zsh", "dash", "ksh")


@dataclass
class SbatchSpec:
    """Everything the job script is made of (see :func:`parse_sbatch_args`)."""

    command: list[str]
    directives: list[list[str]] = field(default_factory=list)  # from the command line
    wrapped: list[list[str]] = field(default_factory=list)  # #SBATCH lines of a wrapped script
    wrapped_path: str | None = None
    run_options: list[str] = field(default_factory=list)
    container: list[str] = field(default_factory=list)
    submit_options: list[str] = field(default_factory=list)
    chain: int | None = None
    dry_run: bool = False
    grace: int = int(DEFAULT_GRACE)
    checkpoint_signal: str = "USR1"
    user_signal: str | None = None  # the --signal the user gave, if any
    max_restarts: int = RunConfig.max_restarts
    launcher: str = "procckpt"
    argv: list[str] = field(default_factory=list)  # as typed, for the script's header

    @property
    def all_directives(self) -> list[list[str]]:
        return self.wrapped + self.directives


def _group(words: list[str]) -> list[list[str]]:
    """Split option words into [option] or [option, value] groups: before ``--`` every word
    that does not start with '-' is the value of the option before it."""
    groups: list[list[str]] = []
    for word in words:
        if word.startswith("-") and word != "-":
            groups.append([word])
        elif groups and len(groups[-1]) == 1 and "=" not in groups[-1][0]:
            groups[-1].append(word)
        else:
            raise UsageError(f"unexpected {word!r} before '--': options start with '-'; put the "
                             "command after '--', e.g. procckpt sbatch -t 4:00:00 -- python "
                             "train.py")
    return groups


def _name_value(group: list[str]) -> tuple[str, str | None]:
    if len(group) == 2:
        return group[0], group[1]
    name, eq, value = group[0].partition("=")
    if eq and name.startswith("--"):
        return name, value
    return group[0], None


def _option(directives: list[list[str]], *names: str) -> str | None:
    """The value of the last directive named one of ``names`` ('' for a flag)."""
    found = None
    for group in directives:
        name, value = _name_value(group)
        if name in names:
            found = value if value is not None else ""
        elif len(name) > 2 and not name.startswith("--") and name[:2] in names:
            found = name[2:]  # -t60, -Jname
    return found


def _has(directives: list[list[str]], *names: str) -> bool:
    return _option(directives, *names) is not None


def _wrapped_script(command: list[str]) -> Path | None:
    """The user's job script among the command's first words, if it has #SBATCH lines."""
    candidates = command[:1]
    if command and os.path.basename(command[0]) in SHELLS and len(command) > 1:
        candidates = command[1:2]
    for word in candidates:
        path = Path(word)
        try:
            if path.is_file() and path.stat().st_size < 1 << 20 and \
                    "#SBATCH" in path.read_text(errors="replace"):
                return path
        except OSError:
            continue
    return None


def _signal_parts(spec: str) -> tuple[str, str, str]:
    """``[{R|B}:]SIG[@TIME]`` -> (flags, SIG without 'SIG', time)."""
    flags, _, rest = spec.rpartition(":") if ":" in spec else ("", "", spec)
    sig, _, at = rest.partition("@")
    return flags.upper(), sig.upper().removeprefix("SIG"), at


def parse_sbatch_args(argv: list[str]) -> SbatchSpec:  # noqa: C901 (a branch per kind of argument)
    """Sort ``procckpt sbatch`` arguments; see the module docstring.

    Raises:
        UsageError: no ``--`` and command, a bad value, or an option that conflicts with how
            procckpt resumes (``--no-requeue`` without ``--chain``, ``--open-mode=truncate``).
    """
    if "--" not in argv:
        raise UsageError("put the command to run after '--', e.g. procckpt sbatch -t 4:00:00 "
                         "-- python train.py")
    split = argv.index("--")
    words, command = argv[:split], argv[split + 1:]
    if not command:
        raise UsageError("no command after '--': e.g. procckpt sbatch -t 4:00:00 -- python "
                         "train.py")
    spec = SbatchSpec(command=list(command), argv=[a for a in argv if a != "--dry-run"])
    signal_option: str | None = None
    for group in _group(words):
        name, value = _name_value(group)
        if name in REFUSED:
            raise UsageError(f"procckpt sbatch does not take {name}: {REFUSED[name]}")
        if name == "--dry-run":
            spec.dry_run = True
        elif name == "--chain":
            spec.chain = _positive_int(name, value)
        elif name in RUN_VALUE_OPTIONS:
            if value is None:
                raise UsageError(f"{name} needs a value")
            spec.run_options += [name, value]
        elif name in RUN_FLAG_OPTIONS:
            spec.run_options.append(name)
        elif name.startswith(("--container-", "--no-container-")):
            spec.container += group
        elif name in SUBMIT_FLAGS:
            spec.submit_options += group
        else:
            if any("\n" in w or '"' in w for w in group):
                raise UsageError(f"sbatch option {' '.join(group)!r}: newlines and double quotes "
                                 "cannot go into an #SBATCH line")
            spec.directives.append(list(group))

    wrapped = _wrapped_script(spec.command)
    if wrapped is not None:
        spec.wrapped_path = str(wrapped)
        lines = sbatch_directives(wrapped.read_text(errors="replace"))
        spec.wrapped = [group for words in lines for group in _group_words(words)]
        if not os.access(wrapped, os.X_OK) and os.path.basename(spec.command[0]) not in SHELLS:
            spec.command = ["bash", *spec.command]
    _check_conflicts(spec)

    limit_text = _option(spec.all_directives, "-t", "--time")
    limit = parse_time_limit(limit_text) if limit_text else None
    if limit_text and limit is None and limit_text.upper() not in ("UNLIMITED", "INFINITE"):
        raise UsageError(f"bad time limit {limit_text!r}: use Slurm's forms, e.g. 30, 4:00:00 "
                         "or 1-12:00:00")
    # The lead and signal of --signal=B:SIG@LEAD are those the `procckpt run` in the job will
    # read: the options passed on, then $PROCCKPT_*, then procckpt.yaml (the job starts in
    # this directory with this environment, Slurm's defaults).
    config = run_config(spec.run_options, spec.command)
    grace = config.grace_for(limit)
    check_grace(grace, limit)
    spec.grace = max(1, math.ceil(grace))
    spec.max_restarts = config.max_restarts
    if "--checkpoint-signal" in spec.run_options or config.checkpoint_signal != "USR1":
        signal_option = config.checkpoint_signal

    user_signal = _option(spec.all_directives, "--signal")
    if user_signal:
        flags, sig, _ = _signal_parts(user_signal)
        spec.user_signal = user_signal
        if "B" not in flags:
            logger.warning("--signal=%s has no 'B:': Slurm sends %s to every process of the job, "
                           "including the training (NCCL handles SIGUSR1 itself); procckpt "
                           "expects --signal=B:%s@T", user_signal, sig, sig)
        if signal_option is None and sig != "USR1":
            spec.run_options += ["--checkpoint-signal", sig]
            signal_option = sig
    spec.checkpoint_signal = signal_option or "USR1"
    return spec


def run_config(run_options: list[str], command: list[str]) -> RunConfig:
    """What ``procckpt run RUN_OPTIONS -- COMMAND`` would read here: its options, the
    environment's ``PROCCKPT_*`` and ``procckpt.yaml`` (``--config``'s file), one way."""
    given: dict[str, Any] = {}
    config_path: str | None = None
    words = iter(run_options)
    for name in words:
        if name in RUN_FLAG_OPTIONS:
            given["restart_on_failure"] = name == "--restart-on-failure"
        elif name == "--config":
            config_path = next(words)
        else:
            given[name.removeprefix("--").replace("-", "_")] = next(words)
    return load_config(given, command, config_path=config_path)


def _group_words(words: list[str]) -> list[list[str]]:
    try:
        return _group(words)
    except UsageError:
        return [words]


def _positive_int(name: str, value: str | None, minimum: int = 1) -> int:
    try:
        number = int(value or "")
    except ValueError:
        raise UsageError(f"{name} needs a whole number, not {value!r}") from None
    if number < minimum:
        raise UsageError(f"{name} must be at least {minimum}")
    return number


def _check_conflicts(spec: SbatchSpec) -> None:
    directives = spec.all_directives
    mode = (_option(directives, "--open-mode") or "append").lower()
    if mode != "append":
        raise UsageError(f"--open-mode={mode} loses the log of earlier cycles when the job is "
                         "requeued; drop it (procckpt sbatch sets --open-mode=append)")
    if spec.chain is not None:
        if _has(directives, "--array", "-a"):
            raise UsageError("--chain N makes the job an array (--array=1-N%1): drop --array")
    elif _option(directives, "--no-requeue") is not None:
        raise UsageError("--no-requeue stops procckpt from requeueing the job; for sites that "
                         "forbid requeue use --chain N instead")


# -- rendering ----------------------------------------------------------------------------------
def _directive_line(group: list[str]) -> str:
    words = [f'"{w}"' if any(c.isspace() for c in w) or w == "" else w for w in group]
    return "#SBATCH " + " ".join(words)


def render_job_script(spec: SbatchSpec) -> str:
    """The job script text for ``spec``; a pure function (golden-file tested)."""
    directives = spec.all_directives
    ours: list[list[str]] = []
    container = bool(spec.container)
    if spec.chain is not None:
        ours.append([f"--array=1-{spec.chain}%1"])
    elif not _has(directives, "--requeue"):
        ours.append(["--requeue"])
    if not _has(directives, "--open-mode"):
        ours.append(["--open-mode=append"])
    if not container and spec.user_signal is None:
        ours.append([f"--signal=B:{spec.checkpoint_signal}@{spec.grace}"])
    if spec.chain is not None and not _has(directives, "-o", "--output"):
        # One log for the whole chain instead of one file per array task.
        ours.append(["--output=slurm-%A.out"])

    lines = ["#!/bin/bash"]
    lines += [_directive_line(g) for g in ours]
    if spec.wrapped:
        lines.append(f"# from {spec.wrapped_path}:")
        lines += [_directive_line(g) for g in spec.wrapped]
    if spec.directives:
        if spec.wrapped:
            lines.append("# from the command line:")
        lines += [_directive_line(g) for g in spec.directives]
    lines.append("# Written by: " + shlex.join(["procckpt", "sbatch", *spec.argv]))
    run = [spec.launcher, "run", *spec.run_options, "--", *spec.command]
    if container:
        lines += _container_body(spec, run)
    else:
        lines += _exec_body(spec, run)
    return "\n".join(lines) + "\n"


def _comment(*paragraphs: str) -> list[str]:
    lines = ["#"]
    for i, text in enumerate(paragraphs):
        if i:
            lines.append("#")
        lines += textwrap.wrap(text, width=92, initial_indent="# ", subsequent_indent="# ",
                               break_on_hyphens=False, break_long_words=False)
    return lines


def _signal_text(spec: SbatchSpec) -> str:
    if spec.user_signal is not None:
        return f"when Slurm sends --signal={spec.user_signal}"
    return (f"when Slurm sends SIG{spec.checkpoint_signal} to this batch shell {spec.grace} s "
            "before the limit")


_EXEC_TEXT = ("`exec` makes procckpt the batch shell itself, so that the signal reaches it; "
              "procckpt passes the request on to the training through its checkpoint dir, never "
              "as a raw signal (NCCL handles SIGUSR1 itself, DMTCP uses SIGUSR2).")


def _exec_body(spec: SbatchSpec, run: list[str]) -> list[str]:
    if spec.chain is not None:
        lines = _comment(
            f"Chain mode, for sites that do not allow requeue: the job is an array of "
            f"{spec.chain} tasks that run one after another (%1). procckpt checkpoints the "
            f"command before each task's time limit ({_signal_text(spec)}, or at the end time "
            "it reads from Slurm) and stops; the next task resumes from the checkpoint. Once "
            "the training has finished, the remaining tasks exit at once.", _EXEC_TEXT)
        lines.append(f"export {ENV_CHAIN}=1")
    else:
        lines = _comment(
            f"procckpt checkpoints the command before the time limit ({_signal_text(spec)}, "
            "or at the end time it reads from Slurm), requeues the job with `scontrol "
            "requeue`, and resumes from the checkpoint when Slurm starts the job again. "
            "--open-mode=append keeps the output of every cycle in one log.", _EXEC_TEXT)
    lines.append("exec " + shlex.join(run))
    return lines


def _container_body(spec: SbatchSpec, run: list[str]) -> list[str]:
    srun = ["srun", "--ntasks=1", *spec.container, *run]
    then = ("stops, and the next array task resumes" if spec.chain is not None else
            f"exits with {EX_TEMPFAIL}; this shell, outside the container, then requeues the job "
            "(unless it got SIGTERM: scancel or preemption)")
    lines = _comment(
        "Container mode (Pyxis): procckpt runs inside the container, where scontrol and squeue "
        f"are missing. It learns the job's end time from {ENV_END_TIME} (set below), "
        f"checkpoints before it and {then}.",
        "No --signal: a signal sent into the srun step would reach the training processes too.")
    lines.append("set -u")
    if spec.chain is None:
        lines += [f"max_restarts={spec.max_restarts}", "stopped_by_slurm=0",
                  "trap 'stopped_by_slurm=1' TERM"]
    lines += [
        'if end_time="$(squeue -h -j "$SLURM_JOB_ID" -o %e)" && '
        'end_epoch="$(date -d "$end_time" +%s)"; then',
        f'    export {ENV_END_TIME}="$end_epoch"',
        "fi",
    ]
    if spec.chain is not None:
        lines.append(f"export {ENV_CHAIN}=1")
        lines += [shlex.join(srun), "exit $?"]
        return lines
    lines += [
        shlex.join(srun),
        "rc=$?",
        f'if [ "$rc" -eq {EX_TEMPFAIL} ] && [ "$stopped_by_slurm" -eq 0 ]; then',
        '    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$max_restarts" ]; then',
        '        echo "procckpt sbatch: restart budget exhausted (${SLURM_RESTART_COUNT:-0} of'
        ' $max_restarts); not requeued" >&2',
        '    elif [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then',
        '        scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" && exit 0',
        "    else",
        '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "    fi",
        "fi",
        'exit "$rc"',
    ]
    return lines


# -- submitting -------------------------------------------------------------------------------
def submit(script: str, submit_options: list[str]) -> int:
    """Give ``script`` to ``sbatch`` on its stdin; returns sbatch's exit code (its output,
    e.g. "Submitted batch job 42", goes to ours)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ProcckptError("sbatch not found: is this a Slurm login node? Use --dry-run to see "
                            "the job script instead")
    try:
        res = subprocess.run([sbatch, *submit_options], input=script, text=True)
    except OSError as e:
        raise ProcckptError(f"cannot run {sbatch}: {e.strerror}") from e
    return res.returncode


def sbatch_main(argv: list[str]) -> int:
    """``procckpt sbatch``: print (``--dry-run``) or submit the job script; the exit code."""
    spec = parse_sbatch_args(argv)
    script = render_job_script(spec)
    if spec.dry_run:
        sys.stdout.write(script)
        return 0
    return submit(script, spec.submit_options)
