import re
from pathlib import Path

import pytest

from procckpt.errors import UsageError
from procckpt.launcher.config import OPTIONS, load_config

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


def test_cli_beats_env_beats_file(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("time-limit: 1h\ngrace: 5m\nmax_restarts: 3\nkeep: 4\n")
    env = {"PROCCKPT_GRACE": "2m", "PROCCKPT_MAX_RESTARTS": "7"}
    not_given = {name: None for name in OPTIONS}  # what click passes for an option not given
    config = load_config({**not_given, "max_restarts": "9"}, ["true"], config_path=str(cfg),
                         environ=env)
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


#: A value for every run option, and what it reads as: a new option must be added here, so
#: that the checks below cover it.
SAMPLES = {
    "dir": ("ckpts", Path("ckpts")), "time_limit": ("2h", 7200.0), "grace": ("90s", 90.0),
    "interval": ("30m", 1800.0), "mtbf": ("6h", 21600.0), "hang_timeout": ("off", None),
    "max_restarts": ("3", 3), "restart_on_failure": ("true", True), "engine": ("hooks", "hooks"),
    "memory_tier": ("false", False), "warm_restarts": ("false", False),
    "keep": ("5", 5), "force": ("yes", True), "term_timeout": ("30s", 30.0),
    "checkpoint_signal": ("SIGURG", "URG"), "audit": ("Strict", "strict"), "nodes": ("4", 4),
    "node_rank": ("2", 2),
}


def test_every_run_option_is_declared_once_and_read_from_every_source(tmp_path: Path):
    from dataclasses import fields

    from click.testing import CliRunner

    from procckpt.cli import cli
    from procckpt.launcher.config import OPTIONS, RunConfig

    # command is the positional argument; remote is derived from --dir (an s3:// URL).
    declared = [f.name for f in fields(RunConfig) if f.name not in ("command", "remote")]
    assert list(OPTIONS) == declared and set(SAMPLES) == set(declared)
    help_text = CliRunner().invoke(cli, ["run", "--help"]).output
    run_params = {p.name: p for p in cli.commands["run"].params}
    for name, option in OPTIONS.items():
        given, expected = SAMPLES[name]
        assert set(option.flags()) == {*run_params[name].opts, *run_params[name].secondary_opts}
        assert option.flag in help_text and run_params[name].help.startswith(option.help)
        others = {"nodes": "4"} if name == "node_rank" else {}  # a rank needs its nodes
        from_env = load_config(others, ["x"], environ={option.env: given})
        yaml_file = tmp_path / f"{name}.yaml"
        yaml_file.write_text(f"{option.flag[2:]}: {given}\n")
        from_yaml = load_config(others, ["x"], config_path=str(yaml_file), environ={})
        from_cli = load_config({**others, name: given}, ["x"], environ={})
        assert getattr(from_env, name) == getattr(from_yaml, name) == getattr(from_cli, name) \
            == expected, name


def test_sbatch_and_k8s_take_run_options_from_the_table(tmp_path: Path, monkeypatch):
    from procckpt.cli import main
    from procckpt.launcher.config import OPTIONS, PASSED_ON, SBATCH_OWN
    from procckpt.schedulers.sbatch import parse_sbatch_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PROCCKPT_GRACE", raising=False)
    for name, option in OPTIONS.items():
        given = [option.flag] if option.kind != "value" else [option.flag, SAMPLES[name][0]]
        argv = [*given, "-t", "4:00:00", "--", "python", "train.py"]
        if option.sbatch == PASSED_ON:
            assert parse_sbatch_args(argv).run_options == given, name
        elif option.sbatch == SBATCH_OWN:
            assert given in parse_sbatch_args(argv).directives, name
        else:
            with pytest.raises(UsageError, match=re.escape(option.sbatch)):
                parse_sbatch_args(argv)
    # A bad value is refused by sbatch and k8s with the words of procckpt run.
    with pytest.raises(UsageError) as by_run:
        load_config({"grace": "soon"}, ["x"], environ={})
    with pytest.raises(UsageError) as by_sbatch:
        parse_sbatch_args(["--grace", "soon", "--", "x"])
    assert str(by_sbatch.value) == str(by_run.value)
    k8s = ["k8s", "--image", "i", "--pvc", "c"]
    assert main([*k8s, "--grace", "soon", "--", "x"]) == 2
    # One grace-versus-limit rule: run, sbatch and k8s say the same.
    messages = []
    for attempt in (lambda: load_config({"grace": "2m", "time_limit": "1m"}, ["x"], environ={}),
                    lambda: parse_sbatch_args(["--grace", "2m", "-t", "1", "--", "x"]),
                    lambda: main([*k8s, "--grace", "2m", "--time-limit", "1m", "--", "x"])):
        try:
            code = attempt()
        except UsageError as e:
            messages.append(str(e))
        else:
            assert code == 2
    assert messages[0] == messages[1]


def test_k8s_grace_is_read_like_runs(capsys: pytest.CaptureFixture[str]):
    import yaml

    from procckpt.cli import main

    k8s = ["k8s", "--image", "i", "--pvc", "c"]
    assert main([*k8s, "--grace", "1:30", "--", "python", "t.py"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 90
    command = pod["containers"][0]["command"]
    assert "90" in command[command.index("--grace") + 1]
    # No --grace: the run's default for the limit (a quarter of a short one).
    assert main([*k8s, "--time-limit", "2m", "--", "python", "t.py"]) == 0
    pod = yaml.safe_load(capsys.readouterr().out)["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert "30" in command[command.index("--grace") + 1]
    assert main([*k8s, "--grace", "2m", "--time-limit", "1m", "--", "x"]) == 2
    assert "grace (120s) must be shorter than the time limit (60s)" in capsys.readouterr().err


def test_an_s3_dir_keeps_its_url_and_gets_a_local_dir(tmp_path: Path, monkeypatch):
    from procckpt.errors import UsageError
    from procckpt.launcher.config import config_from

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PROCCKPT_LOCAL_DIR", raising=False)
    config = config_from({"dir": "s3://team-ckpts/runs/bert/"}, ["python", "t.py"])
    assert config.remote == "s3://team-ckpts/runs/bert"
    assert config.dir == tmp_path / "procckpt-local" / "team-ckpts" / "runs" / "bert"
    monkeypatch.setenv("PROCCKPT_LOCAL_DIR", str(tmp_path / "node-local"))
    assert config_from({"dir": "s3://team-ckpts/x"}, ["t"]).dir == tmp_path / "node-local"
    assert config_from({"dir": "ckpt"}, ["t"]).remote is None
    for bad in ("s3://", "s3://Bad_Bucket/x", "s3://ok-bucket/../x"):
        with pytest.raises(UsageError, match="expected s3://BUCKET/PREFIX"):
            config_from({"dir": bad}, ["t"])
