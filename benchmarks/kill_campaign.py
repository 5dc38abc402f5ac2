"""A kill campaign that counts samples: trainings whose every sample carries its index are killed
with SIGKILL at random moments of their life and resumed each time; at the end every sample of
every epoch must have been trained exactly once and the final weights must equal an
uninterrupted run's, bit for bit.

Each case runs under ``procckpt run --interval 2s --restart-on-failure``. A kill is, at random,
of the whole tree (the launcher's process group: a node lost, ``kill -9`` of the job; the
launcher is started again, as a requeue would) or of the training alone (an OOM kill: one
training process, a rank under torchrun, never the keeper, torchrun's agent or a DataLoader
worker; the launcher restarts it). The kills are dealt over the phases of a life evenly, from a
shuffled deck: start-up (before the training says where it resumed), the first batch after a
resume (resumed from a checkpoint, no step done since), training, a checkpoint's write (its
files in a ``.tmp-`` dir, no manifest yet), its commit (the manifest written, the rename not
yet done) and, for the S3 case, its upload (committed here, not yet journalled). Each kill is
aimed: the campaign waits, polling what the training leaves (its output, the checkpoint dir,
the journal), for its phase, then for a random moment inside it (start-up and training), and
counts the phase it found when it killed (a kill at a checkpoint's write, commit or upload
waits for a life that has committed one already; when only a resume's first batch is left in
a life that began afresh, one extra kill in training, after its first checkpoint, makes the
resume it needs: the kills column counts it). Test seams widen the narrow phases:
``PROCCKPT_COMMIT_PAUSE`` holds a checkpoint before its manifest and before its rename,
``PROCCKPT_S3_UPLOAD_PAUSE`` after each uploaded object.

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

    python benchmarks/kill_campaign.py [--kills 25] [--cases plain,stateful,...] [--seed 0]
                                       [--crash]

``--crash`` kills the training alone every time (crashes: an OOM kill, a segfault), so that the
steps lost a kill measure the memory tier (docs/crashes.md) rather than the periodic interval;
``PROCCKPT_MEMORY_TIER=false`` in the environment runs the launchers without it, to compare.
The commit pause (below) holds the tier's slots too.

Prints one table: per case, the kills and the phase each hit, how many killed the whole tree,
the lives, the resumes, the steps lost (trained, then dropped by a resume from an earlier
checkpoint: in all, and a kill's mean), samples trained twice and never, and whether the final
weights are bit-identical. Exits 1 if any case is not exact.
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

    @property
    def program(self) -> str:
        """The training's own program (its processes are the ones killed "alone")."""
        return next(Path(a).name for a in self.argv if a.endswith(".py"))


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
PHASES = ("start-up", "first batch", "training", "write", "commit", "upload")
#: Seconds the seams hold a checkpoint before its manifest and before its rename, and after
#: each uploaded object: wide enough for a poll to land a kill in.
PAUSE = "0.4"
POLL = 0.02


@dataclass
class Result:
    kills: collections.Counter = field(default_factory=collections.Counter)
    tree_kills: int = 0
    resumes: int = 0
    lost: int = 0  # steps trained, then dropped by a resume from before them
    twice: int = 0
    never: int = 0
    identical: bool = False
    lives: int = 0  # trainings from scratch to their end
    note: str = ""


def trained_steps(text: str) -> tuple[dict[tuple[int, int], list[int]], int]:
    """The steps the final weights were trained on: each (step, rank)'s sample ids, the steps
    a killed run trained after the checkpoint the next run resumed from dropped; and how many
    steps were so dropped (trained again: the work the kills lost; rank 0's count)."""
    text = text.replace("resumed ", "\nresumed ").replace("step ", "\nstep ")
    steps: dict[tuple[int, int], list[int]] = {}
    lost = 0
    for line in text.splitlines():
        if m := re.fullmatch(r"resumed (\d+)(?: rank (\d+))?", line.strip()):
            resumed, rank = int(m.group(1)), int(m.group(2) or 0)  # (each rank says its own)
            kept = {key: ids for key, ids in steps.items() if key[0] <= resumed
                    or key[1] != rank}
            lost += (len(steps) - len(kept)) if rank == 0 else 0
            steps = kept
        elif m := re.fullmatch(r"step (\d+)(?: rank (\d+))? trained((?: \d+)+)", line.strip()):
            steps[int(m.group(1)), int(m.group(2) or 0)] = [int(i) for i in m.group(3).split()]
    return steps, lost


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


