"""``procckpt check``: prove, in a minute, that a script resumes exactly, before the real job.

The command runs the script under ``procckpt run`` (hooks engine) in throwaway checkpoint dirs:

    A  steps 1..N without a stop                     the reference
    B  the same again                                is the script deterministic at all?
    C  stopped at step K (checkpoint, exit), then    the real resume: a new process, the
       run again: resumes, goes on to step N         checkpoint, the restored position

Each run records a CRC-32 of every part of the state after every step (training/fingerprints.py) and
saves a checkpoint at step N. The verdict compares B with A (else a resume could not be judged)
and C with A: the saved state at step N part by part, bit for bit, and the first step whose
fingerprint differs, so the part that is lost on a resume, and from when, can be named.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CommandNotFoundError, UsageError
from ..protocol.control import CHECK_UNSAVED as UNSAVED
from ..protocol.control import keep_unsaved_advice
from .runs import CheckInterrupted, Run, Runner, Signalled, last_step, signals_held, signals_raise

__all__ = ["run_check", "Verdict", "CheckInterrupted"]

#: Exit codes: exact, differs or not deterministic, bad input.
EXACT, DIFFERS, BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class Verdict:
    code: int
    line: str
    details: list[str]


def run_check(command: list[str], steps: int, at: int | None, keep: bool = False,
              ) -> Verdict:
    """Check that ``command`` resumes exactly over ``steps`` steps, stopped at ``at`` (by
    default once in the middle of an epoch and once at the end of one).

    Raises:
        UsageError: bad input (too few steps, a command that does not use procckpt).
    """
    if steps < 2:
        raise UsageError(f"--steps {steps}: at least 2, to stop in the middle")
    if at is not None and not 1 <= at < steps:
        raise UsageError(f"--at {at}: between 1 and {steps - 1} (--steps {steps})")
    if not command:
        raise UsageError("no command given: put it after --, e.g. procckpt check -- python "
                         "train.py")
    exe = command[0]
    if shutil.which(exe) is None:
        raise CommandNotFoundError(f"command not found: {exe} (check the spelling and PATH)")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="procckpt-check-"))
    runner = Runner(work, command)
    try:
        with signals_raise():
            a = runner.run("a", steps, None, "without a stop")
            last = last_step(a)
            if last < steps:  # the script has fewer steps: check the ones it has
                if last < 2:
                    raise UsageError(f"the command trained {last} step(s) in all: too few to "
                                     "stop in the middle")
                steps = last
                a = runner.run("a2", steps, None, "without a stop, to its last step")
            stops = _stops(a, steps, at)
            runner.expect(runner.done + 1 + 2 * len(stops))
            b = runner.run("b", steps, None, "again without a stop: is it deterministic?")
            resumed, waited = [], []
            for name, asked in stops:
                c = runner.run(name, steps, asked, f"stopped at step {asked}")
                stop_at = last_step(c)
                if stop_at >= steps:
                    raise UsageError(f"the command did not stop at step {asked} as asked: it "
                                     f"went on to step {stop_at} (procckpt check --keep "
                                     "keeps its output)")
                if stop_at != asked:  # no checkpoint at the step asked for
                    why = ("the framework runs its epoch's end after an epoch's last batch"
                           if c.epoch_of(stop_at) != c.epoch_of(asked)
                           else "a gradient accumulation was in progress")
                    waited.append(f"asked to stop at step {asked}, the run could take its "
                                  f"checkpoint only at step {stop_at} ({why})")
                resumed.append((runner.run(name, steps, asked, f"resumed from step "
                                           f"{stop_at}", again=c), stop_at))
            verdict = _verdict(a, b, resumed, steps)
            verdict.details.extend(waited)
            if at is None and len(stops) == 1:
                verdict.details.append(
                    f"no stop at an epoch's end: no epoch ended within the {steps} steps "
                    "compared, at a point where a checkpoint can be taken; raise --steps "
                    "past an epoch's end to check a resume there too")
            said: dict[str, None] = {}
            for run in (a, b, *(c for c, _ in resumed)):
                said.update(dict.fromkeys(run.warnings()))
            verdict.details.extend(f"a run warned: {line}" for line in said)
        runs = sum(run.seconds for run in (a, b, *(c for c, _ in resumed)))
        verdict.details.append(f"{2 + 2 * len(resumed)} runs of the command took {runs:.1f}s "
                               f"of the check's {time.monotonic() - started:.1f}s")
        return verdict
    except Signalled as e:
        raise CheckInterrupted(e.signum) from None
    finally:
        with signals_held():  # a second Ctrl-C must not leave the runs or the dir behind
            runner.stop()
            if keep:
                print(f"procckpt check: the runs' dirs, logs and traces are kept in {work}",
                      file=sys.stderr)
            else:
                shutil.rmtree(work, ignore_errors=True)


def _stops(a: Run, steps: int, at: int | None) -> list[tuple[str, int]]:
    """Where to stop and resume: ``at``, or the middle of an epoch and the end of one (the
    steps nearest the middle of the run), as the reference run's trace shows its epochs."""
    if at is not None:
        return [("c", at)]
    where = a.where()
    middle = steps // 2

    def nearest(candidates: list[int]) -> int | None:
        return min(candidates, key=lambda s: (abs(s - middle), s)) if candidates else None

    ends = [s for s in range(1, steps) if _ends_epoch(where, s)]
    # Only steps the trace has: a framework's loop saves nowhere else (not after an epoch's
    # last batch: see training/driven.py).
    mid = nearest([s for s in range(1, steps) if s in where and s not in ends]) or middle
    end = nearest(ends)
    return [("c", mid)] + ([("d", end)] if end is not None else [])


