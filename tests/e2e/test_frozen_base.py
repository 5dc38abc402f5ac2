"""A fine-tune of a frozen base (examples/finetune_frozen.py: ~95% of the state's bytes frozen,
low-rank adapters trained with AdamW) under ``procckpt run`` with time limits and periodic
checkpoints: every checkpoint but the first writes less than a tenth of the state, the first
one of each resumed process too (the chunks it would write are in the store already), the
run ends bit-identical to an uninterrupted one, and no chunk is left that no kept checkpoint
lists. The same under torchrun (DDP over 2 gloo ranks), where rank 0 writes the state."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PYTHON, assert_bit_identical, procckpt_argv, run
from .test_frameworks import events

SCRIPT = EXAMPLES / "finetune_frozen.py"
#: 160 steps of 0.12 s alone; under torchrun 96 a rank of 0.25 s (its start is slower on a
#: loaded machine, so its cycles are longer): more than two cycles either way.
RUNS = {"python": (("--epochs", "10"), "0.12", "15s"),
        "torchrun": (("--epochs", "6"), "0.25", "20s")}


TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_a_frozen_base_is_written_once_across_time_limits_and_resumes_bit_identical(
        workdir: Path, launch: str):
    command = [PYTHON] if launch == "python" else TORCHRUN
    args, sleep, limit = RUNS[launch]
    expected = workdir / "reference.pt"
    ref = run([*command, str(SCRIPT), *args, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", limit,
               "--grace", "4s", "--interval", "2s", "--engine", "hooks", "--max-restarts", "40",
               "--",
               *command, str(SCRIPT), *args, "--step-sleep", sleep, "--out", str(out)],
              cwd=workdir, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert len([e for e in events(ckpt, "restart") if e["cause"] == "deadline"]) >= 2
    saved = events(ckpt, "checkpoint")
    first, *later = saved
    assert first["written"] == first["bytes"], first
    assert len(later) >= 4 and all(e["written"] <= 0.1 * e["bytes"] for e in later), later
    assert {e["restart"] for e in later} >= {0, 1, 2}  # resumed processes too
    assert_bit_identical(expected, out)

    # Collection: the chunks on disk are exactly those the kept checkpoints list.
    listed = set()
    for manifest in (ckpt / "checkpoints").glob("ckpt-*/MANIFEST.json"):
        listed |= set(json.loads(manifest.read_text())["chunks"])
    stored = {f"blake3:{f.name}" for f in (ckpt / "chunks" / "blake3").glob("*/*")}
    assert stored == listed and len(listed) == 4  # the four frozen layers' weights

    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert status.returncode == 0, status.stderr
    header, *rows = [line.split() for line in status.stdout.splitlines()
                     if line.startswith(("CHECKPOINT", "ckpt-"))]
    assert header[3:5] == ["SIZE", "WRITTEN"], status.stdout
    # SIZE and WRITTEN, two words each: 4.4 MB of state, some hundreds of KB written.
    assert all(r[4] == "MB" and r[6] == "KB" and r[-1] == "yes" for r in rows), status.stdout
    report = run([*procckpt_argv(), "report", str(ckpt)], cwd=workdir)
    assert report.returncode == 0 and (ckpt / "report.html").is_file(), report.stderr


def test_lightning_shares_a_frozen_encoder_across_checkpoints_and_resumes_bit_identical(
        workdir: Path):
    """Lightning loads ``state.pt`` itself (``fit(ckpt_path=cb.resume_from)``): the callback
    gives its strategy a checkpoint I/O that puts the frozen weights back."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install 'procckpt[lightning]')")
    script = [PYTHON, str(EXAMPLES / "lightning_train.py"), "--frozen-base"]
    expected = workdir / "reference.pt"
    ref = run([*script, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt, out = workdir / "ckpt", workdir / "out.pt"
    res = run([*procckpt_argv(), "run", "--dir", str(ckpt), "--time-limit", "20s",
               "--grace", "4s", "--interval", "2s", "--max-restarts", "40", "--",
               *script, "--step-sleep", "0.5", "--out", str(out)], cwd=workdir, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert len([e for e in events(ckpt, "restart") if e["cause"] == "deadline"]) >= 2
    frozen = 256 * 256 * 4  # the encoder's second layer (its first is under 64 KiB)
    first, *later = events(ckpt, "checkpoint")
    assert first["written"] == first["bytes"] > frozen
    assert later and all(e["written"] <= e["bytes"] - frozen for e in later), later
    assert_bit_identical(expected, out)
