"""The resume audit: a resumed run checks, in the user's real job, that the first batch it
trains on is the one the interrupted run was about to train on, and that the state its first
step starts from is the one it resumed from.

A checkpoint taken at position P (epoch, batch, step) is followed by the batch at P. Its
fingerprint (a CRC-32 over what the batch holds, whatever holds it: state/contents.py) is
recorded beside the checkpoints, in ``audit/rank-R.json`` (each rank its own), keyed by P:

- a periodic checkpoint: when the loop hands that batch out anyway (a loader that fetches
  ahead, as Lightning's does, handed it out before the checkpoint: it is taken then), so no
  batch is read for the audit;
- a stop: the batch is fetched after the checkpoint is durable, never trained on, just
  before the process exits.

A run resumed at P fingerprints the first batch its loader hands out and compares; at the
same moment it compares the live model and optimizer (and a framework's step counter) with
the state as restored (state/first_step.py). The same: nothing is said (the journal notes it
for ``procckpt status``). Different: one line says which batch or which tensors differ and
what usually causes it; under ``PROCCKPT_AUDIT=strict`` (``procckpt run --audit strict``) the
run stops with exit code 66 before it trains on it. Nothing recorded (a stop at an epoch's
end, whose next batch belongs to a pass not opened yet; a resume on a node that never saw the
checkpoint's run; a record lost with the process): the journal says ``unrecorded`` and the
run goes on. Something the audit cannot look into (an object with no attributes, a ``steps()``
loop that draws from an iterator of its own): ``unaudited``, with one line saying why; never
``same``.

A resume with another number of ranks or another batch size deals the batches out anew: they
differ by design, and only the state is compared.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from ..errors import UsageError
from ..protocol.control import AUDIT_MODES, ENV_AUDIT
from ..protocol.events import append_event
from ..store.completion import AUDIT_DIR  # beside checkpoints/; --force archives it with them
from ..store.files import write_file_atomic
from .save.standing import Standing
from .state import contents
from .state.first_step import StateExpectation
from .unsaved import iterators_held

__all__ = ["BatchAudit", "fingerprint", "audit_mode", "ENV_AUDIT", "AUDIT_MODES", "AUDIT_DIR"]

logger = logging.getLogger(__name__)

STRICT, WARN, OFF = AUDIT_MODES
#: How many recorded batches a rank's file keeps (the newest; older checkpoints are pruned).
KEPT = 16
#: Batches handed out and kept referenced for a checkpoint that follows them (a loader that
#: fetches one ahead): the newest alone, which the loop holds anyway until the next one.
RECENT = 1
#: The record's format: 2 fingerprints what a batch holds, whatever its containers (1: older
#: records, whose CRCs are not comparable: a resume from them is unrecorded).
FORMAT = 2

Key = tuple[int, int, int]  # (epoch, batch, step): the position a batch is trained at


def audit_mode(environ: Any = None) -> str:
    """The audit's mode from ``PROCCKPT_AUDIT`` (warn when unset).

    Raises:
        UsageError: a value that is none of strict, warn, off.
    """
    value = (os.environ if environ is None else environ).get(ENV_AUDIT, "").strip().lower()
    if not value:
        return WARN
    if value not in AUDIT_MODES:
        raise UsageError(f"bad {ENV_AUDIT}={value!r}: expected strict (stop a resume whose "
                         "first batch differs), warn (say so and go on) or off")
    return value


def fingerprint(batch: Any) -> tuple[int, str]:
    """A CRC-32 of what ``batch`` holds (contents.py), and that in words ("2 tensors: 8x3
    float32, 8 int64")."""
    seen = contents.fingerprint(batch)
    return seen.crc, seen.what


@dataclass(frozen=True)
class _Expected:
    """What a resumed run compares its first batch with."""

    checkpoint: str
    key: Key
    recorded: dict[str, Any] | None  # None: nothing was recorded for the position


@dataclass(frozen=True)
class _Seen:
    """A batch (or what a step starts from) as the audit saw it: its CRC and what it held,
    its parts' CRCs where it has parts to name, and what the audit could not look into."""

    crc: int
    what: str
    parts: dict[str, int] | None = None
    unseen: str | None = None


class BatchAudit:
    """One rank's audit: records the batch after each checkpoint, checks the first after a
    resume (and the state that first step starts from). ``root``: the checkpoint dir;
    ``refuse(message)``: ends the process under strict (every rank of a group, once the group
    knows which ranks differ)."""

    def __init__(self, root: Path, rank: int, mode: str, journal: Path | None,
                 refuse: Callable[[str], NoReturn],
                 group_differs: Callable[[bool], list[int]] | None = None) -> None:
        self.mode = mode
        self.path = root / AUDIT_DIR / f"rank-{rank}.json"
        self.rank = rank
        self._journal = journal
        self._refuse = refuse
        #: In a group: the ranks whose first batch after a resume differs (a collective).
        self._group_differs = group_differs
        self._entries: list[dict[str, Any]] | None = None
        #: The record's next content, written by a thread that stays off the training's path
        #: (a small file's rename costs milliseconds on a busy file system; a thread's start,
        #: milliseconds on a busy machine: save/standing.py).
        self._queued: bytes | None = None
        self._writer = Standing("procckpt-audit")
        self._writing: Future[None] | None = None
        self._lock = threading.Lock()
        self._pending: Key | None = None  # a checkpoint's position whose batch is not seen yet
        self._recent: collections.deque[tuple[Key, Any]] = collections.deque(maxlen=RECENT)
        self._live: _AuditedPass | None = None
        #: In a ``steps()`` loop: what a step starts from (the random streams, ckpt.extras),
        #: which stands for the batch the script fetches itself.
        self._inputs: Callable[[dict[str, Any] | None], Any] | None = None
        self._steps_alone = False
        self._expected: _Expected | None = None
        #: The state the first step after a resume must start from (state/first_step.py).
        self._state: StateExpectation | None = None
        self._resumed_from: str | None = None
        #: How the first batch after the resume compared: same, differs, unaudited,
        #: unrecorded (or None).
        self.verdict: str | None = None

    @property
    def on(self) -> bool:
        return self.mode != OFF

    def wrap(self, iterator: Iterator[Any], progress: Any) -> Iterator[Any]:
        """``iterator`` (a loader's pass opened at ``progress``'s position), audited; where
        ``progress.remapped`` says the pass deals the data out anew, only the state its first
        step starts from is."""
        if not self.on:
            return iterator
        self._inputs = None
        if progress.remapped:  # another split of the data: no batch comparable
            self._settle(None)
            if self._state is None:
                return iterator
        self._live = _AuditedPass(iterator, self, progress)
        return self._live

    def steps_open(self, inputs: Callable[[dict[str, Any] | None], Any], alone: bool) -> None:
        """A ``steps()`` loop begins, its steps' data fetched by the script: what each step
        starts from, ``inputs()`` (the random streams its data is drawn with, the batch it
        fetched ahead into ckpt.extras), is recorded and compared instead: ``inputs(streams)``,
        with the random streams captured at this safe point already, if any. ``alone``: not
        inside ``epochs()``, so no epoch's code runs between a checkpoint and the next step."""
        if self.on:
            self._live, self._inputs, self._steps_alone = None, inputs, alone

    def step_starts(self, key: Key, loop: FrameType | None = None) -> None:
        """A step of ``steps()`` starts at ``key``: the first after a resume is compared, the
        first after a checkpoint at an epoch's end recorded. ``loop``: the script's frame that
        runs the loop; an iterator it holds is where it draws its batches from, unseen."""
        if self._inputs is None:
            return
        if self._expected is not None or self._state is not None:
            self._check(key, self._inputs(None), iterators_held(loop))
        if key == self._pending:
            self._record(key, self._inputs(None))

    def expect_state(self, expectation: StateExpectation | None) -> None:
        """The state the first step after this resume must start from (compared when it
        begins)."""
        if self.on and self._resumed_from is not None:
            self._state = expectation

    # -- the run that takes checkpoints -------------------------------------------------------
    def saved(self, key: Key, streams: dict[str, Any] | None = None) -> None:
        """A checkpoint is being taken at ``key``: the next batch is its to record.
        ``streams``: the random streams the checkpoint holds, captured at this safe point (a
        ``steps()`` loop's step starts from them: they need not be captured again)."""
        if not self.on:
            return
        self._pending = key
        if self._inputs is not None:
            # steps(): the next step starts from what is there now, unless the code of the
            # next epoch's start runs first (then it is recorded as that step starts).
            if self._steps_alone or key[1] > 0:
                self._record(key, self._inputs(streams))
            return
        for seen, item in self._recent:
            if seen == key:  # handed out ahead, before the checkpoint: not trained on yet
                self._record(key, item)
                return
        entries = self._load()
        if any(_key_of(e) == key for e in entries):  # left by an earlier run: not this one's
            self._entries = [e for e in entries if _key_of(e) != key]
            self._write()

    def before_exit(self) -> None:
        """The process ends after a stop's checkpoint: fetch the batch that follows it (never
        trained on) and record it. Nothing, if the pass is over (an epoch's end)."""
        live, pending = self._live, self._pending
        if self.on and live is not None and pending is not None:
            try:
                key, item = live.fetch()
            except StopIteration:  # the pass is over
                pass
            except Exception as e:  # the checkpoint is durable: the audit must not fail the stop
                logger.debug("audit: could not fetch the batch after the checkpoint: %s", e)
            else:
                if key == pending:
                    self._record(key, item)
        self.flush()  # the process ends next

    def handed_out(self, key: Key, item: Any) -> None:
        if self._expected is not None or self._state is not None:
            self._check(key, item)
        if key == self._pending:
            self._record(key, item)
        else:
            self._recent.append((key, item))

    def _observe(self, item: Any) -> _Seen:
        """What the audit sees of ``item``: a batch, or (in ``steps()``) the parts a step
        starts from, of which ``ckpt.extras`` entries count only where they hold data (tensors
        or arrays): a value a script sets anew at each start (a time, a run's id) is none of
        the batch's business."""
        if self._inputs is None:
            seen = contents.fingerprint(item)
            return _Seen(seen.crc, seen.what, unseen=seen.unseen)
        prints = {"Python's random stream": contents.fingerprint(item["python"]),
                  "torch's random stream": contents.fingerprint(item["torch"])}
        for key, value in (item.get("extras") or {}).items():
            seen = contents.fingerprint(value)
            if seen.what != "no tensors" or seen.unseen:
                prints[f"ckpt.extras[{key!r}]"] = seen
        parts = {name: seen.crc for name, seen in prints.items()}
        unseen = "; ".join(f"{name}: {seen.unseen}" for name, seen in prints.items()
                           if seen.unseen) or None
        crc = zlib.crc32(json.dumps(parts, sort_keys=True).encode())
        return _Seen(crc, f"{len(parts)} parts", parts, unseen)

    def _record(self, key: Key, item: Any) -> None:
        self._pending = None
        self._recent.clear()
        seen = self._observe(item)
        entries = [e for e in self._load() if _key_of(e) != key]
        entries.append({"epoch": key[0], "batch": key[1], "step": key[2], "crc": seen.crc,
                        "what": seen.what,
                        **({"parts": seen.parts} if seen.parts is not None else {}),
                        **({"unseen": seen.unseen} if seen.unseen else {})})
        self._entries = entries[-KEPT:]
        self._write()

    def _write(self) -> None:
        data = json.dumps({"format": FORMAT, "next": self._entries}).encode()
        with self._lock:
            self._queued = data
            if self._writing is None:
                self._writing = self._writer.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                data, self._queued = self._queued, None
                if data is None:
                    self._writing = None
                    return
            try:
                self.path.parent.mkdir(exist_ok=True)
                write_file_atomic(self.path, data, durable=False)
            except OSError as e:  # the checkpoints are what matters: say it, go on
                logger.warning("could not record the batch after a checkpoint in %s (%s): a "
                               "resume from it cannot be audited", self.path, e.strerror or e)

    def flush(self) -> None:
        """Wait until the record is written (the process may end next)."""
        with self._lock:
            writing = self._writing
        if writing is not None:
            concurrent.futures.wait([writing])

    def _load(self) -> list[dict[str, Any]]:
        if self._entries is None:
            self._entries = []
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                record = json.loads(self.path.read_bytes())
                if record.get("format") == FORMAT:  # an older record's CRCs compare nothing
                    entries = record.get("next")
                    self._entries = [e for e in entries if _key_of(e) is not None]
        return self._entries

    # -- the resumed run ----------------------------------------------------------------------
    def resumed(self, checkpoint: str, key: Key) -> None:
        """The run resumed from ``checkpoint`` at ``key``: its first batch is to compare."""
        if not self.on:
            return
        recorded = next((e for e in reversed(self._load()) if _key_of(e) == key), None)
        self._expected = _Expected(checkpoint, key, recorded)
        self._resumed_from = checkpoint

    def _check(self, key: Key, item: Any, iterators: list[str] | None = None) -> None:
        expected, self._expected = self._expected, None
        state, self._state = self._state, None
        checkpoint = expected.checkpoint if expected is not None else self._resumed_from or "?"
        verdict, differs, why = self._compare(expected, key, item, iterators)
        state_differs = None
        if state is not None:
            try:
                state_differs = state.problem(checkpoint, key[2])
            except Exception as e:  # the audit must never fail the training it observes
                logger.warning("resume audit: could not compare the state the first step "
                               "starts from (%s: %s)", type(e).__name__, e)
        mine = bool(differs or state_differs)
        # In a group every rank gets here at its first batch: the group learns which differ.
        ranks = self._group_differs(mine) if self._group_differs is not None \
            else ([self.rank] if mine else [])
        refused = self.mode == STRICT and bool(ranks)
        if ranks and not mine:  # another rank's
            verdict = "refused" if refused else f"differs on rank {', '.join(map(str, ranks))}"
        elif mine:
            verdict = "refused" if refused else "differs"
        if expected is not None or state_differs:
            self._settle(verdict or "differs", checkpoint, key,
                         state="differs" if state_differs else (None if state is None
                                                                else "same"), why=why)
        if why and not mine:
            logger.warning("resume audit: %s; this resume is not audited", why)
        if not mine:
            if refused:
                self._refuse(f"resume audit: the first batch after {checkpoint} differs on "
                             f"rank {', '.join(map(str, ranks))} of the group (its log says "
                             "how); stopped before training on it (--audit strict)")
            return
        message = f"resume audit: {state_differs}" if state_differs else (
            f"resume audit: {differs}. The data order changed across the resume: usually a "
            f"sampler or generator seeded afresh instead of restored, a set_epoch() missing, "
            f"a loader's state not handed to procckpt, or data files that changed"
            if self._inputs is None else
            f"resume audit: {differs}. The script changed them after procckpt restored them: "
            f"usually a batch fetched ahead written into ckpt.extras again before the loop "
            f"(take it from there after a resume)")
        if refused:
            self._refuse(f"{message}; stopped before training on it (--audit strict)")
        logger.warning("%s; training goes on (--audit strict would stop here)", message)

    def _compare(self, expected: _Expected | None, key: Key, item: Any,
                 iterators: list[str] | None) -> tuple[str | None, str, str | None]:
        """The first batch against the recorded one: the verdict, what differs (in words, or
        ""), and why it was not audited (or None)."""
        if expected is None:
            return None, "", None
        if iterators:
            return "unaudited", "", (
                f"the steps() loop draws its batches from {', '.join(iterators)}, which procckpt "
                "neither positions nor sees (a resume starts it afresh unless the script "
                "restores it): iterate ckpt.batches(loader) for an exact, audited resume")
        if key != expected.key or expected.recorded is None:
            return "unrecorded", "", None  # unrecorded also: the loop went on elsewhere
        seen = self._observe(item)
        unseen = seen.unseen or expected.recorded.get("unseen")
        subject = (f"batch {key[1]} of epoch {key[0]} (step {key[2]})" if self._inputs is None
                   else f"what step {key[2] + 1} starts from (the random streams and "
                        "ckpt.extras)")
        if unseen:
            return "unaudited", "", (f"{subject} holds what the audit cannot look into "
                                     f"({unseen})")
        if seen.crc == expected.recorded["crc"]:
            return "same", "", None
        was = expected.recorded.get("what")
        recorded_parts = expected.recorded.get("parts") or {}
        named = [name for name, crc in (seen.parts or {}).items()
                 if recorded_parts.get(name, crc) != crc]
        which = f" ({', '.join(named)} differ{'s' if len(named) == 1 else ''})" if named else ""
        return "differs", (
            f"{subject}, the first after {expected.checkpoint}, is not what the interrupted run "
            f"was about to train on{which} (CRC-32 {seen.crc:08x}, {seen.what}; it had "
            f"{expected.recorded['crc']:08x}{f', {was}' if was else ''})"), None

    def _settle(self, verdict: str | None, checkpoint: str | None = None,
                key: Key | None = None, state: str | None = None,
                why: str | None = None) -> None:
        self._expected = None
        self.verdict = verdict
        if verdict is None or checkpoint is None or key is None or self._journal is None:
            return
        append_event(self._journal, "audit", checkpoint=checkpoint, epoch=key[0],
                     batch=key[1], step=key[2], verdict=verdict,
                     **({"state": state} if state else {}), **({"why": why} if why else {}))


class _AuditedPass:
    """A loader's pass that tells the audit each batch it hands out, with its position."""

    def __init__(self, inner: Iterator[Any], audit: BatchAudit, progress: Any) -> None:
        self._inner = inner
        self._audit = audit
        self._progress = progress
        self._epoch = progress.epoch
        self._index = progress.batch  # the number, in its epoch, of the next batch

    def __iter__(self) -> _AuditedPass:
        return self

    def __next__(self) -> Any:
        key, item = self.fetch()
        self._audit.handed_out(key, item)
        return item

    def fetch(self) -> tuple[Key, Any]:
        """The next batch and its position (batches before it may still be in training)."""
        item = next(self._inner)
        p = self._progress
        key = (self._epoch, self._index, p.step + self._index - p.batch)
        self._index += 1
        return key, item

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # what a framework asks of the loader's iterator
        return getattr(self._inner, name)


def _key_of(entry: Any) -> Key | None:
    try:
        return int(entry["epoch"]), int(entry["batch"]), int(entry["step"])
    except (KeyError, TypeError, ValueError):
        return None
