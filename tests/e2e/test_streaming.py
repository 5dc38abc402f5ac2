"""Streamed data (examples/streaming_train.py): Hugging Face ``datasets`` with
``streaming=True`` over local JSON Lines files, shuffled through ``procckpt.ShuffleBuffer``,
two worker processes, torchdata's StatefulDataLoader. Under ``procckpt run`` with time
limits, each resume in the middle of an epoch loads the stream's state instead of reading the
epoch again, and the run ends with the weights of an uninterrupted run, bit for bit. The same
files read by an iterable without state are replayed, and the run says so and how long it
will take.

8 files of 100 samples, batches of 8: 100 steps an epoch, 2 epochs, stopped twice."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PROGRAMS, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import cycles_stopped_at, joined
from .test_frameworks import events

SCRIPT = EXAMPLES / "streaming_train.py"
SMALL = ("--files", "8", "--rows", "100", "--data", "data")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None or importlib.util.find_spec("torchdata") is None,
    reason="needs Hugging Face datasets and torchdata (pip install datasets torchdata)")


def reference(workdir: Path, *args: str) -> Path:
    out = workdir / "reference.pt"
    res = run([PYTHON, str(SCRIPT), *SMALL, *args, "--out", str(out)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def interrupted(workdir: Path, *args: str) -> tuple[Path, str]:
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # 2 epochs of 100 steps, stopped (SIGUSR1, then run again) twice: in each epoch's middle,
    # the second time in a resumed cycle. (The first stop late enough that a replay of the
    # batches before it takes over a second: the replay's estimate is said.)
    res = joined(cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--", PYTHON,
                                    str(SCRIPT), *SMALL, *args, "--step-sleep", "0.2", "--out",
                                    str(out)], workdir, ckpt, [70, 130], timeout=900))
    resumes = events(ckpt, "resume")
    assert len(resumes) == 2 and all(e["batch"] > 0 for e in resumes), resumes
    return out, res.stderr


def test_a_stream_with_a_state_resumes_without_reading_the_epoch_again_bit_identical(
        workdir: Path):
    expected = reference(workdir)
    out, stderr = interrupted(workdir)
    mid_epoch = [line for line in stderr.splitlines() if "resumed at batch" in line]
    assert mid_epoch, stderr[-3000:]
    assert all("restored the loader's own state (nothing read again)" in line
               for line in mid_epoch), mid_epoch
    assert "replay" not in stderr, stderr[-3000:]
    assert_bit_identical(expected, out)


def test_a_stream_without_a_state_is_replayed_with_an_estimate_and_stays_exact(
        workdir: Path):
    slow = ("--stateless", "--read-cost", "0.005")  # 5 ms a sample: seconds of replay
    expected = reference(workdir, *slow)
    out, stderr = interrupted(workdir, *slow)
    # Told at the start of the first cycle, while the training can still be changed.
    told = [line for line in stderr.splitlines()
            if "a resume inside an epoch will read this loader's batches" in line]
    assert told and stderr.index(told[0]) < stderr.index("resumed at batch"), stderr[-3000:]
    assert "StatefulDataLoader" in told[0] and "docs/resume.md" in told[0], told[0]
    estimates = [line for line in stderr.splitlines() if "replaying the" in line]
    assert estimates, stderr[-3000:]
    assert "batches/s; to resume without reading them again, give the data set state_dict()" \
        in estimates[0], estimates
    assert "replayed the" in stderr, stderr[-3000:]
    assert_bit_identical(expected, out)


FRAMEWORKS = PROGRAMS / "stream_frameworks.py"


@pytest.mark.parametrize("framework", ["accelerate", "lightning", "trainer"])
def test_a_stream_through_a_framework_resumes_bit_identical(workdir: Path, framework: str):
    """Accelerate's prepared loader over a StatefulDataLoader (use_stateful_dataloader) opens
    the loader it holds only when asked for its first batch and fetches one ahead; Lightning
    fetches one ahead and opens a resumed epoch's loader before its epoch-start hook, where
    the script sets the data set's epoch; the Trainer reads the stream with a plain
    DataLoader (replayed) and counts a stream's epochs from 0 again in a resumed process."""
    module = {"trainer": "transformers"}.get(framework, framework)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    args = ("--framework", framework)
    expected = workdir / "reference.pt"
    ref = run([PYTHON, str(FRAMEWORKS), *args, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    # Stopped (SIGUSR1) once the training reached steps 30 and 130 of 2 epochs of 100: two
    # resumes inside an epoch, the second from a resumed cycle's checkpoint (a stop lands a
    # step or two after its step). (With 20-s time limits, three cycles in a row that were
    # still importing the framework when their stop came ended the run for no progress on a
    # loaded machine.)
    res = joined(cycles_stopped_at(["--dir", str(ckpt), "--grace", "4s", "--", PYTHON,
                                    str(FRAMEWORKS), *args, "--step-sleep", "0.2", "--out",
                                    str(out)], workdir, ckpt, [30, 130], timeout=900))
    mid_epoch = [line for line in res.stderr.splitlines() if "resumed at batch" in line]
    assert len(mid_epoch) == 2, res.stderr[-3000:]
    how = "replayed the" if framework == "trainer" else "restored the loader's own state"
    assert all(how in line for line in mid_epoch), mid_epoch
    # Each resume's first batch was audited, and none was flagged.
    assert "resume audit:" not in res.stderr, res.stderr[-3000:]
    verdicts = [e["verdict"] for e in events(ckpt, "audit")]
    assert "same" in verdicts and set(verdicts) <= {"same", "unrecorded"}, verdicts
    steps = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert len({line.split()[1] for line in steps}) == 200, steps[-3:]  # 2 epochs of 100
    assert_bit_identical(expected, out)


@pytest.mark.parametrize("script", ["plain", "accelerate", "lightning", "trainer"])
def test_a_stop_at_a_streams_last_batch_resumes_exactly(workdir: Path, script: str):
    """A stream has no length: its epoch's last batch is known only when the next fetch finds
    nothing. 2 files of 40 samples, batches of 8: step 10 is epoch 0's last. A stop asked
    for there must leave the resumed run in epoch 1 with the uninterrupted run's order,
    random streams and loader state (it crashed the Trainer: 'Batch does not contain any
    data'; Accelerate's resumed run read a third pass as epoch 0's end)."""
    module = {"trainer": "transformers", "plain": "torchdata"}.get(script, script)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    program = [str(SCRIPT)] if script == "plain" else [str(FRAMEWORKS), "--framework", script]
    done = run([*procckpt_argv(), "check", "--steps", "13", "--at", "10", "--", PYTHON,
                *program, "--files", "2", "--rows", "40", "--data", "data"],
               cwd=workdir, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("exact: "), done.stdout
    if script in ("lightning", "trainer"):  # the framework's epoch end comes first
        assert "asked to stop at step 10, the run could take its checkpoint only at step 11 " \
               "(the framework runs its epoch's end after an epoch's last batch)" \
               in done.stdout, done.stdout
    else:  # at the epoch's end, after the loop over the batches
        assert "stopped at the end of an epoch at step 10" in done.stdout, done.stdout
    if script == "trainer":  # the model and optimizer in the Trainer's own files too
        assert "framework.model, framework.optimizer" in done.stdout, done.stdout
    else:  # the loader's state is restored, and the first run says no replay
        assert "loader_state" in done.stdout and "a run warned" not in done.stdout, \
            done.stdout
