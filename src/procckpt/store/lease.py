"""Which run writes an S3 prefix: a lease object, ``PREFIX/LEASE``, taken before anything is
written there and beaten while the run lasts.

A local dir has a kernel lock (lock.py); two jobs on one prefix have separate local dirs (two
nodes, two working directories) and nothing else in common. Without a lease they find out when
their checkpoint numbers meet and one conditional manifest put fails, and which of the two
that is depends on the race. With it the second to come stops before it trains:

- node 0's launcher puts ``LEASE`` (who: host, pid, Slurm job and restart count, a token of
  this launcher) with ``If-None-Match: *``, and a thread puts it again every :data:`BEAT`
  seconds with ``If-Match`` on the last one's ETag (each put's body differs, so each ETag
  does);
- a launcher that finds another's lease watches it: a lease that changes is beaten by a live
  run, and this one stops with exit 2 and one line. One unchanged for :data:`STALE_BEATS`
  beats is a dead launcher's (killed, its node lost) and is taken over, with ``If-Match``, so
  that of two launchers taking over at once one wins. A requeue of the same Slurm job takes
  its own dead launcher's lease at once, as does a launcher on the machine where the holder
  ran, which sees that its process has ended;
- the lease is deleted when the run ends.

Clocks never enter: liveness is a change seen by the watcher. The conditional manifest put
(remote.py) stays as the last guard, for a launcher stalled past the staleness or a server
without conditional writes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..errors import LockedError, StorageError
from .lock import machine_id

__all__ = ["PrefixLease", "BEAT", "STALE_BEATS"]

logger = logging.getLogger("procckpt")

#: Seconds between two beats of a held lease.
BEAT = 10.0
#: A lease unchanged for this many of its beats is a dead launcher's.
STALE_BEATS = 3


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _job() -> tuple[str | None, int]:
    """This process's Slurm job and how many times it was requeued (0 outside Slurm)."""
    try:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    return os.environ.get("SLURM_JOB_ID") or None, restarts