class Watch:
    """What one life's training is doing, told from what it leaves: the launcher's log (a
    cycle started), the training's output (resumed, a step), the checkpoint dir (a ``.tmp-``
    dir, with a manifest or without) and the journal (a checkpoint published)."""

    def __init__(self, local: Path, stdout: Path, stderr: Path, ranks: int, s3: bool) -> None:
        self.local, self.stdout, self.stderr, self.ranks, self.s3 = local, stdout, stderr, \
            ranks, s3
        self.cycles = 0
        self.offset = 0  # where the newest cycle's output begins
        self.since = 0.0  # and when it began (the clock files are stamped with)

    def new_cycle(self) -> bool:
        """Whether a cycle started since the last call (and, if so, take it as the one)."""
        err = self.stderr.read_text(errors="replace")
        cycles = len(re.findall(r"cycle \d+: started", err))
        if cycles == self.cycles:
            return False
        self.cycles, self.since = cycles, time.time() - 0.5
        self.offset = self.stdout.stat().st_size if self.stdout.exists() else 0
        return True

    def resumed_from_a_checkpoint(self) -> bool:
        return any(p.name.startswith("ckpt-") and not p.name.endswith(".corrupt")
                   for p in (self.local / "checkpoints").glob("ckpt-*"))

    def phase(self) -> str:
        with open(self.stdout, "rb") as f:
            f.seek(self.offset)
            out = f.read().decode(errors="replace")
        if out.count("resumed ") < self.ranks:
            return "start-up"
        fresh = [p for p in (self.local / "checkpoints").glob(".tmp-*")
                 if _mtime(p) >= self.since]
        if fresh:
            return "commit" if any((p / "MANIFEST.json").exists() for p in fresh) else "write"
        if self.s3 and self._uploading():
            return "upload"
        if "step " not in out:
            return "first batch" if re.search(r"resumed [1-9]", out) else "first step"
        return "training"

    def _uploading(self) -> bool:
        """A checkpoint of this cycle committed here and not yet journalled: its upload."""
        done = [p for p in (self.local / "checkpoints").glob("ckpt-*[0-9]")
                if _mtime(p) >= self.since]
        if not done:
            return False
        journal = (self.local / "events.jsonl")
        text = journal.read_text(errors="replace") if journal.exists() else ""
        return any(f'"checkpoint": "{p.name}"' not in text for p in done)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def training_pids(launcher: int, program: str) -> list[int]:
    """The training's own processes below ``launcher``: those running ``program``, less the
    keeper and torchrun's agent (which name it too) and the DataLoader workers (forked from
    a training process)."""
    import psutil

    found = {}
    try:
        below = psutil.Process(launcher).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for proc in below:
        try:
            argv = proc.cmdline()
            parent = proc.ppid()
        except psutil.Error:
            continue
        if any(program in a for a in argv) and not any(
                a.endswith("keeper.py") or a.endswith("torchrun") or a == "torch.distributed.run"
                for a in argv):
            found[proc.pid] = parent
    return sorted(pid for pid, parent in found.items() if parent not in found)


