"""``procckpt check`` tells a script that resumes exactly from one that does not, and
from one that is not deterministic at all; real scripts, real processes, real resumes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, procckpt_argv, run


def check(workdir: Path, *command: str, steps: int = 12, at: int | None = None,
          writes: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``procckpt check`` with its scratch dirs in a TMPDIR of its own, so that a test can
    see that it cleans up after itself; ``writes``: what the command itself writes into its
    working directory. The TMPDIR is short, in /tmp: DataLoader workers share tensors through
    a Unix socket there, whose path may not exceed 107 bytes (pytest's own dirs, numbered
    upwards, crossed that once and hung the workers)."""
    tmp = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    try:
        stop = [] if at is None else ["--at", str(at)]
        done = run([*procckpt_argv(), "check", "--steps", str(steps), *stop, "--", *command],
                   cwd=workdir, timeout=600, env={"TMPDIR": str(tmp)})
        # (torch keeps caches of its own there: torchinductor_root, torchelastic_*)
        assert not list(tmp.glob("procckpt-check-*")), "the check left its runs behind"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert sorted(p.name for p in workdir.iterdir()) == sorted(writes), \
        "the check wrote into the cwd"
    return done


def test_a_script_that_resumes_exactly_is_said_to_be_exact_run_by_run(workdir: Path):
    done = check(workdir, PYTHON, str(PROGRAMS / "tiny_train.py"), "--epochs", "3", "--n", "128")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    first, *details = done.stdout.splitlines()
    assert first == ("exact: stopped in the middle of an epoch at step 6 and at the end of an "
                     "epoch at step 4, each resumed in a new process, and bit-identical to the "
                     "run without a stop at every step to 12"), done.stdout
    assert "statefuls.model, statefuls.optimizer" in details[0], details
    assert "rng.torch" in details[0] and "progress" in details[0]
    # Each run is said as it ends, on stderr.
    said = [line for line in done.stderr.splitlines() if line.startswith("procckpt check: ")]
    assert [line.split(":")[1].split("(")[0].strip() for line in said] == [
        f"run {i} of 6" for i in range(1, 7)], said
    assert said[0].startswith("procckpt check: run 1 of 6 (without a stop): step 12/12 in ")
    assert said[2].startswith("procckpt check: run 3 of 6 (stopped at step 6): step 6/12 in ")
    assert said[3].startswith("procckpt check: run 4 of 6 (resumed from step 6): step 12/12 ")
    assert all("s of it before the first step" in line for line in said), said


def test_the_nanogpt_example_with_its_batch_fetched_ahead_is_exact(workdir: Path):
    done = check(workdir, PYTHON, str(EXAMPLES / "nanogpt_train.py"), "--max-iters", "30",
                 "--eval-every", "10", steps=12)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("exact: stopped in the middle at step 6"), done.stdout
    assert "extras.batch" in done.stdout.splitlines()[1], done.stdout


def test_a_recurrent_state_carried_in_a_local_differs_and_kept_in_extras_is_exact(
        workdir: Path):
    script = [PYTHON, str(EXAMPLES / "recurrent_train.py")]
    local = check(workdir, *script, "--hidden", "local", at=6)  # lost at the first resume
    assert local.returncode == 1, local.stdout + local.stderr[-3000:]
    first = local.stdout.splitlines()[0]
    assert first == ("differs: after the resume in the middle of an epoch at step 6, "
                     "statefuls.model differs from step 7 on"), local.stdout
    assert "likely: a value carried from one step to the next in a local variable" in \
        local.stdout
    # Which tensors differ, by their names in the model's state dict: where to look first.
    named = [line.strip() for line in local.stdout.splitlines()
             if line.strip().startswith("in statefuls.model, ")]
    assert named and " of 7 entries differ at step 7: " in named[0], local.stdout
    assert "1.weight_hh_l0" in named[0], local.stdout  # the weight the hidden state meets
    kept = check(workdir, *script, "--hidden", "extras")
    assert kept.returncode == 0, kept.stdout + kept.stderr[-3000:]
    assert kept.stdout.startswith("exact: ") and "extras.hidden" in kept.stdout, kept.stdout


