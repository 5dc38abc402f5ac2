"""The first-batch audit end to end (training/audit.py): a run stopped mid-epoch records the batch
it was about to train on; the resumed run compares its first batch with it. A resume whose data
position was broken on purpose (another epoch's order, one batch skipped, the data changed) is
told in one line, or stopped under ``--audit strict`` with exit code 66 and not restarted; a
faithful resume says nothing and is journalled as the same. The frameworks' case runs in
tests/e2e/test_streaming.py's programs (Lightning, the Trainer, Accelerate over a stream)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import cycles_stopped_at, events, heartbeat_step, stopped_once
from .test_torchrun import TORCHRUN

AUDITED = [PYTHON, str(PROGRAMS / "audit_train.py")]
STREAMED = PROGRAMS / "stream_frameworks.py"


def trained(stdout: str) -> list[list[int]]:
    return [list(map(int, line.split(" trained ")[1].split())) for line in stdout.splitlines()
            if line.startswith("step ") and " trained " in line]


def audit_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "resume audit:" in line]


def stopped_at_step_4(workdir: Path, ckpt: Path, *args: str) -> list[list[int]]:
    first = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *AUDITED, "--stop-at", "3",
                 *args], cwd=workdir)
    assert first.returncode == 75, first.stderr[-3000:]
    assert (ckpt / "audit" / "rank-0.json").exists()
    return trained(first.stdout)


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_a_faithful_resume_is_audited_and_says_nothing(workdir: Path, loader: str):
    if loader == "stateful" and importlib.util.find_spec("torchdata") is None:
        pytest.skip("torchdata is not installed")
    reference = run([*AUDITED, "--loader", loader], cwd=workdir,
                    env={"PROCCKPT_DIR": str(workdir / "ref")})
    assert reference.returncode == 0, reference.stderr[-3000:]
    ckpt = workdir / "ckpt"
    before = stopped_at_step_4(workdir, ckpt, "--loader", loader)
    resumed = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--audit", "strict", "--",
                   *AUDITED, "--loader", loader], cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not audit_lines(resumed.stderr), resumed.stderr[-3000:]
    assert before + trained(resumed.stdout) == trained(reference.stdout)
    [verdict] = events(ckpt, "audit")
    assert (verdict["checkpoint"], verdict["batch"], verdict["verdict"]) == \
        ("ckpt-00000001", 4, "same")
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert "resume audits: 1 same" in status.stdout, status.stdout


@pytest.mark.parametrize(("loader", "corrupt"), [("plain", "epoch"), ("plain", "data"),
                                                 ("stateful", "skip")])
def test_a_broken_data_position_is_told_in_one_line_and_strict_stops_it(
        workdir: Path, loader: str, corrupt: str):
    if loader == "stateful" and importlib.util.find_spec("torchdata") is None:
        pytest.skip("torchdata is not installed")
    warned, strict = workdir / "warned", workdir / "strict"
    for ckpt in (warned, strict):
        stopped_at_step_4(workdir, ckpt, "--loader", loader)
    goes_on = run([*procckpt_argv(), "run", "--dir", str(warned), "--", *AUDITED, "--loader",
                   loader, "--corrupt", corrupt], cwd=workdir, env={"PROCCKPT_AUDIT": ""})
    assert goes_on.returncode == 0, goes_on.stderr[-3000:]
    [line] = audit_lines(goes_on.stderr)
    assert "batch 4 of epoch 0 (step 4), the first after ckpt-00000001, is not what the " \
           "interrupted run was about to train on" in line, line
    assert line.endswith("training goes on (--audit strict would stop here)"), line  # warn:
    # the default (the suite's conftest sets strict)
    assert [e["verdict"] for e in events(warned, "audit")] == ["differs"]

    stopped = run([*procckpt_argv(), "run", "--dir", str(strict), "--audit", "strict", "--",
                   *AUDITED, "--loader", loader, "--corrupt", corrupt], cwd=workdir)
    assert stopped.returncode == 66, stopped.stderr[-3000:]
    assert not trained(stopped.stdout), stopped.stdout  # not one step on the wrong batch
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert "stopped before training on it (--audit strict)" in stopped.stderr
    assert "a restart would resume the same way, so it is not restarted" in stopped.stderr
    assert len(events(strict, "cycle")) == 2  # the stopped run's, the resume's: no restart
    assert [e["verdict"] for e in events(strict, "audit")] == ["refused"]
    status = run([*procckpt_argv(), "status", str(strict)], cwd=workdir)
    assert "resume audits: 1 refused (last that differed: ckpt-00000001, batch 4 of epoch 0" \
        in status.stdout, status.stdout


def test_a_steps_loop_is_audited_by_what_each_step_starts_from(workdir: Path):
    """ckpt.steps() hands out numbers; the script draws each step's samples and fetches the next
    batch ahead into ckpt.extras (nanoGPT's shape). The audit compares what the first step after
    a resume starts from: a faithful resume is the same, one whose script fetches the batch again
    over the restored one is stopped."""
    steps = ("--steps", "12")
    reference = run([*AUDITED, *steps], cwd=workdir, env={"PROCCKPT_DIR": str(workdir / "ref")})
    assert reference.returncode == 0, reference.stderr[-3000:]
    faithful, broken = workdir / "faithful", workdir / "broken"
    befores = [stopped_at_step_4(workdir, ckpt, *steps) for ckpt in (faithful, broken)]
    resumed = run([*procckpt_argv(), "run", "--dir", str(faithful), "--", *AUDITED, *steps],
                  cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert befores[0] + trained(resumed.stdout) == trained(reference.stdout)
    assert [e["verdict"] for e in events(faithful, "audit")] == ["same"]
    stopped = run([*procckpt_argv(), "run", "--dir", str(broken), "--", *AUDITED, *steps,
                   "--corrupt", "extras"], cwd=workdir)
    assert stopped.returncode == 66, stopped.stderr[-3000:]
    [line] = audit_lines(stopped.stderr)
    assert "what step 5 starts from (the random streams and ckpt.extras), the first after " \
           "ckpt-00000001, is not what the interrupted run was about to train on" in line, line
    assert "a batch fetched ahead written into ckpt.extras again before the loop" in line


def test_lightning_over_a_stream_made_in_process_with_a_random_transform_resumes_exactly(
        workdir: Path):
    """The stream's batches are made in the training process (no workers) and draw noise from
    the global stream as Lightning fetches each one ahead of its step. The batch fetched before
    a checkpoint must get the same noise in the resumed run, or the audit (strict) stops it:
    it did, until such a fetch drew from seeds of the epoch and the batch's number."""
    if importlib.util.find_spec("lightning") is None or \
            importlib.util.find_spec("torchdata") is None:
        pytest.skip("lightning and torchdata are not installed")
    args = ["--framework", "lightning", "--workers", "0", "--noise"]
    expected = workdir / "reference.pt"
    ref = run([PYTHON, str(STREAMED), *args, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # 2 epochs of 100 steps, stopped (then run again) in the middle of each.
    cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--audit", "strict", "--", PYTHON,
                       str(STREAMED), *args, "--step-sleep", "0.15", "--out", str(out)],
                      workdir, ckpt, [30, 130], timeout=900)
    verdicts = [e["verdict"] for e in events(ckpt, "audit")]
    assert verdicts == ["same", "same"], verdicts
    assert_bit_identical(expected, out)


def test_a_bad_audit_mode_is_refused_before_the_command_starts(workdir: Path):
    bad = run([*procckpt_argv(), "run", "--audit", "loud", "--", "true"], cwd=workdir)
    assert bad.returncode == 2 and "bad audit 'loud': choose strict" in bad.stderr, bad.stderr
    alone = run([*AUDITED], cwd=workdir, env={"PROCCKPT_AUDIT": "loud"})
    assert alone.returncode == 2, alone.stderr[-3000:]
    assert "bad PROCCKPT_AUDIT='loud'" in alone.stderr and "Traceback" not in alone.stderr


def test_in_a_group_the_rank_whose_batch_differs_is_named_and_strict_stops_every_rank(
        workdir: Path):
    """2 gloo ranks under torchrun with a DistributedSampler; on a resume rank 1's sampler is
    told another epoch. Every rank compares its own first batch, and one all-reduce tells the
    group which differ: rank 0's journal names rank 1, and under strict every rank stops (torchrun
    exits 1; the launcher knows why from the rank's report, and restarts nothing)."""
    group = [TORCHRUN, "--standalone", "--nproc-per-node=2", str(PROGRAMS / "audit_train.py"),
             "--ddp"]
    warned, strict = workdir / "warned", workdir / "strict"
    for ckpt in (warned, strict):
        # (4 batches a rank an epoch: a stop asked for at step 1 is taken after step 2)
        first = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", *group, "--stop-at",
                     "1"], cwd=workdir, timeout=300)
        assert first.returncode == 75, first.stderr[-3000:]
        assert {p.name for p in (ckpt / "audit").iterdir()} == {"rank-0.json", "rank-1.json"}
    corrupt = ("--corrupt", "epoch", "--corrupt-rank", "1")
    goes_on = run([*procckpt_argv(), "run", "--dir", str(warned), "--audit", "warn", "--",
                   *group, *corrupt], cwd=workdir, timeout=300)
    assert goes_on.returncode == 0, goes_on.stderr[-3000:]
    assert len(audit_lines(goes_on.stderr)) == 1, goes_on.stderr[-3000:]  # rank 1's
    assert [e["verdict"] for e in events(warned, "audit")] == ["differs on rank 1"]
    stopped = run([*procckpt_argv(), "run", "--dir", str(strict), "--audit", "strict", "--",
                   *group, *corrupt], cwd=workdir, timeout=300)
    assert stopped.returncode == 66, stopped.stderr[-3000:]
    assert not trained(stopped.stdout), stopped.stdout
    assert "differs on rank 1 of the group" in stopped.stderr, stopped.stderr[-3000:]
    assert [e["verdict"] for e in events(strict, "audit")] == ["refused"]
    assert len(events(strict, "cycle")) == 2


