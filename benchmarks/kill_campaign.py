"""A kill campaign that counts samples: trainings whose every sample carries its index are killed
with SIGKILL at random moments of their life and resumed each time; at the end every sample of
every epoch must have been trained exactly once and the final weights must equal an
uninterrupted run's, bit for bit.

Each case runs under ``procckpt run --interval 2s --restart-on-failure``. A kill is, at random,
of the whole tree (the launcher's process group: a node lost, ``kill -9`` of the job; the
launcher is started again, as a requeue would) or of the training alone (an OOM kill: the
launcher restarts it). Its moment is drawn uniformly over the uninterrupted run's life, start-up
included, and what the training was doing then is noted from what it left: starting or
resuming (it had not said where it resumed), the first batch after a resume (no step done
since), writing a checkpoint (a ``.tmp-`` write in ``checkpoints/``) or training.

Counting: the programs print "resumed S" when they start and "step N trained I I ..." after
each step; a resume from step S discards the steps after S that the killed run printed, so
the steps left are the ones the final weights were trained on.

Cases (each needs what it imports; one that cannot run says why):

    plain      a DataLoader with a sampler that shuffles, 2 workers (tests/harness/programs/
               audit_train.py)
    stateful   torchdata's StatefulDataLoader, shuffle with a generator, 2 workers
    stream-accelerate, stream-lightning
               a Hugging Face stream through procckpt.ShuffleBuffer and a StatefulDataLoader
               with 2 workers, trained with Accelerate or Lightning (stream_frameworks.py)
    stream-accelerate-accumulate
               the same with Accelerate accumulating gradients over 4 micro-batches (a
               checkpoint only at a window's end)
    stream-trainer
               the Hugging Face Trainer's own DataLoader with 2 workers over the ShuffleBuffer
               (replayed on a resume)
    gloo-2-ranks
               2 ranks under torchrun (gloo, DDP) with a DistributedSampler, 2 workers each
    s3         the plain case with its checkpoints in S3 (moto's server on loopback, started
               here): written to a local dir, then uploaded; a kill may land in an upload

A kill inside an upload is not told apart from one in training: the table's phases are what
the local files show.

    python benchmarks/kill_campaign.py [--kills 25] [--cases plain,stateful,...] [--seed 0]

Prints one table: per case, the kills and the phase each hit, the resumes, samples trained
twice and never, and whether the final weights are bit-identical. Exits 1 if any case is not
exact.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "harness" / "programs"
sys.path.insert(0, str(ROOT))
from tests.harness.s3_server import bucket, moto_server, s3_env  # noqa: E402

PYTHON = sys.executable
PROCCKPT = [PYTHON, "-m", "procckpt"]


@dataclass(frozen=True)
class Case:
    argv: list[str]
    needs: tuple[str, ...]
    epochs: int
    steps_per_epoch: int
    samples: int  # ids 0 .. samples - 1, each once an epoch (over all ranks)
    ranks: int = 1  # processes that each print their steps
    s3: bool = False  # checkpoints in S3 (moto's server on loopback), staged locally


# 32 steps of 0.25 s each: training long enough beside a start-up of several seconds that
# most kills land in it.
AUDITED = [PYTHON, str(PROGRAMS / "audit_train.py"), "--workers", "2", "--step-sleep", "0.25",
           "--epochs", "4"]
STREAMED = [PYTHON, str(PROGRAMS / "stream_frameworks.py"), "--files", "2", "--rows", "64",
            "--step-sleep", "0.25"]
CASES = {
    "plain": Case([*AUDITED, "--loader", "plain"], (), 4, 8, 64),
    "stateful": Case([*AUDITED, "--loader", "stateful"], ("torchdata",), 4, 8, 64),
    "stream-accelerate": Case([*STREAMED, "--framework", "accelerate"],
                              ("torchdata", "datasets", "accelerate"), 2, 16, 128),
    "stream-lightning": Case([*STREAMED, "--framework", "lightning"],
                             ("torchdata", "datasets", "lightning"), 2, 16, 128),
    "stream-accelerate-accumulate": Case([*STREAMED, "--framework", "accelerate",
                                          "--accumulate", "4"],
                                         ("torchdata", "datasets", "accelerate"), 2, 16, 128),
    "stream-trainer": Case([*STREAMED, "--framework", "trainer"],
                           ("datasets", "transformers"), 2, 16, 128),
    "gloo-2-ranks": Case([str(Path(PYTHON).parent / "torchrun"), "--standalone",
                          "--nproc-per-node=2", *AUDITED[1:], "--ddp"], (), 4, 4, 64, ranks=2),
    "s3": Case([*AUDITED, "--loader", "plain"], ("moto", "boto3"), 4, 8, 64, s3=True),
}
PHASES = ("starting/resuming", "first batch", "writing a checkpoint", "training")


@dataclass
class Result:
    kills: collections.Counter = field(default_factory=collections.Counter)
    tree_kills: int = 0
    resumes: int = 0
    twice: int = 0
    never: int = 0
    identical: bool = False
    lives: int = 0  # trainings from scratch to their end
    note: str = ""


def trained_steps(text: str) -> dict[tuple[int, int], list[int]]:
    """The steps the final weights were trained on: each (step, rank)'s sample ids, the steps
    a killed run trained after the checkpoint the next run resumed from dropped."""
    text = text.replace("resumed ", "\nresumed ").replace("step ", "\nstep ")
    steps: dict[tuple[int, int], list[int]] = {}
    for line in text.splitlines():
        if m := re.fullmatch(r"resumed (\d+)(?: rank (\d+))?", line.strip()):
            resumed, rank = int(m.group(1)), int(m.group(2) or 0)  # (each rank says its own)
            steps = {key: ids for key, ids in steps.items() if key[0] <= resumed
                     or key[1] != rank}
        elif m := re.fullmatch(r"step (\d+)(?: rank (\d+))? trained((?: \d+)+)", line.strip()):
            steps[int(m.group(1)), int(m.group(2) or 0)] = [int(i) for i in m.group(3).split()]
    return steps


def count(case: Case, steps: dict[tuple[int, int], list[int]]) -> tuple[int, int]:
    """Samples trained more than once in an epoch, and never, over all epochs."""
    twice = never = 0
    for epoch in range(case.epochs):
        seen = collections.Counter()
        first, last = epoch * case.steps_per_epoch + 1, (epoch + 1) * case.steps_per_epoch
        for (n, _rank), ids in steps.items():
            if first <= n <= last:
                seen.update(ids)
        twice += sum(c - 1 for c in seen.values() if c > 1)
        never += sum(1 for i in range(case.samples) if seen[i] == 0)
    return twice, never


def phase(ckpt: Path, stdout: Path, stderr: Path, ranks: int) -> str:
    if any(p.name.startswith(".tmp-") for p in (ckpt / "checkpoints").glob(".tmp-*")):
        return "writing a checkpoint"
    out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    if len(re.findall(r"cycle \d+: started", err)) * ranks > out.count("resumed "):
        return "starting/resuming"
    tail = out[out.rfind("resumed "):]
    return "first batch" if "step " not in tail else "training"


def training_pid(launcher: int) -> int | None:
    import psutil

    try:
        children = psutil.Process(launcher).children()
    except psutil.NoSuchProcess:
        return None
    return children[0].pid if children else None


def run_case(name: str, case: Case, kills: int, rng: random.Random, work: Path,
             servers: contextlib.ExitStack) -> Result:
    """``kills`` kills of ``case``, over as many lives (a training from scratch to its end)
    as it takes for them all to land; every life is counted and compared on its own."""
    result = Result(identical=True)
    missing = [m for m in case.needs if importlib.util.find_spec(m) is None]
    if missing:
        result.note = f"skipped: {', '.join(missing)} not installed"
        return result
    folder = work / name
    folder.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PROCCKPT_TOKEN", None)
    if case.s3:
        env.update(s3_server(servers))
    lives = []
    # Twice: the first start fills caches (data, imports), so the second times a life; and
    # two uninterrupted runs that differ tell a training that is not deterministic here from
    # a resume that is not exact.
    for out in ("reference-cold.pt", "reference.pt"):
        started = time.monotonic()
        ref = subprocess.run([*case.argv, "--out", out], cwd=folder, text=True,
                             capture_output=True,
                             env={**env, "PROCCKPT_DIR": str(folder / f"ckpt-{out[:-3]}")})
        lives.append(time.monotonic() - started)
        if ref.returncode != 0:
            result.note = f"the uninterrupted run failed: {ref.stderr.strip().splitlines()[-1:]}"
            result.identical = False
            return result
    life = min(lives)
    noise = differing(folder / "reference-cold.pt", folder / "reference.pt")
    if noise:
        result.note = f"two uninterrupted runs already differ in {noise}: not deterministic here"
        result.identical = False
        return result
    left = kills
    for round_ in range(1, 2 * kills + 3):  # (a life may end before a kill lands)
        left = one_life(case, folder, folder / f"life-{round_}", left, life, rng, env, result)
        if left == 0 or result.note:
            break
    return result


def one_life(case: Case, folder: Path, life_dir: Path, left: int, life: float,  # noqa: C901, PLR0915 (one kill loop)
             rng: random.Random, env: dict[str, str], result: Result) -> int:
    """A training from scratch to its end, killed up to ``left`` times; the kills left."""
    life_dir.mkdir()
    ckpt, stdout, stderr = life_dir / "ckpt", life_dir / "stdout.txt", life_dir / "stderr.txt"
    local = ckpt  # where a checkpoint is written first
    if case.s3:  # staged in a local dir, then uploaded; a resume reads the bucket
        ckpt, local = f"s3://campaign/{folder.name}-{life_dir.name}", life_dir / "local"
        env = {**env, "PROCCKPT_LOCAL_DIR": str(local)}
    out_pt = life_dir / "out.pt"
    argv = [*PROCCKPT, "run", "--dir", str(ckpt), "--interval", "2s", "--restart-on-failure",
            "--max-restarts", "1000", "--", *case.argv, "--out", str(out_pt)]
    for _launch in range(left + 20):
        with open(stdout, "a") as out, open(stderr, "a") as err:
            launcher = subprocess.Popen(argv, cwd=folder, stdout=out, stderr=err, env=env,
                                        start_new_session=True)
        while left > 0 and launcher.poll() is None:
            deadline = time.monotonic() + rng.uniform(0.2, life)
            while time.monotonic() < deadline and launcher.poll() is None:
                time.sleep(0.05)
            if launcher.poll() is not None:
                break
            result.kills[phase(local, stdout, stderr, case.ranks)] += 1
            left -= 1
            if rng.random() < 0.5:
                result.tree_kills += 1
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            else:
                pid = training_pid(launcher.pid)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
        code = launcher.wait()
        last = (stderr.read_text(errors="replace").strip().splitlines() or [""])[-1]
        if code == 0 or "training finished but the command then exited" in last:
            break  # (a kill that came after the training marked itself complete)
        # Killed with its tree, or stopped by its guard against a crash loop (three of our
        # kills in a row before a new checkpoint): started again, as a requeue would.
        if code != -signal.SIGKILL and "so it would fail again: not restarted" not in last:
            result.note = f"procckpt run exited {code}: {last}"
            result.identical = False
            return left
    text = stdout.read_text(errors="replace")
    result.resumes += len(re.findall(r"resumed [1-9]", text)) // case.ranks
    twice, never = count(case, trained_steps(text))
    result.twice += twice
    result.never += never
    if not out_pt.exists():  # killed after it finished: its weights, from the script alone
        subprocess.run([*case.argv, "--out", str(out_pt)], cwd=folder, capture_output=True,
                       env={**env, "PROCCKPT_DIR": str(ckpt)})
    if out_pt.exists():
        lost = differing(out_pt, folder / "reference.pt")
        if lost:
            result.identical = False
            result.note = result.note or (f"{life_dir.name} ended other than the run without "
                                          f"kills in {lost}")
    else:
        result.note, result.identical = "no final weights", False
    result.lives += 1
    return left


def differing(ours: Path, theirs: Path) -> str:
    """The weights in which two saved state dicts differ, in words ("" when bit-identical)."""
    a, b = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    keys = [k for k in {**a, **b} if k not in a or k not in b or not torch.equal(a[k], b[k])]
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def s3_server(servers: contextlib.ExitStack) -> dict[str, str]:
    """moto's S3 server on a loopback port for the rest of the campaign (tests/harness's, which
    the S3 tests use), a bucket ``campaign`` made; what a process needs to reach it."""
    endpoint = servers.enter_context(moto_server())
    bucket(endpoint, "campaign")
    env = s3_env(endpoint)
    env.pop("AWS_MAX_ATTEMPTS")  # the tests' few tries; the campaign keeps procckpt's default
    return env


def table(results: dict[str, Result]) -> str:
    rows = [("case", "kills", *PHASES, "whole tree", "lives", "resumes", "twice", "never",
             "bit-identical")]
    for name, r in results.items():
        if r.note.startswith("skipped"):
            rows.append((name, r.note, *[""] * (len(rows[0]) - 2)))
            continue
        rows.append((name, str(sum(r.kills.values())), *[str(r.kills[p]) for p in PHASES],
                     str(r.tree_kills), str(r.lives), str(r.resumes), str(r.twice),
                     str(r.never),
                     ("yes" if r.identical else "NO") + (f" ({r.note})" if r.note else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
                     for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=25, help="kills per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the cases' directories")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-campaign-"))
    results = {}
    try:
        with contextlib.ExitStack() as servers:  # an S3 server, once a case needs one
            for name in names:
                results[name] = run_case(name, CASES[name], args.kills, rng, work, servers)
                print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    exact = all(r.identical and not r.twice and not r.never for r in results.values()
                if not r.note.startswith("skipped"))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