def run_case(name: str, case: Case, kills: int, rng: random.Random, work: Path,
             servers: contextlib.ExitStack, crash: bool = False) -> Result:
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
    ref = uninterrupted(case, folder, env, "reference.pt")
    if ref:
        result.note, result.identical = ref, False
        return result
    phases = [p for p in PHASES if p != "upload" or case.s3]
    rng.shuffle(phases)  # (fewer kills than phases: which ones, at random)
    deck = [phases[i % len(phases)] for i in range(kills)]
    for round_ in range(1, 2 * kills + 3):  # (a life may end before a kill lands)
        one_life(case, folder, folder / f"life-{round_}", deck, rng, env, result, crash)
        if not deck or result.note:
            break
    if not result.identical and "ended other than" in result.note:
        # A second run without kills tells a training that is not deterministic here from
        # a resume that is not exact (run only then: it is a case's start-up, again).
        ref = uninterrupted(case, folder, env, "reference-again.pt")
        noise = ref or differing(folder / "reference-again.pt", folder / "reference.pt")
        if noise:
            result.note = (ref or f"two uninterrupted runs already differ in {noise}: not "
                           "deterministic here")
    return result


def uninterrupted(case: Case, folder: Path, env: dict[str, str], out: str) -> str:
    """Run ``case`` without kills into ``folder / out``; why it failed, or "" if it ran."""
    done = subprocess.run([*case.argv, "--out", out], cwd=folder, text=True,
                          capture_output=True,
                          env={**env, "PROCCKPT_DIR": str(folder / f"ckpt-{out[:-3]}")})
    if done.returncode != 0:
        return f"the uninterrupted run failed: {done.stderr.strip().splitlines()[-1:]}"
    return ""


def one_life(case: Case, folder: Path, life_dir: Path, deck: list[str],  # noqa: C901, PLR0912, PLR0915 (one kill loop)
             rng: random.Random, env: dict[str, str], result: Result,
             crash: bool = False) -> None:
    """A training from scratch to its end, killed at phases drawn from ``deck`` (each kill
    that lands takes its phase out of it); with ``crash``, the training alone each time."""
    life_dir.mkdir()
    ckpt, stdout, stderr = life_dir / "ckpt", life_dir / "stdout.txt", life_dir / "stderr.txt"
    local = ckpt  # where a checkpoint is written first
    env = {**env, "PROCCKPT_COMMIT_PAUSE": PAUSE}
    if case.s3:  # staged in a local dir, then uploaded; a resume reads the bucket
        ckpt, local = f"s3://campaign/{folder.name}-{life_dir.name}", life_dir / "local"
        env = {**env, "PROCCKPT_LOCAL_DIR": str(local), "PROCCKPT_S3_UPLOAD_PAUSE": PAUSE}
    out_pt = life_dir / "out.pt"
    argv = [*PROCCKPT, "run", "--dir", str(ckpt), "--interval", "2s", "--restart-on-failure",
            "--max-restarts", "1000", "--", *case.argv, "--out", str(out_pt)]
    stdout.touch()
    watch = Watch(local, stdout, stderr, case.ranks, case.s3)
    for _launch in range(len(deck) + 20):
        with open(stdout, "a") as out, open(stderr, "a") as err:
            launcher = subprocess.Popen(argv, cwd=folder, stdout=out, stderr=err, env=env,
                                        start_new_session=True)
        while deck and launcher.poll() is None:
            if not watch.new_cycle():
                time.sleep(POLL)
                continue
            target = aim(deck, watch, launcher, rng)
            if target is None:
                continue  # no phase of the deck in this cycle: it runs on to its end
            pids = training_pids(launcher.pid, case.program) \
                if crash or rng.random() >= 0.5 else []
            landed = watch.phase()
            if pids:  # the training alone (or, where none is found yet, the whole tree)
                os.kill(rng.choice(pids), signal.SIGKILL)
            else:
                result.tree_kills += 1
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            result.kills[landed if landed in PHASES else target] += 1
            for taken in (landed, target):  # (neither, for a kill that bridges to a resume)
                if taken in deck:
                    deck.remove(taken)
                    break
        code = launcher.wait()
        last = (stderr.read_text(errors="replace").strip().splitlines() or [""])[-1]
        if code == 0 or "training finished but the command then exited" in last:
            break  # (a kill that came after the training marked itself complete)
        # Killed with its tree, or stopped by its guard against a crash loop (three of our
        # kills in a row before a new checkpoint): started again, as a requeue would.
        if code != -signal.SIGKILL and "so it would fail again: not restarted" not in last:
            result.note = f"procckpt run exited {code}: {last}"
            result.identical = False
            return
    text = stdout.read_text(errors="replace")
    result.resumes += len(re.findall(r"resumed [1-9]", text)) // case.ranks
    steps, lost = trained_steps(text)
    twice, never = count(case, steps)
    result.lost += lost
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