@pytest.mark.parametrize("framework", ["accelerate", "lightning", "trainer"])
def test_a_framework_resume_whose_batches_changed_is_stopped_by_strict(workdir: Path,
                                                                        framework: str):
    """The stream's loader (a ShuffleBuffer under a StatefulDataLoader, or the Trainer's own
    DataLoader) hands a resumed process flipped labels: Lightning fetches a batch ahead, so
    the stopped run's next batch was recorded before its checkpoint; the Trainer and
    Accelerate record it after."""
    module = {"trainer": "transformers"}.get(framework, framework)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    ckpt = workdir / "ckpt"
    argv = ["--dir", str(ckpt), "--grace", "4s", "--audit", "strict", "--", PYTHON,
            str(STREAMED), "--framework", framework, "--step-sleep", "0.15",
            "--corrupt-on-resume"]
    # Stopped in the middle of epoch 0 (100 steps), as before a Slurm time limit; run again.
    first = stopped_once(argv, workdir, lambda: (heartbeat_step(ckpt) or -1) >= 30,
                         timeout=600)
    assert first.returncode == 75, first.stderr[-4000:]
    res = run([*procckpt_argv(), "run", *argv], cwd=workdir, timeout=600)
    assert res.returncode == 66, res.stderr[-4000:]
    assert len(audit_lines(res.stderr)) == 1, res.stderr[-4000:]
    assert [e["verdict"] for e in events(ckpt, "audit")] == ["refused"]
    assert len(events(ckpt, "cycle")) == 2