class PrefixLease:
    """The lease of one prefix (``tier``: its :class:`~procckpt.store.remote.S3Tier`)."""

    def __init__(self, tier: Any, *, beat: float = BEAT) -> None:
        self.tier = tier
        self.key = tier._key("LEASE")
        self.beat = beat
        job, restarts = _job()
        self.me = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                   "machine": machine_id(), "started": _started(os.getpid()), "job": job,
                   "restarts": restarts, "beat": beat, "since": time.time()}
        self._etag: str | None = None
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        return f"s3://{self.tier.bucket}/{self.key}"

    # -- taking it ----------------------------------------------------------------------------
    def take(self) -> None:
        """Hold the lease, waiting up to its staleness to tell a dead holder from a live one.

        Raises:
            LockedError: a live run holds it (exit 2).
            StorageError: the prefix cannot be reached.
        """
        for _ in range(8):  # each turn ends in the lease held, or one seen being taken
            held = self._read()
            if held is None:
                if self._put(if_none_match=True):
                    return
                continue
            record, etag = held
            if self._requeue_of(record) or self._gone_from_here(record):
                if self._put(if_match=etag):
                    logger.info("%s: took over the lease of %s, which has ended", self.where,
                                _who(record))
                    return
                continue
            if self._watch(record, etag):
                return
        raise StorageError(f"{self.where} changed hands 8 times while this launcher tried to "
                           "take it: give each run its own prefix")

    def _requeue_of(self, record: dict[str, Any]) -> bool:
        """Whether the holder was this Slurm job before a requeue (so it is dead)."""
        return (self.me["job"] is not None and record.get("job") == self.me["job"]
                and isinstance(record.get("restarts"), int)
                and record["restarts"] < self.me["restarts"])

    def _gone_from_here(self, record: dict[str, Any]) -> bool:
        """Whether the holder ran on this machine, in this pid namespace, and has ended (its
        pid is gone, or is another process's now)."""
        pid = record.get("pid")
        return (self.me["machine"] is not None and record.get("machine") == self.me["machine"]
                and isinstance(pid, int) and pid > 0
                and _started(pid) != record.get("started"))

    def _watch(self, record: dict[str, Any], etag: str) -> bool:
        """Watch another launcher's lease: raise if it is beaten, take it over (True) if it
        stays unchanged for its staleness; False if it went or changed hands meanwhile."""
        beat = record.get("beat")
        beat = float(beat) if isinstance(beat, (int, float)) and 0 < beat <= 3600 else BEAT
        stale = STALE_BEATS * beat
        who = _who(record)
        logger.info("%s is held by %s; waiting up to %.0fs to see whether that run is alive "
                    "(it beats every %.0fs)", self.where, who, stale, beat)
        until = time.monotonic() + stale
        while time.monotonic() < until:
            time.sleep(min(1.0, beat / 4))
            now = self._read()
            if now is None:
                return False  # released: take it afresh
            if now[1] != etag:
                if now[0].get("token") != record.get("token"):
                    return False  # another launcher took it over: watch that one
                raise LockedError(f"{self.where} is held by a live run ({who}): wait for it "
                                  "to end, or give this run its own prefix")
        if self._put(if_match=etag):
            logger.warning("%s: took over the lease of %s, which was not beaten for %.0fs (its "
                           "launcher was killed or its node lost)", self.where, who, stale)
            return True
        return False

    # -- beating and releasing ------------------------------------------------------------------
    def start(self) -> None:
        """Beat the held lease every :data:`BEAT` seconds, from a thread (a long upload in
        the launcher's own thread must not starve it)."""
        self._thread = threading.Thread(target=self._beat_until_stopped, daemon=True,
                                        name="procckpt-lease")
        self._thread.start()

    def _beat_until_stopped(self) -> None:
        while not self._stop.wait(self.beat):
            try:
                if self._put(if_match=self._etag):
                    continue
            except StorageError as e:  # the next beat tries again; staleness is 3 beats
                logger.debug("%s: a beat failed (%s)", self.where, e)
                continue
            taken = self._read()
            logger.error("%s was taken over by %s: this launcher's beats did not reach it for "
                         "%d beats. The conditional commit still keeps the two runs' "
                         "checkpoints apart; stop one of them", self.where,
                         _who(taken[0]) if taken else "another launcher", STALE_BEATS)
            self._etag = None
            return

    def release(self) -> None:
        """Stop beating; delete the lease if this launcher still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._etag is None:
            return
        try:
            held = self._read()
            if held is not None and held[0].get("token") == self.me["token"]:
                with self.tier._failing("releasing the lease of"):
                    self.tier._client.delete_object(Bucket=self.tier.bucket, Key=self.key)
        except StorageError as e:  # a next launcher takes it over once it is stale
            logger.warning("%s", e)
        self._etag = None

    def __enter__(self) -> PrefixLease:
        self.take()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- the object ---------------------------------------------------------------------------
    def _read(self) -> tuple[dict[str, Any], str] | None:
        """The lease's record and ETag, or None if there is none (an unreadable record is
        some launcher's, whose liveness its ETag still tells)."""
        got = self.tier._get_with_etag(self.key, "reading the lease of")
        if got is None:
            return None
        body, etag = got
        try:
            record = json.loads(body)
        except ValueError:
            record = None
        return (record if isinstance(record, dict) else {}), etag

    def _put(self, *, if_none_match: bool = False, if_match: str | None = None) -> bool:
        """Put this launcher's record under a condition; False if the condition failed."""
        from botocore.exceptions import ClientError

        self._beats += 1
        body = json.dumps({**self.me, "beats": self._beats}).encode()
        condition = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match or ""}
        try:
            with self.tier._failing("writing the lease of"):
                put = self.tier._client.put_object(Bucket=self.tier.bucket, Key=self.key,
                                                   Body=body, **condition)
        except StorageError as e:
            cause = e.__cause__
            if isinstance(cause, ClientError) and cause.response["Error"]["Code"] in (
                    "PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise
        self._etag = put["ETag"]
        return True


def _who(record: dict[str, Any]) -> str:
    """A lease holder in words."""
    if not record.get("host"):
        return "an unknown launcher"
    job = f", Slurm job {record['job']}" if record.get("job") else ""
    return f"pid {record.get('pid')} on {record.get('host')}{job}"
