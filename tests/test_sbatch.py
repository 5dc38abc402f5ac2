"""procckpt sbatch: the generated job scripts against the golden files in jobscripts/, the
scripts are valid bash, and the sorting of options (pass-through, procckpt run's, Pyxis', the
sbatch command's own) with its one-line errors."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from procckpt.errors import UsageError
from procckpt.schedulers.sbatch import parse_sbatch_args, render_job_script

from .conftest import PYTHON, REPO, procckpt_argv, run

JOBSCRIPTS = REPO / "jobscripts"

#: jobscripts/NAME.sh is what `procckpt sbatch --dry-run ARGS` prints, run from the repository.
CASES: dict[str, list[str]] = {
    "requeue": ["-t", "4:00:00", "-J", "train", "-o", "train-%j.out", "--",
                "python", "train.py", "--epochs", "90"],
    "gpu": ["-t", "12:00:00", "-p", "gpu", "--gres=gpu:4", "--cpus-per-task=32", "--mem=200G",
            "-J", "ddp", "--max-restarts", "50", "--",
            "torchrun", "--standalone", "--nproc-per-node=4", "train.py"],
    "chain": ["--chain", "10", "-t", "4:00:00", "-J", "train", "--", "python", "train.py"],
    "container": ["-t", "4:00:00", "--gres=gpu:1",
                  "--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
                  "--container-mounts=/scratch:/scratch", "--dir", "/scratch/me/ckpt", "--",
                  "python", "train.py"],
    "wrapped": ["--", "jobscripts/my-job.sbatch"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_job_script_matches_its_golden_file(name: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)  # the wrapped case names its script relative to the repository
    text = render_job_script(parse_sbatch_args(CASES[name]))
    golden = JOBSCRIPTS / f"{name}.sh"
    if not golden.exists():
        golden.write_text(text)
        pytest.fail(f"wrote the missing golden file {golden}: read it, then run the tests again")
    expected = golden.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"{golden} (golden)", "generated now"))
        pytest.fail(f"the generated job script changed:\n{diff}\nDelete the golden file "
                    f"{golden} and run the tests again if this change is intended.")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_prints_a_valid_bash_script(name: str, tmp_path: Path):
    result = run([*procckpt_argv(), "sbatch", "--dry-run", *CASES[name]], cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n#SBATCH ")
    script = tmp_path / "job.sh"
    script.write_text(result.stdout)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines()
            if line.startswith("#SBATCH ")]


def last_line(text: str) -> str:
    return text.rstrip("\n").splitlines()[-1]


def test_sbatch_options_pass_through_in_order_and_run_options_go_to_procckpt_run():
    spec = parse_sbatch_args(["-t", "1", "--mem=4G", "-J", "my job", "--exclusive", "-N2",
                              "--dir", "/shared/ckpt", "--grace", "20s", "--keep", "3",
                              "--restart-on-failure", "--", "python", "train.py", "--lr", "0.1"])
    text = render_job_script(spec)
    assert directives(text) == ["--requeue", "--open-mode=append", "--signal=B:USR1@20",
                                "-t 1", "--mem=4G", '-J "my job"', "--exclusive", "-N2"]
    assert last_line(text) == ("exec procckpt run --dir /shared/ckpt --grace 20s --keep 3 "
                               "--restart-on-failure -- python train.py --lr 0.1")


@pytest.mark.parametrize("limit, grace", [("1", 15), ("10", 60), ("2:00", 30), ("1-0", 60),
                                          ("UNLIMITED", 60)])
def test_signal_time_is_the_default_grace_of_the_time_limit(limit: str, grace: int):
    text = render_job_script(parse_sbatch_args(["--time", limit, "--", "x"]))
    assert f"--signal=B:USR1@{grace}" in directives(text)


def test_a_signal_of_the_users_own_is_kept_and_becomes_the_checkpoint_signal(caplog):
    text = render_job_script(parse_sbatch_args(["--signal=B:URG@90", "--", "x"]))
    assert [d for d in directives(text) if d.startswith("--signal")] == ["--signal=B:URG@90"]
    assert last_line(text) == "exec procckpt run --checkpoint-signal URG -- x"
    render_job_script(parse_sbatch_args(["--signal=USR1@90", "--", "x"]))
    assert "--signal=USR1@90 has no 'B:'" in caplog.text


def test_sbatch_command_options_stay_on_its_command_line():
    spec = parse_sbatch_args(["--parsable", "-W", "-t", "5", "--", "x"])
    assert spec.submit_options == ["--parsable", "-W"]
    assert directives(render_job_script(spec))[-1] == "-t 5"


def test_chain_mode_is_an_array_with_one_log_and_no_requeue():
    text = render_job_script(parse_sbatch_args(["--chain", "4", "-t", "1", "--", "x"]))
    assert directives(text) == ["--array=1-4%1", "--open-mode=append", "--signal=B:USR1@15",
                                "--output=slurm-%A.out", "-t 1"]
    assert "export PROCCKPT_SLURM_CHAIN=1\n" in text
    own_log = render_job_script(parse_sbatch_args(["--chain", "4", "-o", "x.log", "--", "x"]))
    assert "--output=slurm-%A.out" not in directives(own_log)


def test_container_options_go_to_srun_and_the_shell_requeues_from_outside():
    text = render_job_script(parse_sbatch_args(
        ["-t", "1", "--container-image", "pytorch.sqsh", "--container-mounts=/d:/d",
         "--max-restarts", "3", "--", "python", "t.py"]))
    assert not any(d.startswith(("--container", "--signal")) for d in directives(text))
    assert ("srun --ntasks=1 --container-image pytorch.sqsh --container-mounts=/d:/d procckpt "
            "run --max-restarts 3 -- python t.py\n") in text
    assert "max_restarts=3\n" in text and 'scontrol requeue "$SLURM_JOB_ID" && exit 0' in text


def test_a_wrapped_script_keeps_its_directives_and_runs_under_procckpt(tmp_path: Path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n#SBATCH -t 2:00:00\n#SBATCH -J old\npython train.py\n")
    job.chmod(0o755)
    text = render_job_script(parse_sbatch_args(["-J", "new", "--", "./job.sh", "a"]))
    assert directives(text) == ["--requeue", "--open-mode=append", "--signal=B:USR1@60",
                                "-t 2:00:00", "-J old", "-J new"]  # the command line wins
    assert last_line(text) == "exec procckpt run -- ./job.sh a"
    job.chmod(0o644)
    assert last_line(render_job_script(parse_sbatch_args(["--", "job.sh"]))) == \
        "exec procckpt run -- bash job.sh"


@pytest.mark.parametrize("argv, message", [
    (["-t", "1", "python", "train.py"], "put the command to run after '--'"),
    (["-t", "1", "--"], "no command after '--'"),
    (["-t", "1", "train.py", "--", "x"], "unexpected 'train.py' before '--'"),
    (["--no-requeue", "--", "x"], "use --chain N instead"),
    (["--open-mode=truncate", "--", "x"], "--open-mode=truncate loses the log"),
    (["--chain", "3", "--array=1-9", "--", "x"], "drop --array"),
    (["--chain", "0", "--", "x"], "--chain must be at least 1"),
    (["--time-limit", "1h", "--", "x"], "the time limit is the job's own: use -t/--time"),
    (["--force", "--", "x"], "would archive the checkpoints at every restart"),
    (["-t", "soon", "--", "x"], "bad time limit 'soon'"),
    (["-t", "1", "--grace", "2m", "--", "x"], "grace (120s) must be shorter than the time limit"),
    (["--checkpoint-signal", "KILL", "--", "x"], "bad checkpoint-signal 'KILL'"),
])
def test_bad_input_is_one_line_that_says_what_to_do(argv: list[str], message: str):
    with pytest.raises(UsageError, match=None) as info:
        parse_sbatch_args(argv)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_without_sbatch_says_so_in_one_line(tmp_path: Path):
    env = {"PATH": str(tmp_path)}  # no sbatch anywhere on it
    result = subprocess.run([PYTHON, "-m", "procckpt", "sbatch", "-t", "1", "--", "x"],
                            cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == ("procckpt: error: sbatch not found: is this a Slurm login "
                                     "node? Use --dry-run to see the job script instead")
    bad = run([*procckpt_argv(), "sbatch", "--no-requeue", "--", "x"], cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_the_signal_lead_is_read_as_procckpt_run_reads_it(tmp_path: Path):
    # procckpt run in the job reads procckpt.yaml and $PROCCKPT_GRACE; the --signal lead
    # that procckpt sbatch writes must be the same.
    argv = [*procckpt_argv(), "sbatch", "--dry-run", "-t", "30", "--", "python", "t.py"]
    plain = run(argv, cwd=tmp_path)
    assert plain.returncode == 0 and "#SBATCH --signal=B:USR1@60" in plain.stdout, plain.stderr
    (tmp_path / "procckpt.yaml").write_text("grace: 2m\ncheckpoint-signal: URG\n")
    from_file = run(argv, cwd=tmp_path)
    assert from_file.returncode == 0, from_file.stderr
    assert "#SBATCH --signal=B:URG@120" in from_file.stdout, from_file.stdout
    from_env = run(argv, cwd=tmp_path, env={"PROCCKPT_GRACE": "90s"})
    assert "#SBATCH --signal=B:URG@90" in from_env.stdout, from_env.stdout
    given = run([*argv[:4], "--grace", "45s", *argv[4:]], cwd=tmp_path,
                env={"PROCCKPT_GRACE": "90s"})
    assert "#SBATCH --signal=B:URG@45" in given.stdout, given.stdout
    (tmp_path / "procckpt.yaml").write_text("grace: 40m\n")
    too_long = run(argv, cwd=tmp_path)
    assert too_long.returncode == 2 and "must be shorter than the time limit" in \
        too_long.stderr, too_long.stderr