@pytest.mark.parametrize("shape", ["dataclass", "sparse", "nested", "setkeys"])
def test_batches_of_any_shape_resume_exactly_and_are_audited_by_what_they_hold(
        workdir: Path, shape: str):
    """A collate that returns a dataclass, inputs as sparse or nested tensors, samples that
    are dicts built from a set of keys (in each process's own hash order; with 2 workers):
    each resumes exactly under strict, audited the same, with no traceback and no warning
    about the loop's variable; a dataclass batch in another epoch's order is stopped."""
    args = ["--batch", shape, *(["--workers", "2"] if shape == "setkeys" else [])]
    reference = run([*AUDITED, *args], cwd=workdir, env={"PROCCKPT_DIR": str(workdir / "ref")})
    assert reference.returncode == 0, reference.stderr[-3000:]
    ckpt = workdir / "ckpt"
    before = stopped_at_step_4(workdir, ckpt, *args)
    resumed = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--audit", "strict", "--",
                   *AUDITED, *args], cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert before + trained(resumed.stdout) == trained(reference.stdout)
    assert "Traceback" not in resumed.stderr and "in no checkpoint" not in resumed.stderr, \
        resumed.stderr[-3000:]
    assert [e["verdict"] for e in events(ckpt, "audit")] == ["same"]
    if shape != "dataclass":
        return
    wrong = workdir / "wrong"
    stopped_at_step_4(workdir, wrong, *args)
    stopped = run([*procckpt_argv(), "run", "--dir", str(wrong), "--audit", "strict", "--",
                   *AUDITED, *args, "--corrupt", "epoch"], cwd=workdir)
    assert stopped.returncode == 66, stopped.stderr[-3000:]
    assert not trained(stopped.stdout), stopped.stdout
    [line] = audit_lines(stopped.stderr)
    assert "batch 4 of epoch 0 (step 4)" in line and "2 tensors: 8x4 float32, 8 int64" in line