def test_a_batch_fetched_ahead_outside_extras_differs(workdir: Path):
    done = check(workdir, PYTHON, str(PROGRAMS / "prefetch_train.py"), "--adapt", "naive",
                 "--max-iters", "30")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("differs: after the resume in the middle at step 6, "
                                  "statefuls.model, statefuls.optimizer differ from step 7"), \
        done.stdout
    assert "a batch fetched ahead" in done.stdout
    # The precise warning, printed only in the resumed run's own log, is shown with the
    # verdict; and why no stop was made at an epoch's end.
    assert "a run warned: the script drew random numbers after procckpt.Checkpointer() " \
           "resumed" in done.stdout, done.stdout
    assert "no stop at an epoch's end: no epoch ended within the 12 steps" in done.stdout


def test_a_stateful_dataloader_stopped_at_an_epochs_end_resumes_exactly(workdir: Path):
    """torchdata's StatefulDataLoader shuffling with a generator, stopped at an epoch's end:
    the next epoch must be dealt as in the uninterrupted run (the kill campaign found it
    dealt another order: looking at a fresh loader's state drew from its generator)."""
    if importlib.util.find_spec("torchdata") is None:
        pytest.skip("torchdata is not installed")
    done = check(workdir, PYTHON, str(PROGRAMS / "audit_train.py"), "--loader", "stateful",
                 "--workers", "2", "--epochs", "4", steps=12)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("exact: stopped in the middle of an epoch at step 6 and at "
                                  "the end of an epoch at step 8, each resumed"), done.stdout
    assert "loader_state" in done.stdout and "rng.loader_generators" in done.stdout, done.stdout


def test_a_script_seeded_from_the_clock_is_not_deterministic(workdir: Path):
    done = check(workdir, PYTHON, str(EXAMPLES / "recurrent_train.py"), "--hidden", "extras",
                 "--seed", "clock")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("not deterministic: two runs without a resume already "
                                  "differ in "), done.stdout
    assert "no seed from the clock" in done.stdout
    # The model starts from other weights: every tensor of it differs, and is named.
    assert "in statefuls.model, 7 of 7 entries differ at step 1: 0.weight, 1.weight_ih_l0" in \
        done.stdout, done.stdout


def test_a_two_rank_torchrun_script_is_checked_rank_by_rank(workdir: Path):
    torchrun = str(Path(PYTHON).parent / "torchrun")
    done = check(workdir, torchrun, "--standalone", "--nproc-per-node", "2",
                 str(EXAMPLES / "ddp_train.py"), "--epochs", "2", "--train-size", "256",
                 steps=8)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("exact: ") and "(2 ranks)" in done.stdout, done.stdout
    assert "ranks 0, 1: each exact" in done.stdout


def test_bad_input_is_said_in_one_line_with_exit_2(workdir: Path):
    plain = check(workdir, PYTHON, "-c", "print('no procckpt here')")
    assert plain.returncode == 2, plain.stdout + plain.stderr
    assert plain.stderr.strip().splitlines() == [
        "procckpt: error: the command reached no safe point of procckpt.Checkpointer: check "
        "needs a script that uses it (ckpt.epochs(), batches() or steps())"]
    short = check(workdir, PYTHON, str(PROGRAMS / "tiny_train.py"), "--epochs", "1", "--n", "32")
    assert short.returncode == 2 and "trained 1 step(s) in all: too few" in short.stderr, \
        short.stderr
    failing = check(workdir, PYTHON, "-c", "import sys; sys.exit('broken script')")
    assert failing.returncode == 2 and "failed with exit code 1: broken script" in \
        failing.stderr, failing.stderr