#: The phases in the order a cycle meets them; the last four recur until the cycle ends.
_ORDER = {"start-up": 0, "first batch": 1, "first step": 1, "training": 2, "write": 2,
          "commit": 2, "upload": 2}


def aim(deck: list[str], watch: Watch, launcher: subprocess.Popen, rng: random.Random,  # noqa: C901, PLR0912 (one wait, a branch per kind of phase)
        patience: float = 60.0) -> str | None:
    """Wait, in a cycle that has just started, for a phase drawn from ``deck`` (and for a
    random moment inside start-up or training); return it, or None when the cycle holds none
    of the deck's phases any more (it went past them, or ended).

    A resume's first batch is met only right after a resume, so it is aimed at first
    whenever this cycle resumed. A checkpoint's write, commit or upload is aimed at only once
    the life has a committed checkpoint, so that a kill there leaves something to resume
    from. When only first batches are left and this cycle began afresh, it is killed in
    training once it has committed one ("training", not from the deck: an extra kill, which
    the table counts), so that the next cycle resumes."""
    passed: set[str] = set()
    fresh = not watch.resumed_from_a_checkpoint()
    if fresh:
        passed.add("first batch")  # a fresh start: no resume to catch the first batch of
    while True:
        options = [p for p in deck if p not in passed]
        bridge = not options and fresh and "first batch" in deck
        if not options and not bridge:
            return None
        target = "training" if bridge else "first batch" if "first batch" in options else \
            rng.choice(options)
        delay = {"start-up": rng.uniform(0.0, 1.5), "training": rng.uniform(0.0, 2.0)}.get(
            target, 0.0)
        needs_a_checkpoint = bridge or target in ("write", "commit", "upload")
        seen_at = None
        until = time.monotonic() + patience
        while time.monotonic() < until:
            if launcher.poll() is not None:
                return None
            if watch.new_cycle():  # the training was restarted meanwhile: aim in this one
                return aim(deck, watch, launcher, rng, patience)
            now = watch.phase()
            if now == target and (not needs_a_checkpoint or watch.resumed_from_a_checkpoint()):
                seen_at = seen_at if seen_at is not None else time.monotonic()
                if time.monotonic() - seen_at >= delay:
                    return target
            elif _ORDER[now] > _ORDER[target]:
                break  # gone past it in this cycle
            time.sleep(POLL)
        passed.add(target)
        if bridge:
            return None


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
    rows = [("case", "kills", *PHASES, "whole tree", "lives", "resumes", "steps lost",
             "twice", "never", "bit-identical")]
    for name, r in results.items():
        if r.note.startswith("skipped"):
            rows.append((name, r.note, *[""] * (len(rows[0]) - 2)))
            continue
        rows.append((name, str(sum(r.kills.values())), *[str(r.kills[p]) for p in PHASES],
                     str(r.tree_kills), str(r.lives), str(r.resumes), _lost(r), str(r.twice),
                     str(r.never),
                     ("yes" if r.identical else "NO") + (f" ({r.note})" if r.note else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
                     for row in rows)


def _lost(r: Result) -> str:
    """The steps the kills lost, in all and their mean a kill."""
    kills = sum(r.kills.values())
    return f"{r.lost} ({r.lost / kills:.1f} a kill)" if kills else str(r.lost)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=25, help="kills per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the cases' directories")
    parser.add_argument("--crash", action="store_true",
                        help="kill the training alone every time (an OOM kill): with the "
                             "memory tier, the steps lost a kill are a few")
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
                results[name] = run_case(name, CASES[name], args.kills, rng, work, servers,
                                         args.crash)
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