def test_a_model_initialised_again_after_the_restore_is_stopped_before_its_first_step(
        workdir: Path):
    """The script resets its weights after the Checkpointer restored them: the data is right,
    the state is not. The line names the tensors and what to do; strict stops it."""
    warned, strict = workdir / "warned", workdir / "strict"
    for ckpt in (warned, strict):
        stopped_at_step_4(workdir, ckpt)
    goes_on = run([*procckpt_argv(), "run", "--dir", str(warned), "--audit", "warn", "--",
                   *AUDITED, "--corrupt", "reinit"], cwd=workdir)
    assert goes_on.returncode == 0, goes_on.stderr[-3000:]
    [line] = audit_lines(goes_on.stderr)
    assert "the state step 5 starts from is not the one it resumed from: 2 of 2 tensors " \
           "differ from those ckpt-00000001 holds (model.weight, model.bias)" in line, line
    assert "make the Checkpointer last" in line, line
    [verdict] = events(warned, "audit")
    assert (verdict["verdict"], verdict["state"]) == ("differs", "differs")
    stopped = run([*procckpt_argv(), "run", "--dir", str(strict), "--audit", "strict", "--",
                   *AUDITED, "--corrupt", "reinit"], cwd=workdir)
    assert stopped.returncode == 66, stopped.stderr[-3000:]
    assert not trained(stopped.stdout) and "Traceback" not in stopped.stderr
    assert "stopped before training on it (--audit strict)" in stopped.stderr


def test_a_steps_loop_with_its_own_iterator_is_unaudited_never_same(workdir: Path):
    """minGPT's trainer ported with ckpt.steps(): it keeps ``data_iter = iter(loader)``, which
    a resume opens afresh. The audit cannot see that data: it says so (unaudited, with the
    reason in the log, the journal and procckpt status), and never "same"."""
    ckpt = workdir / "ckpt"
    args = ("--steps", "12", "--own-iterator")
    stopped_at_step_4(workdir, ckpt, *args)
    resumed = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--audit", "strict", "--",
                   *AUDITED, *args], cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [line] = [x for x in resumed.stderr.splitlines() if "this resume is not audited" in x]
    assert "draws its batches from data_iter (a _SingleProcessDataLoaderIter, in steps_loop())" \
        in line, line
    [verdict] = events(ckpt, "audit")
    assert verdict["verdict"] == "unaudited" and "data_iter" in verdict["why"], verdict
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert "resume audits: 1 unaudited (last unaudited: the steps() loop draws its batches from " \
        "data_iter" in status.stdout, status.stdout


def test_a_start_time_in_extras_is_no_difference(workdir: Path):
    """A steps() loop that writes ``ckpt.extras["started_at"] = time.time()`` at each start:
    not data, so not compared; the resume passes strict, audited the same."""
    ckpt = workdir / "ckpt"
    args = ("--steps", "12", "--started-at")
    stopped_at_step_4(workdir, ckpt, *args)
    resumed = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--audit", "strict", "--",
                   *AUDITED, *args], cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [e["verdict"] for e in events(ckpt, "audit")] == ["same"]
    # A rerun by hand is the training's restart 1, in its log and in procckpt status alike.
    assert "(restart 1)" in resumed.stderr, resumed.stderr[-3000:]
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert "launches: 2   restarts: 1" in status.stdout, status.stdout


@pytest.mark.parametrize(("framework", "argument"), [
    ("lightning", "ckpt_path=cb.resume_from"),
    ("transformers", "resume_from_checkpoint=cb.resume_from")])
def test_a_framework_not_told_to_resume_is_caught_at_its_first_step(
        workdir: Path, framework: str, argument: str):
    """The example with the framework's resume argument left out, as a hurried port does:
    procckpt resumes the data position, the framework trains a fresh model from step 0. The
    first resumed step is caught in one line that names the argument; strict stops it."""
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    source = (EXAMPLES / f"{framework}_train.py").read_text()
    forgotten = re.sub(rf",?\s*{re.escape(argument)}", "", source)
    assert forgotten != source
    (workdir / "train.py").write_text(forgotten)
    shutil.copy(EXAMPLES / "framework_common.py", workdir)
    ckpt, out = workdir / "ckpt", workdir / "stopped.out"
    first = stopped_once(["--dir", str(ckpt), "--", PYTHON, "train.py", "--step-sleep", "0.05"],
                         workdir, lambda: "step 6" in out.read_text() if out.exists() else False)
    assert first.returncode == 75, first.stderr[-3000:]
    resumed = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--audit", "strict", "--",
                   PYTHON, "train.py"], cwd=workdir, timeout=600)
    assert resumed.returncode == 66, resumed.stderr[-3000:]
    [line] = audit_lines(resumed.stderr)
    assert f"did not load the checkpoint: pass {argument}" in line, line
    assert "global_step is 0, not" in line, line
    assert [e["verdict"] for e in events(ckpt, "audit")] == ["refused"]
