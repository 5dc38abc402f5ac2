"""Run options: defaults < config file (procckpt.yaml) < environment (PROCCKPT_*) < command line.

Each option is declared once, as a field of :class:`RunConfig`: its default, and in the field's
metadata an :class:`Option` (help, metavar, how a value is read, what ``procckpt sbatch`` does
with it). ``procckpt run``'s click options, its YAML keys and ``PROCCKPT_*`` variables,
``procckpt sbatch``'s pass-through and ``procckpt k8s``'s grace and time limit all come from
:data:`OPTIONS`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..durations import parse_duration
from ..errors import UsageError
from ..protocol.control import AUDIT_MODES
from ..protocol.switches import TRAINING_SWITCHES
from ..store.remote import ENV_LOCAL, split_location

__all__ = ["RunConfig", "Option", "OPTIONS", "load_config", "config_from", "check_grace",
           "CONFIG_FILE", "ENGINES"]

CONFIG_FILE = "procckpt.yaml"
ENGINES = ("auto", "hooks", "dmtcp", "criu")
DEFAULT_GRACE = 60.0
#: The expected time between failures that --interval auto plans for (Young/Daly).
DEFAULT_MTBF = 24 * 3600.0
AUTO = "auto"
OFF = "off"

#: What ``procckpt sbatch`` does with a run option: it passes it on to the ``procckpt run``
#: in the job script; SBATCH_OWN: the name is sbatch's own option (it goes to an #SBATCH
#: line); any other text: why sbatch refuses it.
PASSED_ON = "passed on"
SBATCH_OWN = "sbatch's own"

Convert = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Option:
    """How one run option is given and read (its default is its RunConfig field's)."""

    convert: Convert  # (value as given, option name) -> value, or UsageError
    help: str
    metavar: str = ""
    #: The default as ``--help`` shows it, where the field's default does not say it.
    shown_default: str | None = None
    #: "value", "flag" (--force) or "switch" (--x/--no-x).
    kind: str = "value"
    sbatch: str = PASSED_ON
    name: str = ""  # filled in from the field

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "PROCCKPT_" + self.name.upper()

    def flags(self) -> list[str]:
        """The command-line words that set it."""
        return [self.flag, "--no-" + self.flag[2:]] if self.kind == "switch" else [self.flag]


def _option(default: Any, help: str, convert: Convert, metavar: str = "", **more: Any) -> Any:
    return field(default=default,
                 metadata={"option": Option(convert, help, metavar, **more)})


def _duration(v: Any, option: str) -> float:
    return parse_duration(v, what=option)


def _duration_or_auto(shortest: float, why: str) -> Convert:
    """A duration of at least ``shortest`` seconds, ``auto`` or ``off``; off is None."""
    def convert(v: Any, option: str) -> float | str | None:
        if v is False:  # YAML reads a bare `off` as false
            return None
        text = str(v).strip().lower()
        if text == AUTO:
            return AUTO
        if text in (OFF, "none"):
            return None
        try:
            seconds = parse_duration(v, what=option)
        except UsageError as e:
            raise UsageError(f"{e}; or auto, or off") from None
        if seconds == 0:
            raise UsageError(f"bad {option} {v!r}: 0 is no duration; to turn it off say off")
        if seconds < shortest:
            raise UsageError(f"bad {option} {v!r}: at least {shortest:g}s ({why}); or auto, "
                             "or off")
        return seconds
    return convert


def _int(minimum: int) -> Convert:
    def convert(v: Any, option: str) -> int:
        try:
            value = int(str(v).strip())
        except ValueError:
            raise UsageError(f"bad {option} {v!r}: expected a whole number") from None
        if value < minimum:
            raise UsageError(f"bad {option} {v!r}: must be at least {minimum}")
        return value
    return convert


def _bool(v: Any, option: str) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise UsageError(f"bad {option} {v!r}: expected true or false")


def _engine(v: Any, option: str) -> str:
    text = str(v).strip().lower()
    if text not in ENGINES:
        raise UsageError(f"bad {option} {v!r}: choose one of {', '.join(ENGINES)}")
    return text


def _audit(v: Any, option: str) -> str:
    text = OFF if v is False else str(v).strip().lower()  # YAML reads a bare `off` as false
    if text not in AUDIT_MODES:
        raise UsageError(f"bad {option} {v!r}: choose strict (stop a resume whose first batch "
                         "differs), warn or off")
    return text


def _signal(v: Any, option: str) -> str:
    name = str(v).strip().upper().removeprefix("SIG")
    if not hasattr(signal, f"SIG{name}") or name in ("KILL", "STOP"):
        raise UsageError(f"bad {option} {v!r}: use e.g. USR1, TERM or URG")
    return name


def _dir(v: Any, option: str) -> Path:
    if not isinstance(v, (str, os.PathLike)) or not str(v).strip():
        raise UsageError(f"bad {option} {v!r}: give a directory path")
    return Path(os.path.expanduser(str(v)))


@dataclass
class RunConfig:
    """What ``procckpt run`` was asked to do (the spec; see supervisor.RunResult for the outcome).

    Durations are seconds. ``grace`` None means "pick from the time limit" (see
    :meth:`grace_for`). ``interval`` and ``hang_timeout`` are seconds, ``"auto"`` (worked out
    from what the run measures) or None (off).
    """

    command: list[str] = field(default_factory=list)
    dir: Path = _option(Path("procckpt-checkpoints"), "Checkpoint directory, or s3://BUCKET/PREFIX "
                        f"(then the lock and the journal stay in ${ENV_LOCAL}, by default "
                        "./procckpt-local/BUCKET/PREFIX).", _dir, "DIR",
                        shown_default="./procckpt-checkpoints")
    time_limit: float | None = _option(
        None, "Time limit of each cycle (e.g. 90s, 15m, 2h, 1:30:00).", _duration, "DURATION",
        sbatch="in a Slurm job the time limit is the job's own: use -t/--time")
    grace: float | None = _option(
        None, "Ask for the checkpoint this long before the deadline.", _duration, "DURATION",
        shown_default=f"{DEFAULT_GRACE:g}s, at most a quarter of --time-limit")
    interval: float | str | None = _option(
        AUTO, "Also checkpoint this often, without stopping (auto: from what a checkpoint "
        "costs and --mtbf).",
        _duration_or_auto(1.0, "a shorter one would checkpoint at every step"),
        "DURATION|auto|off")
    mtbf: float = _option(DEFAULT_MTBF, "Expected time between failures (node loss, OOM "
                          "kill), for --interval auto.", _duration, "DURATION")
    hang_timeout: float | str | None = _option(
        AUTO, "Restart the command when it makes no progress (no step completes, and its "
        "training thread's stack does not move while it uses the processor) for this long, "
        "after printing its stacks (auto: max(10m, 50 steps)).",
        _duration_or_auto(5.0, "the training reports its progress once a second, so a "
                               "shorter one would stop a healthy run"),
        "DURATION|auto|off")
    max_restarts: int = _option(20, "Restart (or requeue) at most N times.", _int(0), "N")
    restart_on_failure: bool | None = _option(
        None, "Restart a command that crashed (an OOM kill, a segfault, a lost GPU) from its "
        "last checkpoint. By default only a crash after a checkpoint of its own cycle is "
        "restarted, so that one that repeats before it saves anything ends the run; "
        "--restart-on-failure restarts that too (until 3 in a row), --no-restart-on-failure "
        "none.", _bool, kind="switch",
        shown_default="after a checkpoint of the crashed cycle")
    memory_tier: bool = _option(
        True, "Keep the training's newest state every few steps in memory that the launcher "
        "holds (a tmpfs directory), so that a crash (an OOM kill, a segfault) resumes from "
        "there instead of the last checkpoint: the hooks engine, one process.", _bool,
        kind="switch")
    warm_restarts: bool = _option(
        True, "Keep a spare Python with torch imported beside the training, so that a restart "
        "(after a crash, a hang, a --time-limit cycle) starts the script in it, not in a new "
        "interpreter: `python script.py` and `python -m module` commands, the hooks engine.",
        _bool, kind="switch")
    engine: str = _option("auto", "Snapshot engine.", _engine, "|".join(ENGINES))
    keep: int = _option(2, "Keep the last N checkpoints (plus the best).", _int(1), "N")
    force: bool = _option(
        False, "Train again even if the run finished (old checkpoints are archived).", _bool,
        kind="flag", sbatch="--force in a job that is requeued would archive the checkpoints "
        "at every restart")
    term_timeout: float = _option(10.0, "Wait this long after SIGTERM before SIGKILL.",
                                  _duration, "DURATION")
    checkpoint_signal: str = _option(
        "USR1", "Signal meaning 'checkpoint now, then stop' besides SIGTERM.", _signal, "SIG")
    audit: str = _option(
        "warn", "After a resume, compare its first batch with the one the interrupted run was "
        "about to train on; strict stops a resume whose batch differs (exit code 66), warn "
        "says so and goes on.", _audit, "|".join(AUDIT_MODES))
    #: A run on several nodes, each starting its own part of the command under its own
    #: launcher (Kubernetes pods): how many, and which one this is (0 leads).
    nodes: int = _option(1, "The run spans N nodes, each starting its own part of the "
                         "command under procckpt run (Kubernetes pods).", _int(1), "N",
                         sbatch=SBATCH_OWN)
    node_rank: int = _option(
        0, "Which of the --nodes this is; node 0 leads, the others follow its cycles.",
        _int(0), "K", sbatch="in a Slurm job srun starts every node's ranks: give sbatch "
        "--nodes, and torchrun or srun inside the job")
    #: The s3:// URL that --dir gave (``dir`` is then its local dir); not an option itself.
    remote: str | None = None

    def grace_for(self, limit: float | None) -> float:
        """Seconds before the deadline at which to ask for the checkpoint.

        Explicit ``--grace`` wins; otherwise 60 s, but at most a quarter of a short limit so
        that a short cycle still trains for most of its time.
        """
        if self.grace is not None:
            return self.grace
        if limit is None:
            return DEFAULT_GRACE
        return min(DEFAULT_GRACE, limit / 4)


def _declared() -> dict[str, Option]:
    out = {}
    for f in fields(RunConfig):
        if "option" in f.metadata:
            out[f.name] = Option(**{**f.metadata["option"].__dict__, "name": f.name})
    return out


#: Every run option, in the order ``--help`` lists them.
OPTIONS: dict[str, Option] = _declared()


def shown_default(option: Option) -> str:
    """The default of ``option`` as the help and docs show it."""
    if option.shown_default is not None:
        return option.shown_default
    default: Any = next(f.default for f in fields(RunConfig) if f.name == option.name)
    if option.kind != "value":
        return "off" if not default else "on"
    if default is None:
        return "none"
    if option.convert is _duration:
        for unit, seconds in (("h", 3600), ("m", 60)):
            if default % seconds == 0:
                return f"{default / seconds:g}{unit}"
        return f"{default:g}s"
    return str(default)


def _read_file(path: Path, explicit: bool) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if explicit:
            raise UsageError(f"config file {path} does not exist") from None
        return {}
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from e
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must be a mapping of option: value")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in OPTIONS:
            valid = ", ".join(option.flag[2:] for option in OPTIONS.values())
            raise UsageError(f"unknown option {key!r} in {path}; valid options: {valid}")
        if value is None or isinstance(value, (list, dict)):
            shown = "empty" if value is None else f"a {type(value).__name__}"
            raise UsageError(f"{key} in {path} is {shown}: give it one value, or remove the line")
        out[name] = value
    return out


def load_config(cli: Mapping[str, Any], command: list[str], *, config_path: str | None = None,
                environ: Mapping[str, str] | None = None,
                only: Collection[str] | None = None) -> RunConfig:
    """Merge the sources into a validated RunConfig. ``cli`` maps option names to values,
    None meaning "not given"; ``only``: read just these options from the file and the
    environment (``procckpt k8s``, whose pod reads the rest in its own)."""
    environ = os.environ if environ is None else environ
    path = Path(config_path) if config_path else Path(CONFIG_FILE)
    values: dict[str, Any] = {}
    values.update(_read_file(path, explicit=config_path is not None))
    for option in OPTIONS.values():
        env_value = environ.get(option.env)
        if env_value not in (None, ""):
            values[option.name] = env_value
    if only is not None:
        values = {name: value for name, value in values.items() if name in only}
    values.update({name: value for name, value in cli.items() if value is not None})
    config = config_from(values, command)
    _check_training_environment(environ)
    return config


def config_from(values: Mapping[str, Any], command: list[str]) -> RunConfig:
    """A validated RunConfig from option values as given (None: not given), no other source."""
    values = dict(values)
    remote = None
    if str(values.get("dir") or "").startswith("s3://"):  # its local dir holds the lock
        local, remote = split_location(values["dir"])
        values["dir"] = str(local)
    converted = {name: OPTIONS[name].convert(value, OPTIONS[name].flag[2:])
                 for name, value in values.items() if value is not None and name in OPTIONS}
    config = RunConfig(command=list(command), **converted)
    config.remote = remote
    _validate(config)
    return config


def _check_training_environment(environ: Mapping[str, str]) -> None:
    """Variables the training side reads: refused here, before anything starts, rather than
    by the command after it has loaded its data."""
    for switch in TRAINING_SWITCHES:
        switch.read(environ)


def check_grace(grace: float, limit: float | None) -> None:
    """The one grace-versus-limit rule, for run, sbatch (the job's -t) and k8s."""
    if grace <= 0:
        raise UsageError(f"bad grace {grace:g}s: must be positive")
    if limit is not None and grace >= limit:
        raise UsageError(f"grace ({grace:g}s) must be shorter than the time limit ({limit:g}s): "
                         "the checkpoint is asked for at limit - grace")


def _validate(config: RunConfig) -> None:
    if config.time_limit is not None and config.time_limit <= 0:
        raise UsageError("time-limit must be positive")
    if config.grace is not None:
        check_grace(config.grace, config.time_limit)
    if config.mtbf <= 0:
        raise UsageError("mtbf must be positive: the expected time between failures")
    if config.node_rank >= config.nodes:
        raise UsageError(f"node-rank {config.node_rank} is not below nodes {config.nodes}: "
                         "number the nodes 0 to nodes-1, and give --nodes on every one")
    if config.nodes > 1 and config.engine in ("dmtcp", "criu"):
        raise UsageError("--nodes needs the hooks engine (procckpt.Checkpointer in the "
                         f"script): a {config.engine.upper()} image holds one node's processes")
