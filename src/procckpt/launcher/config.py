"""Run options: defaults < config file (procckpt.yaml) < environment (PROCCKPT_*) < command line."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..durations import parse_duration
from ..errors import UsageError
from ..protocol.switches import TRAINING_SWITCHES

__all__ = ["RunConfig", "load_config", "CONFIG_FILE", "ENGINES"]

CONFIG_FILE = "procckpt.yaml"
ENGINES = ("auto", "hooks", "dmtcp")
DEFAULT_GRACE = 60.0
#: The expected time between failures that --interval auto plans for (Young/Daly).
DEFAULT_MTBF = 24 * 3600.0
AUTO = "auto"
OFF = "off"


@dataclass
class RunConfig:
    """What ``procckpt run`` was asked to do (the spec; see supervisor.RunResult for the outcome).

    Durations are seconds. ``grace`` None means "pick from the time limit" (see
    :meth:`grace_for`). ``interval`` and ``hang_timeout`` are seconds, ``"auto"`` (worked out
    from what the run measures) or None (off).
    """

    command: list[str] = field(default_factory=list)
    dir: Path = Path("procckpt-checkpoints")
    time_limit: float | None = None
    grace: float | None = None
    interval: float | str | None = AUTO
    mtbf: float = DEFAULT_MTBF
    hang_timeout: float | str | None = AUTO
    max_restarts: int = 20
    restart_on_failure: bool = False
    engine: str = "auto"
    keep: int = 2
    force: bool = False
    term_timeout: float = 10.0
    checkpoint_signal: str = "USR1"
    #: A run on several nodes, each starting its own part of the command under its own
    #: launcher (Kubernetes pods): how many, and which one this is (0 leads).
    nodes: int = 1
    node_rank: int = 0

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


def _duration(name: str) -> Callable[[Any], float]:
    return lambda v: parse_duration(v, what=f"{name.replace('_', '-')}")


def _duration_or_auto(name: str, shortest: float) -> Callable[[Any], float | str | None]:
    """A duration of at least ``shortest`` seconds, ``auto`` or ``off``; off is None."""
    option = name.replace("_", "-")

    def convert(v: Any) -> float | str | None:
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
            raise UsageError(f"bad {option} {v!r}: at least {shortest:g}s ({_SHORTEST_WHY[name]})"
                             "; or auto, or off")
        return seconds
    return convert


#: Why the options taking a duration or auto have a floor.
_SHORTEST_WHY = {
    "interval": "a shorter one would checkpoint at every step",
    "hang_timeout": "the training reports its progress once a second, so a shorter one "
                    "would stop a healthy run",
}


def _int(name: str, minimum: int) -> Callable[[Any], int]:
    def convert(v: Any) -> int:
        try:
            value = int(str(v).strip())
        except ValueError:
            raise UsageError(f"bad {name.replace('_', '-')} {v!r}: expected a whole number") from None
        if value < minimum:
            raise UsageError(f"bad {name.replace('_', '-')} {v!r}: must be at least {minimum}")
        return value
    return convert


def _bool(name: str) -> Callable[[Any], bool]:
    def convert(v: Any) -> bool:
        if isinstance(v, bool):
            return v
        text = str(v).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise UsageError(f"bad {name.replace('_', '-')} {v!r}: expected true or false")
    return convert


def _engine(v: Any) -> str:
    text = str(v).strip().lower()
    if text not in ENGINES:
        raise UsageError(f"bad engine {v!r}: choose one of {', '.join(ENGINES)}")
    return text


def _signal(v: Any) -> str:
    import signal as _sig

    name = str(v).strip().upper().removeprefix("SIG")
    if not hasattr(_sig, f"SIG{name}") or name in ("KILL", "STOP"):
        raise UsageError(f"bad checkpoint signal {v!r}: use e.g. USR1, TERM or URG")
    return name


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "dir": lambda v: _dir(v),
    "time_limit": _duration("time_limit"),
    "grace": _duration("grace"),
    "interval": _duration_or_auto("interval", 1.0),
    "mtbf": _duration("mtbf"),
    "hang_timeout": _duration_or_auto("hang_timeout", 5.0),
    "max_restarts": _int("max_restarts", 0),
    "restart_on_failure": _bool("restart_on_failure"),
    "engine": _engine,
    "keep": _int("keep", 1),
    "force": _bool("force"),
    "term_timeout": _duration("term_timeout"),
    "checkpoint_signal": _signal,
    "nodes": _int("nodes", 1),
    "node_rank": _int("node_rank", 0),
}


def _dir(v: Any) -> Path:
    if not isinstance(v, (str, os.PathLike)) or not str(v).strip():
        raise UsageError(f"bad dir {v!r}: give a directory path")
    return Path(os.path.expanduser(str(v)))


def _env_name(option: str) -> str:
    return "PROCCKPT_" + option.upper()


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
        if name not in _CONVERTERS:
            valid = ", ".join(sorted(k.replace("_", "-") for k in _CONVERTERS))
            raise UsageError(f"unknown option {key!r} in {path}; valid options: {valid}")
        if value is None or isinstance(value, (list, dict)):
            shown = "empty" if value is None else f"a {type(value).__name__}"
            raise UsageError(f"{key} in {path} is {shown}: give it one value, or remove the line")
        out[name] = value
    return out


def load_config(cli: Mapping[str, Any], command: list[str], *, config_path: str | None = None,
                environ: Mapping[str, str] | None = None) -> RunConfig:
    """Merge the sources into a validated RunConfig. ``cli`` maps option names to values,
    None meaning "not given"."""
    environ = os.environ if environ is None else environ
    path = Path(config_path) if config_path else Path(CONFIG_FILE)
    values: dict[str, Any] = {}
    values.update(_read_file(path, explicit=config_path is not None))
    for name in _CONVERTERS:
        env_value = environ.get(_env_name(name))
        if env_value not in (None, ""):
            values[name] = env_value
    values.update({k: v for k, v in cli.items() if v is not None and k in _CONVERTERS})
    converted = {name: _CONVERTERS[name](value) for name, value in values.items()}
    config = RunConfig(command=list(command), **converted)
    _validate(config)
    _check_training_environment(environ)
    return config


def _check_training_environment(environ: Mapping[str, str]) -> None:
    """Variables the training side reads: refused here, before anything starts, rather than
    by the command after it has loaded its data."""
    for switch in TRAINING_SWITCHES:
        switch.read(environ)


def _validate(config: RunConfig) -> None:
    if config.time_limit is not None and config.time_limit <= 0:
        raise UsageError("time-limit must be positive")
    if config.time_limit is not None and config.grace is not None \
            and config.grace >= config.time_limit:
        raise UsageError(
            f"grace ({config.grace:g}s) must be shorter than the time limit "
            f"({config.time_limit:g}s): the checkpoint is asked for at limit - grace"
        )
    if isinstance(config.interval, float) and config.interval <= 0:
        raise UsageError("interval must be positive")
    if config.mtbf <= 0:
        raise UsageError("mtbf must be positive: the expected time between failures")
    if config.node_rank >= config.nodes:
        raise UsageError(f"node-rank {config.node_rank} is not below nodes {config.nodes}: "
                         "number the nodes 0 to nodes-1, and give --nodes on every one")
    if config.nodes > 1 and config.engine == "dmtcp":
        raise UsageError("--nodes needs the hooks engine (procckpt.Checkpointer in the "
                         "script): a DMTCP image holds one node's processes")


def option_names() -> list[str]:
    return [f.name for f in fields(RunConfig) if f.name != "command"]