def _unused_streams(*runs: Run) -> set[str]:
    """Random streams no run drew from (the same fingerprint at every step of each run): their
    seed from the OS differs between processes and means nothing; they are not compared."""
    unused: set[str] | None = None
    for run in runs:
        for steps in run.traces().values():
            seen: dict[str, set[int]] = {}
            for parts in steps.values():
                for name, crc in parts.items():
                    if name.startswith(("rng.", "epoch_rng.")):
                        seen.setdefault(name, set()).add(crc)
            constant = {name for name, crcs in seen.items() if len(crcs) == 1}
            unused = constant if unused is None else unused & constant
    return unused or set()


def _verdict(a: Run, b: Run, resumed: list[tuple[Run, int]], steps: int) -> Verdict:
    ranks = sorted(a.traces())
    who = f" ({len(ranks)} ranks)" if len(ranks) > 1 else ""
    ignore = _unused_streams(a, b, *(c for c, _ in resumed))
    noise = _first_difference(a, b, steps, ignore)
    if noise is not None:
        step, rank, parts = noise
        return Verdict(DIFFERS, f"not deterministic: two runs without a resume already differ "
                       f"in {_names(parts)} from step {step} on{_rank(rank, ranks)}", [
                           "so a resume cannot be judged. Make the script repeatable: a fixed "
                           "seed (torch.manual_seed, random.seed, numpy), no seed from the "
                           "clock, torch.use_deterministic_algorithms(True), and data-loader "
                           "worker seeds from the seed (generator=, worker_init_fn)",
                           *_entry_lines(a, b, step, rank, parts)])
    where = a.where()
    stops = " and ".join(f"{_place(where, stop_at, steps)} at step {stop_at}"
                         for _, stop_at in resumed)
    for c, stop_at in resumed:
        lost = _first_difference(a, c, steps, ignore)
        if lost is not None:
            step, rank, parts = lost
            return Verdict(DIFFERS, f"differs: after the resume {_place(where, stop_at, steps)}"
                           f" at step {stop_at}, {_names(parts)} "
                           f"{'differ' if len(parts) > 1 else 'differs'} from step {step} on"
                           f"{_rank(rank, ranks)}",
                           [*_likely_causes(parts, step, stop_at, a.unsaved()),
                            *_entry_lines(a, c, step, rank, parts),
                            *_per_rank(a, c, steps, ignore, ranks)])
    parts = sorted(p for p in set(a.traces()[0][steps]) - ignore if not p.startswith(UNSAVED))
    details = [f"compared after each step and in the checkpoint at step {steps}: "
               f"{', '.join(parts)}"]
    if a.unsaved():
        details.append(f"also compared after each step, though in no checkpoint: "
                       f"{a.unsaved()}; a resume built them anew and they still matched (if "
                       "they change in training, pass them to the Checkpointer)")
    if ignore:
        details.append(f"not compared: {', '.join(sorted(ignore))} (no run drew from them "
                       "after its start: a resume loses nothing there)")
    if len(ranks) > 1:
        details.append(f"ranks {', '.join(map(str, ranks))}: each exact")
    return Verdict(EXACT, f"exact: stopped {stops}, each resumed in a new process, and "
                   f"bit-identical to the run without a stop at every step to {steps}{who}",
                   details)


def _place(where: dict[int, tuple[int, int]], step: int, steps: int) -> str:
    """Where ``step`` is in its epoch, in words."""
    if step < steps and _ends_epoch(where, step):
        return "at the end of an epoch"
    return "in the middle of an epoch" if where.get(step, (0, 0))[1] else "in the middle"


def _ends_epoch(where: dict[int, tuple[int, int]], step: int) -> bool:
    """Whether ``step`` was the last of its epoch (the next one is in another)."""
    return step in where and step + 1 in where and where[step + 1][0] != where[step][0]


def _per_rank(a: Run, c: Run, steps: int, ignore: set[str], ranks: list[int]) -> list[str]:
    """Each rank's own verdict, in a group."""
    if len(ranks) < 2:
        return []
    lines = []
    for rank in ranks:
        only = Run(a.name, a.dir), Run(c.name, c.dir)
        lost = _first_difference(*only, steps, ignore, ranks=[rank], saved=False)
        lines.append(f"rank {rank}: exact" if lost is None else
                     f"rank {rank}: {_names(lost[2])} from step {lost[0]}")
    return lines


