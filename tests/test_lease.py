"""The prefix's lease (store/lease.py) against a real S3-compatible server (moto's, on
loopback), with beats of a second: a live holder is told from a dead one by its
beats alone, a dead one is taken over after three, a requeue of the same Slurm job takes its
own at once, of two launchers taking over one stale lease exactly one holds it, and a holder
whose lease was taken over says so."""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from .harness.s3_server import bucket, moto_server, s3_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None,
    reason="needs boto3 and moto's server (pip install boto3 'moto[server]')")

BUCKET = "lease-tests"
BEAT = 1.0  # three of them are the staleness; a loaded machine still beats in time


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        bucket(url, BUCKET)
        yield url


@pytest.fixture
def tier(endpoint, monkeypatch, request):
    from procckpt.store.remote import S3Tier

    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    return lambda: S3Tier(f"s3://{BUCKET}/{request.node.name[:40]}")


def lease(tier, beat: float = BEAT):
    from procckpt.store.lease import PrefixLease

    return PrefixLease(tier(), beat=beat)


def held_by(tier) -> str | None:
    read = lease(tier)._read()
    return None if read is None else read[0].get("token")


def test_a_beaten_lease_stops_the_second_launcher_and_is_gone_after_the_run(tier):
    from procckpt.errors import LockedError

    first = lease(tier)
    with first:
        with pytest.raises(LockedError, match=r"LEASE is held by a live run \(pid \d+ on .*\): "
                                              "wait for it to end, or give this run its own "
                                              "prefix"):
            lease(tier).take()
        assert held_by(tier) == first.me["token"]
    assert held_by(tier) is None


def test_an_unbeaten_lease_is_taken_over_after_three_beats(tier, caplog):
    dead = lease(tier)
    dead.take()  # and never beaten: its launcher was killed
    second = lease(tier)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="procckpt"):
        second.take()
    waited = time.monotonic() - started
    assert 3 * BEAT <= waited < 3 * BEAT + 30, waited
    assert held_by(tier) == second.me["token"]
    assert "which was not beaten for 3s" in caplog.text, caplog.text


def test_a_requeued_slurm_job_takes_its_own_lease_at_once(tier, monkeypatch):
    from procckpt.errors import LockedError

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    before = lease(tier, beat=60)
    before.take()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    started = time.monotonic()
    requeued = lease(tier, beat=60)
    requeued.take()
    assert time.monotonic() - started < 5
    assert held_by(tier) == requeued.me["token"]
    requeued.release()
    monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job: watched, not taken
    other = lease(tier)
    beating = lease(tier)
    beating.take()
    beating.start()
    try:
        with pytest.raises(LockedError):
            other.take()
    finally:
        beating.release()


def test_of_two_launchers_taking_over_one_dead_lease_one_holds_it(tier):
    from procckpt.errors import LockedError

    lease(tier).take()  # dead
    contenders = [lease(tier), lease(tier)]
    outcomes: list[object] = [None, None]

    def take(i: int) -> None:
        try:
            contenders[i].take()
            contenders[i].start()
            outcomes[i] = "held"
        except LockedError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert sorted(map(str, outcomes)).count("held") == 1, outcomes
        winner = contenders[outcomes.index("held")]
        assert held_by(tier) == winner.me["token"]
    finally:
        for c in contenders:
            c.release()


def test_a_holder_whose_lease_was_taken_over_says_so_once(tier, caplog):
    stalled = lease(tier)
    stalled.take()  # stalled past three beats, then beats again
    lease(tier).take()
    with caplog.at_level(logging.ERROR, logger="procckpt"):
        stalled.start()
        time.sleep(3 * BEAT)
        stalled.release()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "was taken over by pid " in errors[0], errors
    assert held_by(tier) is not None and held_by(tier) != stalled.me["token"]


def test_a_holder_that_ran_here_and_ended_is_taken_over_at_once(tier, caplog):
    """A launcher killed on this machine (the next one runs where it ran): its pid is gone,
    or belongs to another process now, so its lease is taken without waiting three beats."""
    import subprocess

    from procckpt.store.lease import _started

    for reuse in (False, True):
        holder = subprocess.Popen(["sleep", "60"])
        killed = lease(tier, beat=600)  # stale only after 30 minutes
        killed.me.update(pid=holder.pid, started=_started(holder.pid))
        killed.take()
        if reuse:  # the pid names another process now: a start time not the holder's
            killed.me["started"] = "1"
            killed._put(if_match=killed._etag)
        else:
            holder.kill()
            holder.wait()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="procckpt"):
            after = lease(tier)
            after.take()
        assert held_by(tier) == after.me["token"]
        assert f"took over the lease of pid {holder.pid} on " in caplog.text, caplog.text
        assert "which has ended" in caplog.text and "waiting" not in caplog.text
        after.release()
        holder.kill()
        holder.wait()
