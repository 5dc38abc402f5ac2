from pathlib import Path

import pytest

from procckpt.launcher.config import load_config
from procckpt.errors import UsageError

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def test_cli_beats_env_beats_file(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("time-limit: 1h\ngrace: 5m\nmax_restarts: 3\nkeep: 4\n")
    env = {"PROCCKPT_GRACE": "2m", "PROCCKPT_MAX_RESTARTS": "7"}
    config = load_config({"max_restarts": "9"}, ["true"], config_path=str(cfg), environ=env)
    assert config.time_limit == 3600  # file only
    assert config.grace == 120  # env beats file
    assert config.max_restarts == 9  # CLI beats env
    assert config.keep == 4


def test_config_file_in_cwd_is_read(tmp_path: Path, monkeypatch):
    (tmp_path / "procckpt.yaml").write_text("interval: 10m\n")
    monkeypatch.chdir(tmp_path)
    assert load_config({}, ["x"], environ={}).interval == 600


def test_unknown_key_lists_valid_ones(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("time_limt: 1h\n")
    with pytest.raises(UsageError, match="unknown option 'time_limt'.*time-limit"):
        load_config({}, ["x"], config_path=str(cfg), environ={})


def test_missing_explicit_config_is_an_error(tmp_path: Path):
    with pytest.raises(UsageError, match="does not exist"):
        load_config({}, ["x"], config_path=str(tmp_path / "nope.yaml"), environ={})


def test_bad_yaml_and_bad_values(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("grace: [1\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_config({}, ["x"], config_path=str(cfg), environ={})
    with pytest.raises(UsageError, match="whole number"):
        load_config({"max_restarts": "many"}, ["x"], environ={})
    with pytest.raises(UsageError, match="shorter than the time limit"):
        load_config({"time_limit": "10s", "grace": "20s"}, ["x"], environ={})
    with pytest.raises(UsageError, match="engine"):
        load_config({}, ["x"], environ={"PROCCKPT_ENGINE": "magic"})


def test_default_grace_scales_with_short_limits():
    config = load_config({"time_limit": "20s"}, ["x"], environ={})
    assert config.grace_for(20) == 5
    assert config.grace_for(3600) == 60


@pytest.mark.parametrize("option,value,says", [
    ("interval", "0", "0 is no duration; to turn it off say off"),
    ("hang_timeout", "0s", "0 is no duration; to turn it off say off"),
    ("interval", "1ms", "at least 1s (a shorter one would checkpoint at every step)"),
    ("hang_timeout", "2s", "at least 5s (the training reports its progress once a second"),
])
def test_a_zero_or_too_short_interval_or_hang_timeout_is_refused_with_the_reason(
        option: str, value: str, says: str):
    with pytest.raises(UsageError) as e:
        load_config({option: value}, ["x"], environ={})
    assert says in str(e.value), str(e.value)
    assert load_config({option: "off"}, ["x"], environ={}).__getattribute__(option) is None
