"""Bad input, from the command line, the environment, procckpt.yaml or the script itself, is one
line that says what to do, exit 2 (127 for a command that is not there), before anything is
lost: bad values, a script that cannot be checkpointed, a loop left the wrong way, a changed
model or batch size, a second training in one command."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from procckpt.protocol.events import read_events

from ..conftest import NO_CRIU_ENV, PROGRAMS, PYTHON, procckpt_argv, run
from ..harness.processes import (
    LOADER,
    TINY,
    alone,
    events,
    one_error_line,
    procckpt_lines,
    wait_for_line,
)


def test_missing_command_exits_127_with_one_line(workdir: Path):
    result = run([*procckpt_argv(), "run", "--", "no-such-program-xyz"], cwd=workdir)
    assert result.returncode == 127
    assert result.stderr.strip().splitlines() == [
        "procckpt: error: command not found: no-such-program-xyz (check the spelling and PATH)"]


@pytest.mark.parametrize("yaml_text, needle", [
    ("time-limit: null\n", "time-limit in procckpt.yaml is empty"),
    ("time-limit: [1, 2]\n", "time-limit in procckpt.yaml is a list"),
    ("time-limit: .inf\n", "more than ten years"),
    ("dir: null\n", "dir in procckpt.yaml is empty"),
])
def test_bad_config_values_are_one_line(workdir: Path, yaml_text: str, needle: str):
    (workdir / "procckpt.yaml").write_text(yaml_text)
    result = run([*procckpt_argv(), "run", "--", "true"], cwd=workdir)
    one_error_line(result, 2, needle)
    assert not (workdir / "None").exists()


@pytest.mark.parametrize("args, env, needle", [
    (["--time-limit", "9" * 400], {}, "more than ten years"),
    (["--time-limit", "nan"], {}, "bad time-limit"),
    ([], {"PROCCKPT_ASYNC": "maybe"}, "bad PROCCKPT_ASYNC='maybe'"),
])
def test_bad_values_from_the_command_line_and_environment_are_one_line(
        workdir: Path, args: list[str], env: dict[str, str], needle: str):
    result = run([*procckpt_argv(), "run", *args, "--", "true"], cwd=workdir, env=env)
    one_error_line(result, 2, needle)


def test_milliseconds_are_a_duration(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "60s", "--grace",
                  "2500ms", "--", *TINY, "--epochs", "1"], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_script_alone_says_bad_input_in_one_line(workdir: Path):
    ckpt = workdir / "ckpt"
    one_error_line(alone(workdir, ckpt, env={"PROCCKPT_ASYNC": "maybe"}), 2,
                   "bad PROCCKPT_ASYNC")
    restart = alone(workdir, ckpt, "--epochs", "1", env={"PROCCKPT_RESTART": "abc"})
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "ignoring PROCCKPT_RESTART='abc'" in restart.stderr


def test_command_without_checkpointer_is_stopped_with_an_explanation(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--time-limit", "4s", "--grace", "2s",
                  "--engine", "hooks", "--", "sleep", "30"], cwd=workdir, timeout=60)
    assert result.returncode == 124  # stopped, nothing saved (75 would mean "checkpointed")
    assert "never connected to procckpt" in result.stderr


def test_a_script_that_cannot_be_checkpointed_is_told_at_the_start(workdir: Path):
    script = workdir / "plain.py"
    script.write_text("import time\nfor i in range(100):\n    print(i, flush=True)\n"
                      "    time.sleep(0.2)\n")
    env = {"PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if not (Path(p) / "dmtcp_launch").exists()), **NO_CRIU_ENV}
    result = run([*procckpt_argv(), "run", "--time-limit", "6s", "--grace", "2s", "--",
                  PYTHON, str(script)], cwd=workdir, env=env)
    assert result.returncode == 124, result.stderr[-3000:]
    lines = procckpt_lines(result.stderr)
    warned = [i for i, line in enumerate(lines) if "does not import procckpt" in line]
    started = [i for i, line in enumerate(lines) if "cycle 1: started" in line]
    assert warned and started and warned[0] < started[0], lines
    assert "nothing was saved and a rerun starts from the beginning" in result.stderr
    assert "stays the one to resume" not in result.stderr


def test_a_script_that_reaches_procckpt_through_its_own_module_is_no_unsaveable_one(
        workdir: Path):
    """minGPT's shape: ``train.py`` imports ``mingpt.trainer``, which imports procckpt. The
    launcher follows the script's own imports: the hooks engine, and no warning that a stop
    loses everything."""
    (workdir / "mingpt").mkdir()
    (workdir / "mingpt" / "__init__.py").write_text("")
    (workdir / "mingpt" / "trainer.py").write_text(
        "import torch\nimport procckpt\n\n\ndef train():\n"
        "    model = torch.nn.Linear(2, 1)\n"
        "    ckpt = procckpt.Checkpointer(model=model)\n"
        "    for epoch in ckpt.epochs(2):\n        print('epoch', epoch, flush=True)\n")
    (workdir / "train.py").write_text("from mingpt.trainer import train\n\ntrain()\n")
    env = {"PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if not (Path(p) / "dmtcp_launch").exists())}
    result = run([*procckpt_argv(), "run", "--", PYTHON, "train.py"], cwd=workdir, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "does not import procckpt" not in result.stderr, result.stderr[-3000:]
    assert "engine: hooks (train.py (through mingpt/trainer.py) imports procckpt)" in \
        result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("loops", ["two-passes-an-epoch", "own-epoch-loop"])
def test_a_second_pass_of_batches_in_one_epoch_is_refused_before_it_trains(workdir: Path,
                                                                          loops: str):
    """Two ``ckpt.batches()`` in one epoch (a second task), or the script's own ``for epoch
    in range()`` around one: a checkpoint in the second pass would resume in the first, its
    batches trained twice. Refused at the first run, before the second pass trains, in one
    line that says what to write."""
    body = {"two-passes-an-epoch": "for epoch in ckpt.epochs(2):\n"
                                   "    for b in ckpt.batches(loader):\n        step(b)\n"
                                   "    for b in ckpt.batches(loader2):\n        step(b)\n",
            "own-epoch-loop": "for epoch in range(2):\n"
                              "    for b in ckpt.batches(loader):\n        step(b)\n"}[loops]
    script = workdir / "passes.py"
    script.write_text("import torch, procckpt\nfrom torch.utils.data import DataLoader\n"
                      "loader = DataLoader(list(range(16)), batch_size=2)\n"
                      "loader2 = DataLoader(list(range(8)), batch_size=2)\n"
                      "ckpt = procckpt.Checkpointer(model=torch.nn.Linear(1, 1))\n"
                      "def step(b):\n    print('trained', b.tolist(), flush=True)\n" + body)
    result = run([*procckpt_argv(), "run", "--dir", "c", "--", PYTHON, str(script)],
                 cwd=workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout.count("trained") == 8, result.stdout  # the first pass alone
    assert "Traceback" not in result.stderr
    want = "for epoch in ckpt.epochs(2 * n)" if loops == "two-passes-an-epoch" else \
        "for epoch in ckpt.epochs(n): for batch in ckpt.batches(loader)"
    assert want in result.stderr, result.stderr[-3000:]


def test_break_out_of_the_epochs_loop_says_what_to_write(workdir: Path):
    result = run([*procckpt_argv(), "run", "--dir", "c", "--", *LOADER, "--epochs", "5",
                  "--break-at-step", "13"], cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the ckpt.epochs() loop was left before its end" in result.stderr
    assert "call ckpt.finish() before break" in result.stderr
    assert "the training is not finished" in result.stderr
    assert "the run is not marked complete: running it again" in result.stderr
    assert not (workdir / "c" / "COMPLETE").exists()
    [ended] = [e for e in read_events(workdir / "c" / "events.jsonl") if e["event"] == "exit"]
    assert (ended["reason"], ended["code"]) == ("ended-early", 0)
    status = run([*procckpt_argv(), "status", "c"], cwd=workdir)
    assert "finished" not in status.stdout.splitlines()[0], status.stdout


def test_a_crash_inside_the_loop_is_not_taken_for_a_break(workdir: Path):
    result = run([*TINY, "--epochs", "3", "--fail-at-step", "3", "--ckpt-dir",
                  str(workdir / "c")], cwd=workdir)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "left before its end" not in result.stderr, result.stderr[-3000:]


def test_a_second_training_in_the_same_command_is_refused_in_one_line(workdir: Path):
    script = f"{PYTHON} {PROGRAMS / 'tiny_train.py'}"
    res = run([*procckpt_argv(), "run", "--dir", str(workdir / "c"), "--", "bash", "-c",
               f"{script} --epochs 1 && {script} --epochs 2 --n 64"], cwd=workdir)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "another one started with the same checkpoint dir" in res.stderr
    assert "give each training its own dir" in res.stderr and "Traceback" not in res.stderr
    assert "training finished\n" not in res.stderr


def test_a_changed_model_shape_is_said_in_one_line_with_exit_2(workdir: Path):
    argv = [*TINY, "--epochs", "3", "--n", "64", "--ckpt-dir", str(workdir / "c")]
    first = run([*argv, "--fail-at-step", "4"], cwd=workdir)  # saved at the end of epoch 0
    assert first.returncode == 3, first.stderr[-3000:]
    wider = run([*argv, "--width", "64"], cwd=workdir)
    assert wider.returncode == 2, wider.stderr[-3000:]
    assert "Traceback" not in wider.stderr, wider.stderr[-3000:]
    (line,) = [line for line in wider.stderr.splitlines() if "does not fit" in line]
    assert "the model saved in checkpoint ckpt-00000001 does not fit this script's model" in line
    assert "size mismatch for 0.weight" in line and "and 2 more" in line, line  # 0.bias, 3.weight


def test_a_resume_with_another_batch_size_says_what_it_passes_over_or_refuses(workdir: Path):
    ckpt = workdir / "ckpt"
    argv = [*procckpt_argv(), "run", "--dir", str(ckpt), "--", *TINY, "--epochs", "2",
            "--n", "512"]  # 16 batches of 32 an epoch
    proc = subprocess.Popen([*argv, "--step-sleep", "0.2"], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "step 4")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    (saved,) = events(ckpt, "checkpoint")
    batches = saved["step"]  # mid-epoch 0: the batches trained on
    assert 4 <= batches < 16, saved
    trained = 32 * batches
    odd = next(bs for bs in (48, 96, 160) if trained % bs)
    refused = run([*argv, "--batch-size", str(odd)], cwd=workdir)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"the batch size changed from 32 to {odd}" in refused.stderr
    assert "resume with batch size 32" in refused.stderr and "Traceback" not in refused.stderr
    halved = run([*argv, "--batch-size", "16"], cwd=workdir)
    assert halved.returncode == 0, halved.stderr[-3000:]
    assert (f"passing over {2 * batches} batches of 16 (the {trained} samples trained on), "
            f"not {batches}") in halved.stderr, halved.stderr[-3000:]