def _first_difference(x: Run, y: Run, steps: int, ignore: set[str],
                      ranks: list[int] | None = None, saved: bool = True,
                      ) -> tuple[int, int, list[str]] | None:
    """The first step (and rank, and parts) at which two runs' fingerprints differ, the saved
    checkpoint at ``steps`` included, ``ignore`` left out; None when they never do."""
    tx, ty = x.traces(), y.traces()
    for step in range(1, steps + 1):
        for rank in ranks if ranks is not None else sorted(tx):
            px, py = tx[rank].get(step), ty.get(rank, {}).get(step)
            if px is None or py is None:
                continue
            # What the script holds beside its checkpoint is compared where both recorded it
            # (a run keeps held tensors from its second step on: fingerprints.py).
            parts = sorted(k for k in px.keys() | py.keys()
                           if px.get(k) != py.get(k) and k not in ignore
                           and not (k.startswith(UNSAVED) and (k not in px or k not in py)))
            if parts:
                return step, rank, parts
    if not saved:
        return None
    differ = [p for p in _saved_differences(x.dir, y.dir) if p.split(":")[-1] not in ignore]
    return (steps, 0, differ) if differ else None


def _saved_differences(x: Path, y: Path) -> list[str]:
    """The parts in which the newest checkpoints of two dirs differ (every ``.pt`` file)."""
    import torch

    from ..training.fingerprints import fingerprints

    def newest(root: Path) -> Path:
        return sorted((root / "checkpoints").glob("ckpt-*"))[-1]

    differ = []
    fx, fy = newest(x), newest(y)
    for path in sorted(fx.glob("*.pt")):
        other = fy / path.name
        if not other.exists():
            differ.append(path.name)
            continue
        px = fingerprints(torch.load(path, weights_only=True))
        py = fingerprints(torch.load(other, weights_only=True))
        prefix = "" if path.name == "state.pt" else f"{path.stem}:"
        differ += [prefix + k for k in sorted(px.keys() | py.keys()) if px.get(k) != py.get(k)]
    return differ


def _entry_lines(x: Run, y: Run, step: int, rank: int, parts: list[str]) -> list[str]:
    """For each differing part that is a state dict, which of its entries differ (a model's
    tensors, by name): where to look first."""
    ex, ey = x.entries(rank, step), y.entries(rank, step)
    lines = []
    for part in parts:
        a, b = ex.get(part) or {}, ey.get(part) or {}
        keys = [key for key in {**a, **b} if a.get(key) != b.get(key)] if a and b else []
        if keys:
            total = len(a.keys() | b.keys())
            lines.append(f"in {part}, {len(keys)} of {total} entries differ at step {step}: "
                         f"{_names(keys)}")
    return lines


def _names(parts: list[str]) -> str:
    shown = ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")
    return shown


def _rank(rank: int, ranks: list[int]) -> str:
    return f" (rank {rank})" if len(ranks) > 1 else ""


def _likely_causes(parts: list[str], step: int, stop_at: int, unsaved: str) -> list[str]:
    """What a resume that loses these parts from this step on usually means, in the script's
    terms (``unsaved``: what the script holds beside its checkpoint, described)."""
    lost = [p.removeprefix(UNSAVED) for p in parts if p.startswith(UNSAVED)]
    if lost:
        return [f"certain: {', '.join(lost)} {'is' if len(lost) == 1 else 'are'} in no "
                f"checkpoint ({unsaved}), so a resume starts {'it' if len(lost) == 1 else 'them'}"
                f" afresh: {keep_unsaved_advice(lost)}"]
    rng = [p for p in parts if p.startswith("rng.")]
    causes = []
    if step == stop_at + 1 and rng:
        causes.append("random numbers drawn outside the loop: after Checkpointer() and before "
                      "the loop (a batch fetched ahead, a mask), or between `for epoch` and "
                      "`for batch`; on a resume they come from the fresh seed. Draw them inside "
                      "the loop, or keep their result in ckpt.extras")
    if step == stop_at + 1 and not rng:
        causes.append("a value carried from one step to the next in a local variable (a "
                      "recurrent hidden state, a batch fetched ahead, a running average): "
                      "the checkpoint holds the state between steps, so keep it in "
                      "ckpt.extras")
    if step > stop_at + 1:
        causes.append(f"something that differs only from step {step}: state reset or drawn "
                      "at an epoch boundary (work between `for epoch` and `for batch` runs "
                      "again on a mid-epoch resume), or a value kept outside the checkpoint "
                      "that is used only now and then")
    extras = [p for p in parts if p.startswith("extras.")]
    if extras:
        causes.append(f"{', '.join(extras)} in ckpt.extras differ: set them at the same point "
                      "of the step on every run, and reset them where the script resets them")
    return [f"likely: {cause}" for cause in causes]


def describe(verdict: Verdict) -> str:
    """The verdict line, then its details, for the terminal."""
    return "\n".join([verdict.line, *(f"  {line}" for line in verdict.details)])
