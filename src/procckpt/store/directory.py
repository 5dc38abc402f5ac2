"""The checkpoint dir: open it, list and verify its checkpoints, keep N, quarantine, fall back.

Layout of a checkpoint directory::

    DIR/
      .procckpt                 marker: this directory belongs to procckpt (format version)
      lock                      flock()ed by the process that owns the run; says who in its text
      events.jsonl              the journal (see protocol/events.py)
      control/                  requests and acks between the launcher and the training
                                (see protocol/control.py)
      COMPLETE                  written once the training finished
      checkpoints/
        ckpt-00000007/          one directory per checkpoint, named by a sequence number
          state.pt              payload file(s), written by an engine
          MANIFEST.json         written last: sizes and CRC-32 of every payload file, chunks
        .tmp-ckpt-...           a checkpoint being written; never loaded, removed at start
      chunks/blake3/ab/ab...    state shared by checkpoints, named by its hash (chunks.py)

A checkpoint is written through :class:`PendingCheckpoint` (pending.py) and appears under its
final name whole or not at all. The manifest's checksums (manifest.py) catch what the rename
cannot: a disk or copy that later truncates or flips bits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointReadError, StoreError
from .chunks import ChunkStore
from .completion import COMPLETE, Completion
from .files import (
    READ_RETRY_PAUSES,
    file_crc32,
    format_size,
    modified,
    read_small_file,
    read_with_retries,
    write_file_atomic,
)
from .lock import DirLock
from .manifest import (
    FORMAT_VERSION,
    FROZEN_SHARDS,
    MANIFEST,
    READABLE_FORMATS,
    CheckpointInfo,
    manifest_problem,
)
from .pending import PendingCheckpoint
from .remote import ENV_LOCAL, S3Tier, marked_remote

__all__ = ["CheckpointStore", "MARKER", "COMPLETE", "format_size"]

logger = logging.getLogger(__name__)

MARKER = ".procckpt"
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})$")


#: The entries a new checkpoint dir gets before its marker.
_OWN_FIRST = ("checkpoints", "control")
#: A temporary file this young outside checkpoints/ may be a write in flight by another
#: launcher that holds no lock (a follower pod of a run on several nodes): it is kept.
FRESH_TEMPORARY = 60.0


class CheckpointStore(Completion):
    """A checkpoint directory. ``open()`` must be called before anything else."""

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 2,
                 journal: Callable[..., object] | None = None, remote: str | None = None) -> None:
        """``journal(path, kind, **fields)`` records what the store did to the dir (a
        checkpoint moved aside, the run archived) in the journal at ``path``; the owners of
        the dir pass the protocol's ``append_event`` (the store is below the protocol).
        ``remote``: the ``s3://`` URL whose local dir ``root`` is (remote.py); a dir made
        for one says so in its marker, so every later opener finds it."""
        if keep < 1:
            raise StoreError(f"keep must be at least 1, got {keep}")
        self.root = Path(root).absolute()
        self.keep = keep
        self.ckpt_root = self.root / "checkpoints"
        self.control_dir = self.root / "control"
        self.events_path = self.root / "events.jsonl"
        self.complete_path = self.root / COMPLETE
        self.chunks = ChunkStore(self.root / "chunks")
        self.remote_url = remote or marked_remote(self.root / MARKER)
        self._remote: S3Tier | None = None
        #: Adds files that others wrote to each checkpoint before it is committed (a
        #: framework's own checkpoint files: see integrations/transformers.py).
        self.adopt: Callable[[PendingCheckpoint], None] | None = None
        self._journal = journal

    # -- set-up -----------------------------------------------------------------------------
    def open(self, *, create: bool = True) -> CheckpointStore:
        """Check that the directory is ours and writable, creating it if needed.

        Raises:
            StoreError: the directory is unwritable, is a file, or holds someone else's files.
        """
        try:
            return self._open(create)
        except OSError as e:
            raise StoreError(f"cannot use checkpoint dir {self.root}: {e.strerror or e}; fix its "
                             "permissions or choose another with --dir") from e

    def _open(self, create: bool) -> CheckpointStore:
        root = self.root
        if root.exists() and not root.is_dir():
            raise StoreError(f"checkpoint dir {root} is a file; pass a directory with --dir")
        if root.is_dir():
            marker = root / MARKER
            if not marker.exists():
                # What another procckpt that is creating the dir right now makes (the pods of a
                # run on several nodes start together) is not someone else's.
                others = [p.name for p in root.iterdir() if p.name not in _OWN_FIRST
                          and not p.name.startswith(".tmp-")][:3]
                if others and marker.exists():  # its marker came while we looked: ours
                    self._check_marker(marker, self.remote_url)
                elif others:
                    raise StoreError(
                        f"{root} is not a procckpt checkpoint dir (it holds {', '.join(others)}"
                        f"{', ...' if len(others) == 3 else ''}); pick a new or empty directory"
                    )
            else:
                self._check_marker(marker, self.remote_url)
        elif not create:
            raise StoreError(f"checkpoint dir {root} does not exist")
        try:
            root.mkdir(parents=True, exist_ok=True)
            for sub in (self.ckpt_root, self.control_dir):
                with contextlib.suppress(FileExistsError):
                    sub.mkdir()
                if not stat.S_ISDIR(os.lstat(sub).st_mode):  # a link, a file: nothing goes there
                    raise StoreError(f"{sub} is not a directory (a link?), and procckpt follows "
                                     "no links inside its checkpoint dir: remove it and run again")
            marker = root / MARKER
            if not marker.exists():
                write_file_atomic(marker, json.dumps({
                    "format": FORMAT_VERSION, "created": time.time(),
                    "remote": self.remote_url}).encode())
            probe = root / f".tmp-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            probe.write_bytes(b"")
            probe.unlink()
        except PermissionError as e:
            raise StoreError(
                f"checkpoint dir {root} is not writable ({e.strerror}); fix its permissions "
                "or choose another with --dir"
            ) from e
        except OSError as e:
            raise StoreError(f"cannot use checkpoint dir {root}: {e.strerror or e}") from e
        return self

    @staticmethod
    def _check_marker(marker: Path, remote: str | None) -> None:
        try:
            text = read_small_file(marker)
        except OSError as e:
            raise StoreError(f"cannot read {marker}: {e.strerror}; fix the checkpoint dir's "
                             "permissions or choose another --dir") from e
        try:
            fmt = json.loads(text).get("format")
        except (ValueError, AttributeError) as e:
            raise StoreError(f"{marker} is damaged; pick a new directory") from e
        if fmt != FORMAT_VERSION:
            raise StoreError(
                f"{marker.parent} was written by an incompatible procckpt (format {fmt}, "
                f"this one reads {FORMAT_VERSION}); use the matching version or a new --dir"
            )
        if remote != marked_remote(marker):
            raise StoreError(f"{marker.parent} is the local dir of "
                             f"{marked_remote(marker) or 'no remote dir'}, not of {remote}; "
                             f"set {ENV_LOCAL} to another local dir")

    @property
    def remote(self) -> S3Tier | None:
        """The remote prefix that holds the committed checkpoints, if the dir has one."""
        if self._remote is None and self.remote_url is not None:
            self._remote = S3Tier(self.remote_url)
        return self._remote

    def lock(self, purpose: str = "run") -> DirLock:
        """Take the directory's lock; raises LockedError if a live process holds it."""
        lock = DirLock(self.root / "lock")
        lock.acquire(purpose)
        return lock

    def clean_temporaries(self) -> list[Path]:
        """Remove what a crash left half-written. Call while holding the lock. Every
        temporary in checkpoints/ goes (the command that wrote it is gone); in the dir's top
        level and control/ only one older than FRESH_TEMPORARY (small files, which a
        follower's launcher may be writing now)."""
        removed = []
        fresh_from = time.time() - FRESH_TEMPORARY
        for parent in (self.ckpt_root, self.root, self.control_dir):
            if not parent.is_dir():
                continue
            for p in parent.iterdir():
                if p.name.startswith(".tmp-"):
                    if parent != self.ckpt_root and modified(p) > fresh_from:
                        continue
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            p.unlink()
                    removed.append(p)
        if removed:
            logger.info("removed %d unfinished temporary file(s) from an earlier crash",
                        len(removed))
        return removed

    # -- writing ----------------------------------------------------------------------------
    def next_seq(self) -> int:
        seqs = [self._seq_of(p) for p in self._ckpt_dirs(include_bad=True)]
        return max(seqs, default=0) + 1

    def begin(self, meta: dict[str, Any]) -> PendingCheckpoint:
        """Start a new checkpoint; ``meta`` (step, epoch, reason, ...) goes into its manifest."""
        publish = None if self.remote is None else \
            lambda info: self.remote.publish(info, self.chunks)  # type: ignore[union-attr]
        return PendingCheckpoint(self.ckpt_root, self.next_seq(), meta, self.next_seq,
                                 adopt=self.adopt, chunk_store=self.chunks, publish=publish)

    def prune(self) -> list[Path]:
        """Delete old checkpoints: keep the newest ``keep`` valid ones and the best one.

        Only checkpoints older than the newest kept one are deleted, and never the last
        valid checkpoint, so a failure here can cost disk space but never the run.
        """
        infos = self.checkpoints()
        keep: set[Path] = {i.path for i in infos[: self.keep]}
        best = self.best(infos)
        if best is not None:
            keep.add(best.path)
        removed = []
        for info in infos[self.keep:]:
            if info.path not in keep:
                # Rename first: a crash in the middle of rmtree then leaves a temporary that
                # the next start removes, not a half-deleted checkpoint that looks corrupt.
                doomed = self.ckpt_root / f".tmp-delete-{info.name}-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(info.path, doomed)
                except OSError:
                    continue
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(info.path)
        self.collect_chunks()
        if self.remote is not None:  # its newest N, and the ones kept here
            self.remote.prune(self.keep, {p.name for p in keep})
        return removed

    def collect_chunks(self) -> None:
        """Remove the chunks that no checkpoint in the dir lists (moved-aside ones count, so
        that they stay whole for inspection). Called by the writing process after pruning."""
        referenced: set[str] = set()
        for p in self._ckpt_dirs(include_bad=True):
            with contextlib.suppress(CheckpointReadError):
                referenced.update((self._read_manifest(p, retry=False) or {}).get("chunks", {}))
        removed, freed = self.chunks.collect(referenced)
        if removed:
            logger.debug("removed %d chunk(s) no checkpoint lists (%s)", removed,
                         format_size(freed))

    # -- reading ----------------------------------------------------------------------------
    def _ckpt_dirs(self, include_bad: bool = False) -> list[Path]:
        if not self.ckpt_root.is_dir():
            return []
        dirs = [p for p in self.ckpt_root.iterdir() if _CKPT_RE.match(p.name.split(".")[0])
                and (include_bad or _CKPT_RE.match(p.name))]
        return sorted(dirs, key=self._seq_of, reverse=True)

    @staticmethod
    def _seq_of(path: Path) -> int:
        return int(path.name.split(".")[0].split("-")[1])

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest parses, newest first (contents not verified);
        one whose manifest cannot be read right now is left out."""
        infos = []
        for p in self._ckpt_dirs():
            try:
                manifest = self._read_manifest(p, retry=False)
            except CheckpointReadError:
                continue
            if manifest is not None:
                infos.append(CheckpointInfo(p, self._seq_of(p), manifest))
        return infos

    @staticmethod
    def _read_manifest(path: Path, retry: bool = True) -> dict[str, Any] | None:
        """The manifest of the checkpoint at ``path``; None if it is missing or malformed.

        Raises:
            CheckpointReadError: it exists but cannot be read (permissions, I/O).
        """
        manifest, _ = CheckpointStore._manifest_and_problem(path, retry)
        return manifest

    @staticmethod
    def _manifest_and_problem(path: Path, retry: bool = True,
                              ) -> tuple[dict[str, Any] | None, str | None]:
        """The checkpoint's manifest if it is usable, else None and why not.

        Raises:
            CheckpointReadError: it exists but cannot be read (permissions, I/O).
        """
        target = path / MANIFEST
        pauses = READ_RETRY_PAUSES if retry else ()
        try:
            manifest = json.loads(read_with_retries(target, lambda: read_small_file(target),
                                                    pauses))
        except FileNotFoundError:
            return None, "its manifest is missing"
        except OSError as e:
            return None, f"its manifest is not a regular file ({e.strerror})"
        except (ValueError, UnicodeDecodeError):
            return None, "its manifest is not valid JSON"
        problem = manifest_problem(manifest)
        if problem is not None:
            return None, f"its manifest is malformed ({problem})"
        return manifest, None

    def verify(self, path: Path, *, skip_crc: frozenset[str] = frozenset(),
               hash_chunks: bool = True) -> str | None:
        """Return why the checkpoint at ``path`` cannot be used, or None if it is intact.

        ``skip_crc`` names files whose checksum the caller verifies itself (an engine that
        checksums a file while mapping it in); their presence and size are still checked.
        ``hash_chunks=False``: the caller hashes the chunks as it reads them.
        """
        manifest, problem = self._manifest_and_problem(path)
        if manifest is None:
            return problem
        if manifest.get("format") not in READABLE_FORMATS:
            return f"it has format {manifest.get('format')}, expected {FORMAT_VERSION}"
        # DCP reads the frozen sharded parameters' chunks and checks no hash: hashed here.
        by_dcp = set((manifest.get(FROZEN_SHARDS) or {}).values())
        problem = self.chunks.problem(manifest.get("chunks") or {}, hash_them=hash_chunks,
                                      hash_these=by_dcp)
        if problem is not None:
            return problem
        for name, expect in manifest["files"].items():
            target = path / name
            try:
                st = read_with_retries(target, lambda: os.lstat(target))  # noqa: B023
            except FileNotFoundError:
                return f"{name} is missing"
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file"
            if st.st_size != expect["bytes"]:
                return f"{name} has {st.st_size} bytes, the manifest says {expect['bytes']}"
            if name in skip_crc:
                continue
            try:
                crc, _ = read_with_retries(target, lambda: file_crc32(target))  # noqa: B023
            except OSError:
                return f"{name} is missing or was replaced while being read"
            if crc != expect["crc32"]:
                return f"{name} fails its checksum (the file is corrupt)"
        return None

    def intact_setting_aside_damaged(self, *, skip_crc: frozenset[str] = frozenset(),
                                     hash_chunks: bool = True) -> Iterator[CheckpointInfo]:
        """Yield intact checkpoints, newest first; each damaged one is logged loudly and
        moved aside as ``ckpt-N.corrupt`` (kept for inspection, never loaded again).
        ``skip_crc``, ``hash_chunks``: see :meth:`verify`."""
        self.fetch_remote()
        for p in self._ckpt_dirs():
            problem = self.verify(p, skip_crc=skip_crc, hash_chunks=hash_chunks)
            if problem is None:
                manifest = self._read_manifest(p)
                assert manifest is not None
                yield CheckpointInfo(p, self._seq_of(p), manifest)
                continue
            self.quarantine(p, problem)

    def newest_intact(self) -> CheckpointInfo | None:
        """The newest intact checkpoint, or None, changing nothing: damaged ones are passed
        over, not moved aside (for a reader that does not own the dir). The three readers are
        named by their effects: this one has none; :meth:`intact_setting_aside_damaged` moves
        damaged ones aside; :meth:`newest_for_resume` does too, and raises when every one is
        damaged."""
        for p in self._ckpt_dirs():
            manifest = self._read_manifest(p) if self.verify(p) is None else None
            if manifest is not None:
                return CheckpointInfo(p, self._seq_of(p), manifest)
        return None

    def quarantine(self, path: Path, problem: str) -> None:
        """Log that the checkpoint at ``path`` is unusable and move it aside."""
        logger.warning("checkpoint %s is unusable: %s; falling back to the previous one",
                       path.name, problem)
        with contextlib.suppress(OSError):
            os.rename(path, path.with_name(path.name + ".corrupt"))
        self._record("corrupt", checkpoint=path.name, problem=problem)
        if self.remote is not None:
            self.remote.set_aside(path.name, problem)

    def fetch_remote(self) -> None:
        """With a remote dir, download its newest checkpoint if it is newer than every local
        one (a resume on another node, or in a new local dir)."""
        if self.remote is not None:
            newest = max((self._seq_of(p) for p in self._ckpt_dirs(include_bad=True)), default=0)
            self.remote.fetch_newer(newest, self.ckpt_root, self.chunks)

    def newest_for_resume(self) -> CheckpointInfo | None:
        """The newest intact checkpoint, None if there never was one.

        Raises:
            CheckpointCorruptError: checkpoints exist but every one of them is damaged; starting
                from scratch silently would throw the run away.
        """
        for info in self.intact_setting_aside_damaged():
            return info
        if self._ckpt_dirs(include_bad=True):
            raise CheckpointCorruptError(
                f"every checkpoint in {self.ckpt_root} is damaged (see the warnings above); "
                "refusing to start from scratch: move the directory away to train anew"
            )
        return None

    @staticmethod
    def best(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
        scored = [i for i in infos if i.metric is not None]
        if not scored:
            return None
        mode = scored[0].manifest.get("metric_mode", "max")
        return (max if mode == "max" else min)(scored, key=lambda i: i.metric)  # type: ignore[arg-type,return-value]

    def room_shortfall(self) -> str | None:
        """Why the dir's file system may not hold the checkpoints it is to keep, or None: keeping
        N checkpoints needs room for N + 1 while the next one is written."""
        try:
            infos = self.checkpoints()
            free = shutil.disk_usage(self.root).free
        except OSError:
            return None
        if not infos:
            return None
        need = (self.keep + 1) * infos[0].nbytes
        held = sum(info.nbytes for info in infos)  # pruning gives their room to new ones
        if free + held >= need:
            return None
        return (f"only {format_size(free)} free in {self.root}, and keeping {self.keep} "
                f"checkpoints of {format_size(infos[0].nbytes)} each needs up to "
                f"{format_size(need)} while the next is written: make room or lower --keep")

    def _record(self, kind: str, **fields: object) -> None:
        if self._journal is not None:
            self._journal(self.events_path, kind, **fields)