def test_a_missing_command_is_said_at_once(workdir: Path):
    started = time.monotonic()
    done = check(workdir, "nosuchcommand", "--epochs", "1")
    assert done.returncode == 127, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "procckpt: error: command not found: nosuchcommand (check the spelling and PATH)"]
    assert time.monotonic() - started < 30  # no launcher, no torch was started for it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_check_leaves_no_dir_and_no_process(workdir: Path, signum: int):
    tmp = workdir / "tmp"
    tmp.mkdir()
    marker = str(workdir / "never-written.pt")
    proc = subprocess.Popen([*procckpt_argv(), "check", "--steps", "40", "--", PYTHON,
                             str(PROGRAMS / "tiny_train.py"), "--epochs", "10", "--n", "128",
                             "--step-sleep", "0.5", "--out", marker], cwd=workdir,
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not list(tmp.glob("procckpt-check-*/a.trace.0")):  # the first run is training
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    assert _processes_naming(marker), "the check's run should be training now"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, out + err
    assert err.strip().splitlines()[-1] == (
        f"procckpt: error: check stopped by {signal.Signals(signum).name}: its runs were "
        "stopped and their files removed"), err
    assert not list(tmp.glob("procckpt-check-*")), "the check left its runs behind"
    assert _processes_naming(marker) == []


def test_a_check_killed_outright_leaves_no_process(workdir: Path):
    """SIGKILL (by hand, the OOM killer): no handler runs, so the files stay, but the run it
    had started (launcher, keeper, training) must not train on with nobody to stop it."""
    tmp = workdir / "tmp"
    tmp.mkdir()
    marker = str(workdir / "never-written.pt")
    proc = subprocess.Popen([*procckpt_argv(), "check", "--steps", "40", "--", PYTHON,
                             str(PROGRAMS / "tiny_train.py"), "--epochs", "10", "--n", "128",
                             "--step-sleep", "1", "--out", marker], cwd=workdir,  # 40 s
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not list(tmp.glob("procckpt-check-*/a.trace.0")):  # the first run is training
            assert proc.poll() is None and time.monotonic() < deadline, "no run trained"
            time.sleep(0.2)
        assert _processes_naming(marker), "the check's run should be training now"
        proc.kill()
        proc.wait(timeout=60)
        until = time.monotonic() + 10
        while _processes_naming(marker) and time.monotonic() < until:
            time.sleep(0.1)
        assert _processes_naming(marker) == [], "the check's run outlived it"
    finally:
        for pid in _processes_naming(marker):
            os.kill(pid, signal.SIGKILL)


def _processes_naming(text: str) -> list[int]:
    """The processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def test_an_ema_in_no_checkpoint_is_named_and_compared(workdir: Path):
    script = [PYTHON, str(PROGRAMS / "tiny_train.py"), "--epochs", "3", "--n", "128"]
    # The EMA is lost at the first resume: one stop, in the middle of an epoch, shows it, and
    # one shows it kept (four runs of the script each, not six).
    unsaved = check(workdir, *script, "--ema", "unsaved", at=6)
    assert unsaved.returncode == 1, unsaved.stdout + unsaved.stderr[-3000:]
    first, *details = unsaved.stdout.splitlines()
    assert first.startswith("differs: after the resume in the middle of an epoch at step 6, "
                            "unsaved.ema differs from step 7 on"), unsaved.stdout
    assert ("certain: ema is in no checkpoint (ema (AveragedModel, in main())), so a resume "
            "starts it afresh: pass it to the Checkpointer (Checkpointer(..., ema=ema))") in \
        unsaved.stdout
    # The same kept the common way, as tensors updated in place, is found and compared too.
    tensors = check(workdir, *script, "--ema", "tensors", at=6)
    assert tensors.returncode == 1, tensors.stdout + tensors.stderr[-3000:]
    assert tensors.stdout.startswith("differs: after the resume in the middle of an epoch at "
                                     "step 6, unsaved.ema differs from step 7 on"), tensors.stdout
    assert ("certain: ema is in no checkpoint (ema (a list of 4 tensors, in main())), so a "
            "resume starts it afresh: pass it to the Checkpointer (Checkpointer(..., ema=ema)), "
            "or, for tensors, keep it in ckpt.extras (ckpt.extras['ema'] = ema; take it from "
            "there after a resume)") in tensors.stdout, tensors.stdout
    saved = check(workdir, *script, "--ema", "saved", at=6)
    assert saved.returncode == 0, saved.stdout + saved.stderr[-3000:]
    assert "statefuls.ema" in saved.stdout and "unsaved" not in saved.stdout, saved.stdout


def test_a_resumed_run_names_what_no_checkpoint_holds(workdir: Path):
    argv = [PYTHON, str(PROGRAMS / "tiny_train.py"), "--epochs", "2", "--n", "128",
            "--ckpt-dir", str(workdir / "ckpt"), "--ema", "unsaved"]
    # On its own the script saves at each epoch's end (4 steps); it fails at step 6.
    first = run([*argv, "--fail-at-step", "6"], cwd=workdir)
    assert first.returncode == 3, first.stderr[-3000:]
    assert "in no checkpoint" not in first.stderr  # nothing was resumed: nothing to say
    again = run(argv, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith("start step 4 "), again.stdout[:200]
    said = [line for line in again.stderr.splitlines() if "in no checkpoint" in line]
    assert len(said) == 1 and said[0].endswith(
        "resumed, but ema (AveragedModel, in main()) is in no checkpoint, so it starts "
        "afresh: if it changes during training, pass it to the Checkpointer "
        "(Checkpointer(..., ema=ema)), or, for tensors, keep it in ckpt.extras "
        "(ckpt.extras['ema'] = ema; take it from there after a resume)"), again.stderr[-3000:]
    # Handed to the Checkpointer: nothing to say on the resume.
    saved = [*argv[:-1], "saved", "--ckpt-dir", str(workdir / "other")]
    assert run([*saved, "--fail-at-step", "6"], cwd=workdir).returncode == 3
    registered = run(saved, cwd=workdir)
    assert registered.returncode == 0, registered.stderr[-3000:]
    assert registered.stdout.startswith("start step 4 ") and \
        "in no checkpoint" not in registered.stderr, registered.stderr[-3000:]


def test_a_stop_asked_at_an_epochs_last_batch_is_exact(workdir: Path):
    """Step 32 is the last of 32 batches: the checkpoint waits for the epoch's closing code
    (``best`` from the last batch's loss); on the old code the resumed run crashed there."""
    tmp = workdir / "tmp"
    tmp.mkdir()
    done = run([*procckpt_argv(), "check", "--steps", "40", "--at", "32", "--", PYTHON,
                str(PROGRAMS / "closing_train.py"), "--out", str(tmp / "out.pt")],
               cwd=workdir, timeout=600, env={"TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("exact: stopped at the end of an epoch at step 32, "), (
        done.stdout)


def test_lightning_with_its_default_logger_and_model_checkpoint_is_exact(
        workdir: Path, tmp_path_factory):
    """Lightning's default logger opens lightning_logs/version_N anew in every run, and that
    path lands in ModelCheckpoint's state: the check leaves the logger's number out, and does
    not call a seeded script "not deterministic" for it."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    scripts = tmp_path_factory.mktemp("script")
    source = (EXAMPLES / "lightning_train.py").read_text()
    defaults = source.replace("logger=False, enable_checkpointing=False,", "")
    assert defaults != source
    (scripts / "train.py").write_text(defaults)
    (scripts / "framework_common.py").write_text((EXAMPLES / "framework_common.py").read_text())
    done = check(workdir, PYTHON, str(scripts / "train.py"), "--epochs", "2", steps=30,
                 writes=("lightning_logs",))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("exact: "), done.stdout
    assert "framework.callbacks" in done.stdout, done.stdout
