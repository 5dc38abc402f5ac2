"""Checkpoints in object storage (``--dir s3://BUCKET/PREFIX``, store/remote.py) against a real
S3-compatible server on loopback (moto's server mode; a proxy in front of it answers 503 where a
test says): time-limit cycles end bit-identical with keep-N there; a new node resumes from the
prefix and falls back past a damaged checkpoint; a SIGKILL during an upload leaves no manifest
that lists a missing object, and nothing once the next run collects; a server that answers 503
is retried, one that stays down ends the run with one line and the local checkpoint intact."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, PYTHON, assert_bit_identical, procckpt_argv, run
from ..harness.processes import cycles_stopped_at, joined, stopped_once
from ..harness.s3_server import FlakyProxy, bucket, free_port, moto_server, s3_env
from .test_frameworks import command, events, needs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None,
    reason="needs boto3 and moto's server (pip install boto3 'moto[server]')")

SCRIPT = EXAMPLES / "finetune_frozen.py"
BUCKET = "procckpt-tests"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        bucket(url, BUCKET)
        yield url


@functools.lru_cache(maxsize=None)
def client(endpoint: str):
    import boto3

    env = s3_env(endpoint)
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        region_name=env["AWS_DEFAULT_REGION"])


def keys(endpoint: str, prefix: str) -> list[str]:
    pages = client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                       Prefix=prefix + "/")
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def manifests(endpoint: str, prefix: str) -> dict[str, dict]:
    out = {}
    s3 = client(endpoint)
    for key in keys(endpoint, prefix):
        if key.endswith("/MANIFEST.json"):
            try:
                body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:  # pruned since it was listed
                continue
            out[key.split("/")[-2]] = json.loads(body)
    return out


def dangling(endpoint: str, prefix: str) -> set[str]:
    """Objects under chunks/ that no manifest (set-aside ones included) lists (the objects
    are listed first: one uploaded meanwhile does not count)."""
    stored = {f"{k.split('/')[-3]}:{k.split('/')[-1]}" for k in keys(endpoint, prefix)
              if "/chunks/" in k}
    listed = set()
    for m in manifests(endpoint, prefix).values():
        listed |= set(m["objects"].values()) | set(m.get("chunks") or {})
    return stored - listed


def reference(workdir: Path, *args: str) -> Path:
    out = workdir / "reference.pt"
    res = run([PYTHON, str(SCRIPT), *args, "--ckpt-dir", str(workdir / "ref-ckpt"), "--out",
               str(out)], cwd=workdir)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_stopped_cycles_on_s3_end_bit_identical_keeping_n_there(workdir: Path, endpoint,
                                                                launch: str):
    """Under torchrun (DDP, 2 gloo ranks) rank 0 publishes; both ranks of a resumed cycle
    share the node's local dir, where the first to fetch a checkpoint places it."""
    command = [PYTHON] if launch == "python" else [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # As tests/e2e/test_frozen_base.py: three cycles, each but the last stopped (SIGUSR1)
    # once the training reached a step, alone or under torchrun; periodic checkpoints too.
    epochs, sleep, stops = ("15", "0.12", [60, 150]) if launch == "python" else \
        ("10", "0.25", [40, 100])
    expected = workdir / "reference.pt"
    ref = run([*command, str(SCRIPT), "--epochs", epochs, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, prefix = workdir / "out.pt", f"cycles-{launch}"
    local = workdir / "procckpt-local" / BUCKET / prefix
    res = joined(cycles_stopped_at(
        ["--dir", f"s3://{BUCKET}/{prefix}", "--keep", "2", "--grace", "4s", "--interval", "2s",
         "--engine", "hooks", "--", *command, str(SCRIPT), "--epochs", epochs, "--step-sleep",
         sleep, "--out", str(out)], workdir, local, stops, env=s3_env(endpoint), timeout=900))
    assert f"checkpoints go to s3://{BUCKET}/{prefix}; the lock, control channel and journal " \
           f"stay in {local}" in res.stderr, res.stderr[-3000:]
    assert len(events(local, "resume")) == len(stops), res.stderr[-3000:]
    assert_bit_identical(expected, out)
    remote = manifests(endpoint, prefix)
    assert len(remote) == 2, sorted(remote)  # --keep 2, there as here
    assert sorted(remote) == sorted(p.name for p in (local / "checkpoints").iterdir())
    assert not dangling(endpoint, prefix)
    assert any(k.endswith("/COMPLETE") for k in keys(endpoint, prefix))
    status = run([*procckpt_argv(), "status", f"s3://{BUCKET}/{prefix}"], cwd=workdir,
                 env=s3_env(endpoint))
    assert status.returncode == 0, status.stderr
    assert f"remote:         s3://{BUCKET}/{prefix}: {', '.join(sorted(remote, reverse=True))}" \
        in status.stdout, status.stdout
    report = run([*procckpt_argv(), "report", f"s3://{BUCKET}/{prefix}"], cwd=workdir,
                 env=s3_env(endpoint))
    assert report.returncode == 0 and (local / "report.html").is_file(), report.stderr


@pytest.mark.parametrize("damaged", ["object", "manifest"])
def test_a_new_node_resumes_from_s3_falling_back_past_a_damaged_checkpoint(workdir: Path,
                                                                           endpoint, damaged):
    """The newest checkpoint's payload object is overwritten with zeros, or its manifest's
    CRC-32 for it changed (still valid JSON): a new node sets it aside, saying which and why,
    and resumes from the one before, in the same start."""
    env = {**s3_env(endpoint), "PROCCKPT_DIR": f"s3://{BUCKET}/{damaged}"}
    first = run([PYTHON, str(SCRIPT), "--epochs", "3"], cwd=workdir,
                env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / "node-a")})
    assert first.returncode == 0, first.stderr[-3000:]
    remote = manifests(endpoint, damaged)
    assert sorted(remote) == ["ckpt-00000002", "ckpt-00000003"]
    s3 = client(endpoint)
    newest = remote["ckpt-00000003"]
    if damaged == "object":
        algo, hexdigest = newest["objects"]["state.pt"].split(":")
        s3.put_object(Bucket=BUCKET, Key=f"{damaged}/chunks/{algo}/{hexdigest[:2]}/{hexdigest}",
                      Body=b"\0" * newest["files"]["state.pt"]["bytes"])
    else:
        newest["files"]["state.pt"]["crc32"] ^= 1
        s3.put_object(Bucket=BUCKET, Key=f"{damaged}/checkpoints/ckpt-00000003/MANIFEST.json",
                      Body=json.dumps(newest).encode())
    s3.delete_object(Bucket=BUCKET, Key=f"{damaged}/COMPLETE")  # train on: 2 more epochs

    out = workdir / "out.pt"
    second = run([PYTHON, str(SCRIPT), "--epochs", "4", "--out", str(out)], cwd=workdir,
                 env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / "node-b")})
    assert second.returncode == 0, second.stderr[-3000:]
    why = "object" if damaged == "object" else "its manifest is damaged: it says state.pt has"
    assert f"ckpt-00000003 set aside: {why}" in second.stderr, second.stderr[-3000:]
    assert "resumed from ckpt-00000002" in second.stderr, second.stderr[-3000:]
    assert_bit_identical(reference(workdir, "--epochs", "4"), out)
    assert "ckpt-00000003.corrupt" in manifests(endpoint, damaged)


def test_a_sigkill_during_an_upload_leaves_the_last_committed_and_nothing_after(workdir: Path,
                                                                                 endpoint):
    env = {**os.environ, **s3_env(endpoint), "PROCCKPT_DIR": f"s3://{BUCKET}/killed",
           "PROCCKPT_LOCAL_DIR": str(workdir / "node-a"), "PROCCKPT_S3_UPLOAD_PAUSE": "0.5"}
    proc = subprocess.Popen([PYTHON, str(SCRIPT), "--epochs", "30"], cwd=workdir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        # The first checkpoint committed, then an object of a later one uploaded before its
        # manifest: the upload is in flight.
        while not (manifests(endpoint, "killed") and dangling(endpoint, "killed")):
            assert proc.poll() is None and time.monotonic() < deadline, "no upload in flight"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    committed = max(manifests(endpoint, "killed"))
    assert dangling(endpoint, "killed")  # what the killed upload left

    # Another node: it resumes from what the prefix committed, and its run collects the rest.
    again = run([PYTHON, str(SCRIPT), "--epochs", "30"], cwd=workdir,
                env={**s3_env(endpoint), "PROCCKPT_DIR": f"s3://{BUCKET}/killed",
                     "PROCCKPT_LOCAL_DIR": str(workdir / "node-b")})
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {committed}" in again.stderr, again.stderr[-3000:]
    assert not dangling(endpoint, "killed")


def test_503s_are_retried_and_a_server_that_stays_down_ends_the_run_in_one_line(workdir: Path,
                                                                               endpoint):
    with FlakyProxy(endpoint, fail_every=3) as proxy:
        # 8 tries a request: one of them goes through (uploads run in parallel, so a
        # request may meet the refused third several times in a row, but not 8).
        env = {**s3_env(proxy.endpoint), "PROCCKPT_DIR": f"s3://{BUCKET}/flaky",
               "AWS_MAX_ATTEMPTS": "8"}
        res = run([PYTHON, str(SCRIPT), "--epochs", "3"], cwd=workdir, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "failed" not in res.stderr, res.stderr[-3000:]
        assert proxy.refused >= 5, proxy.refused
        assert sorted(manifests(endpoint, "flaky")) == ["ckpt-00000002", "ckpt-00000003"]

        proxy.down = True  # every request answered 503 from now on
        client(endpoint).delete_object(Bucket=BUCKET, Key="flaky/COMPLETE")
        local = workdir / "procckpt-local" / BUCKET / "flaky"
        (local / "COMPLETE").unlink()  # train on: the run reads the prefix first
        down = run([*procckpt_argv(), "run", "--dir", f"s3://{BUCKET}/flaky", "--", PYTHON,
                    str(SCRIPT), "--epochs", "5"], cwd=workdir,
                   env={**s3_env(proxy.endpoint), "AWS_MAX_ATTEMPTS": "2"})
    assert down.returncode == 74, down.stderr[-3000:]
    assert "Traceback" not in down.stderr, down.stderr[-3000:]
    errors = [line for line in down.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"s3://{BUCKET}/flaky failed" in errors[0], errors
    assert sorted(p.name for p in (local / "checkpoints").iterdir()) == [
        "ckpt-00000002", "ckpt-00000003"]  # nothing lost locally


@pytest.mark.skipif(shutil.which("dmtcp_launch") is None,
                    reason="DMTCP is not installed (no dmtcp_launch on PATH)")
def test_dmtcp_images_go_through_s3_and_a_new_node_restarts_from_them(workdir: Path, endpoint):
    """The DMTCP engine's images are a checkpoint's files like any other: uploaded by hash,
    committed by the manifest; a fresh local dir (another node) restores from the prefix."""
    from .test_dmtcp import LOOP, loop_reference, steps

    expected = loop_reference(workdir, 200)
    env = s3_env(endpoint)
    argv = [*procckpt_argv(), "run", "--engine", "dmtcp", "--dir", f"s3://{BUCKET}/dmtcp",
            "--time-limit", "8s", "--grace", "3s", "--max-restarts", "0", "--"]
    command = [*LOOP, "--steps", "200", "--ballast-mb", "16", "--out", "out.txt"]
    # One cycle on node A (no restart allowed: it stops after its image), then node B.
    first = run([*argv, *command], cwd=workdir,
                env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / "node-a")})
    saved = manifests(endpoint, "dmtcp")
    assert len(saved) == 1 and list(saved.values())[0]["engine"] == "dmtcp", \
        first.stderr[-3000:]
    images = list(saved.values())[0]["dmtcp"]["images"]
    assert images and all(name in list(saved.values())[0]["objects"] for name in images)
    second = run([*argv[:-3], "--max-restarts", "20", "--", *command], cwd=workdir,
                 env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / "node-b")})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "fetched from s3://" in second.stderr, second.stderr[-3000:]
    done = steps(first.stdout) + steps(second.stdout)
    assert done == list(range(1, 201)), done  # node B went on from node A's image
    assert (workdir / "out.txt").read_text().split()[:2] == expected


def test_two_runs_on_one_prefix_never_replace_each_others_checkpoints(workdir: Path, endpoint,
                                                                      monkeypatch):
    """The manifest put is conditional (If-None-Match: *): the second run's checkpoint of the
    same name is refused, with what to do, and the first one's stays."""
    import torch

    from procckpt.errors import StorageError
    from procckpt.store import CheckpointStore
    from procckpt.training.save.writer import write_checkpoint

    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    url = f"s3://{BUCKET}/shared"
    first = CheckpointStore(workdir / "a", remote=url).open()
    write_checkpoint(first, {"step": 1}, {"w": torch.ones(4)})
    second = CheckpointStore(workdir / "b", remote=url).open()
    with pytest.raises(StorageError, match="has a checkpoint ckpt-00000001 already: another run "
                                           "writes there; give each run its own prefix"):
        write_checkpoint(second, {"step": 7}, {"w": torch.zeros(4)})
    assert manifests(endpoint, "shared")["ckpt-00000001"]["step"] == 1
    assert (workdir / "b" / "checkpoints" / "ckpt-00000001").is_dir()  # kept locally


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_a_frameworks_checkpoint_from_s3_resumes_on_another_node_bit_identical(
        workdir: Path, endpoint, framework: str):
    """A framework's checkpoint goes through the prefix like the rest: Lightning (with a
    frozen encoder, stored once as a chunk) or the HF Trainer (its own files adopted into
    procckpt's checkpoint) is stopped on node A once a periodic checkpoint reached the prefix;
    the script alone on node B, with an empty local dir: its callback fetches the checkpoint
    before the framework starts, which resumes from it to the weights of an uninterrupted run."""
    needs(framework)
    script = command(framework, *(["--frozen-base"] if framework == "lightning" else []))
    expected = workdir / "reference.pt"
    ref = run([*script, "--out", str(expected)], cwd=workdir,
              env={"PROCCKPT_DIR": str(workdir / "ref-ckpt")}, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    url = f"s3://{BUCKET}/{framework}"
    # Node A: stopped (checkpoint, then stop: as a time limit would) once one reached S3.
    first = stopped_once(["--dir", url, "--interval", "2s", "--", *script, "--step-sleep",
                          "0.3"], workdir, lambda: bool(manifests(endpoint, framework)),
                         env={**s3_env(endpoint), "PROCCKPT_LOCAL_DIR": str(workdir / "node-a")})
    assert first.returncode == 75, first.stderr[-3000:]
    if framework == "transformers":  # the Trainer's own files, in the prefix's checkpoints
        for manifest in manifests(endpoint, framework).values():
            assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= \
                manifest["files"].keys(), manifest["files"]
    out = workdir / "out.pt"
    second = run([*script, "--out", str(out)], cwd=workdir, timeout=600,
                 env={**s3_env(endpoint), "PROCCKPT_DIR": url,
                      "PROCCKPT_LOCAL_DIR": str(workdir / "node-b")})
    assert second.returncode == 0, second.stderr[-3000:]
    # Fetched into node B's local dir before the framework was told where to resume from.
    assert "resume_from " + str(workdir / "node-b") in second.stdout, second.stdout[-2000:]
    assert f"fetched from {url}" in second.stderr, second.stderr[-3000:]
    assert_bit_identical(expected, out)


def test_a_server_that_is_not_there_ends_the_run_in_one_line(workdir: Path):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    down = run([*procckpt_argv(), "run", "--dir", f"s3://{BUCKET}/gone", "--", PYTHON,
                str(SCRIPT), "--epochs", "2"], cwd=workdir,
               env={**s3_env(gone), "AWS_MAX_ATTEMPTS": "2"})
    assert down.returncode == 74, down.stderr[-3000:]
    assert "Traceback" not in down.stderr, down.stderr[-3000:]
    errors = [line for line in down.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Could not connect to the endpoint URL" in errors[0], errors


def test_a_bucket_root_with_foreign_keys_under_chunks_is_pruned_around_them(workdir: Path,
                                                                           endpoint,
                                                                           monkeypatch):
    """``--dir s3://BUCKET``: the prefix is the bucket's root, whose chunks/ may hold the
    user's own keys. Pruning after a checkpoint crashed on a key of another shape
    (IndexError) and deleted foreign keys of the usual depth; it now collects only the
    objects procckpt names, stale ones included, and leaves every other key as it was."""
    import torch

    from procckpt.store import CheckpointStore
    from procckpt.training.save.writer import write_checkpoint

    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    root = "procckpt-root"
    bucket(endpoint, root)
    s3 = client(endpoint)
    stale = "chunks/blake2b/ab/ab" + "0" * 62  # procckpt's shape, listed by no manifest
    foreign = ["chunks/README.txt", "chunks/blake3/00/notes", "chunks/mine/ab/ab12",
               "chunks/blake2b/cd/ab" + "1" * 62, "data/train.jsonl"]
    for key in (stale, *foreign):
        s3.put_object(Bucket=root, Key=key, Body=b"the user's")
    store = CheckpointStore(workdir / "local", keep=1, remote=f"s3://{root}").open()
    for step in (1, 2, 3):
        write_checkpoint(store, {"step": step}, {"w": torch.full((4,), float(step))})
        store.prune()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=root)
    left = {o["Key"] for page in pages for o in page.get("Contents", [])}
    assert set(foreign) <= left, sorted(left)
    assert stale not in left, sorted(left)
    assert [k for k in left if k.endswith("MANIFEST.json")] == \
        ["checkpoints/ckpt-00000003/MANIFEST.json"], sorted(left)
    for key in foreign:
        assert s3.get_object(Bucket=root, Key=key)["Body"].read() == b"the user's"


def test_of_two_launchers_on_a_prefix_the_second_stops_before_it_trains(workdir: Path,
                                                                         endpoint):
    """Two launchers on one prefix (a job submitted twice, on other nodes: two local dirs).
    The first holds the prefix's lease and beats it; the second sees it beaten, stops with 2
    and one line before it trains or writes, and the first ends its run undisturbed. (Before
    the lease, which of the two stopped was a race at their first clashing commit.)"""
    argv = [*procckpt_argv(), "run", "--dir", f"s3://{BUCKET}/twice", "--interval", "1s",
            "--engine", "hooks", "--", PYTHON, str(SCRIPT), "--epochs", "30",
            "--step-sleep", "0.1"]  # 480 steps: 48 s and more
    env = {**os.environ, **s3_env(endpoint), "PYTHONUNBUFFERED": "1"}
    procs = []
    for node in ("a", "b"):
        (workdir / node).mkdir()
        procs.append(subprocess.Popen(argv, cwd=workdir / node, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 120
        while node == "a" and len(manifests(endpoint, "twice")) < 2:
            assert procs[0].poll() is None and time.monotonic() < deadline, "no checkpoints"
            time.sleep(0.2)
    try:
        (_, second), (_, first) = procs[1].communicate(timeout=120), procs[0].communicate(
            timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, first[-3000:]
    assert procs[1].returncode == 2, second[-3000:]
    last = second.strip().splitlines()[-1]
    assert f"s3://{BUCKET}/twice/LEASE is held by a live run (pid {procs[0].pid} on " in last \
        and "give this run its own prefix" in last, second[-3000:]
    assert "Traceback" not in second and "resumed" not in second, second[-3000:]
    assert not list((workdir / "b").rglob("ckpt-*"))  # b wrote nothing
    assert "another run writes there" not in first, first[-3000:]
    assert any(k.endswith("/COMPLETE") for k in keys(endpoint, "twice"))
    assert not any(k.endswith("/LEASE") for k in keys(endpoint, "twice"))  # released


def test_status_of_a_prefix_reads_the_prefix_from_any_machine(workdir: Path, endpoint,
                                                              monkeypatch):
    """`procckpt status s3://...` where the run's local dir is not (another machine, a login
    node) said the dir does not exist; it shows the prefix's checkpoints. Where the local dir
    is, a checkpoint the prefix lacks (its upload was killed) is named."""
    import torch

    from procckpt.store import CheckpointStore
    from procckpt.training.save.writer import write_checkpoint

    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    url = f"s3://{BUCKET}/seen"
    node = workdir / "node"
    store = CheckpointStore(node / "procckpt-local" / BUCKET / "seen", keep=3,
                            remote=url).open()
    for step in (5, 9):
        write_checkpoint(store, {"step": step, "epoch": 1, "reason": "interval"},
                         {"w": torch.full((4,), float(step))})
    elsewhere = workdir / "login-node"
    elsewhere.mkdir()
    shown = run([*procckpt_argv(), "status", url], cwd=elsewhere, env=s3_env(endpoint))
    assert shown.returncode == 0, shown.stderr
    assert f"checkpoint dir: {url} (no local dir here: what the prefix holds)" in shown.stdout
    assert "state:          not finished" in shown.stdout, shown.stdout
    rows = [line.split() for line in shown.stdout.splitlines() if line.startswith("ckpt-")]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("ckpt-00000002", "9", "interval"),
                                                   ("ckpt-00000001", "5", "interval")], rows
    as_json = run([*procckpt_argv(), "status", "--json", url], cwd=elsewhere,
                  env=s3_env(endpoint))
    assert [c["step"] for c in json.loads(as_json.stdout)["checkpoints"]] == [9, 5]
    assert not list(elsewhere.iterdir())  # nothing made there
    client(endpoint).delete_object(Bucket=BUCKET, Key="seen/checkpoints/ckpt-00000002/"
                                                      "MANIFEST.json")  # its upload killed
    here = run([*procckpt_argv(), "status", url], cwd=node, env=s3_env(endpoint))
    assert f"remote:         {url}: ckpt-00000001; here only: ckpt-00000002" in here.stdout, \
        here.stdout


def test_a_new_node_refuses_to_start_from_scratch_when_every_remote_checkpoint_is_damaged(
        workdir: Path, endpoint):
    """One flipped byte in each committed checkpoint's state: a fresh node set both aside and
    then started the training from the beginning, exit 0, the run's progress dropped. As
    locally, it now refuses in one line with the corruption's own exit code, and a second
    try (the damaged ones already set aside) refuses too."""
    env = {**s3_env(endpoint), "PROCCKPT_DIR": f"s3://{BUCKET}/flipped"}
    first = run([PYTHON, str(SCRIPT), "--epochs", "3"], cwd=workdir,
                env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / "node-a")})
    assert first.returncode == 0, first.stderr[-3000:]
    s3 = client(endpoint)
    for name, manifest in manifests(endpoint, "flipped").items():
        algo, hexdigest = manifest["objects"]["state.pt"].split(":")
        key = f"flipped/chunks/{algo}/{hexdigest[:2]}/{hexdigest}"
        body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        body[len(body) // 2] ^= 0x01
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    s3.delete_object(Bucket=BUCKET, Key="flipped/COMPLETE")
    for node in ("node-b", "node-c"):
        again = run([*procckpt_argv(), "run", "--", PYTHON, str(SCRIPT), "--epochs", "4"],
                    cwd=workdir, env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / node)})
        assert again.returncode == 65, again.stderr[-3000:]
        assert "refusing to start from scratch" in again.stderr, again.stderr[-3000:]
        assert "start step 0" not in again.stdout, again.stdout[-2000:]
        assert "Traceback" not in again.stderr, again.stderr[-3000:]
    assert sorted(manifests(endpoint, "flipped")) == ["ckpt-00000002.corrupt",
                                                      "ckpt-00000003.corrupt"]


def test_a_final_checkpoint_whose_upload_was_cut_off_is_published_by_the_next_launch(
        workdir: Path, endpoint):
    """The run committed its last checkpoint here and was killed (SIGKILL, the whole tree)
    while uploading it: the prefix holds the ones before, no COMPLETE. The rerun on the same
    node resumed from the local one, said the training finished and wrote a COMPLETE naming a
    checkpoint the prefix lacked; nothing ever uploaded it, so a node that lost its disk lost
    the final state. The next launch now publishes it first; a new node then finds the run
    finished there."""
    local = workdir / "node-a"
    env = {**os.environ, **s3_env(endpoint), "PROCCKPT_LOCAL_DIR": str(local)}
    argv = [*procckpt_argv(), "run", "--dir", f"s3://{BUCKET}/cut", "--keep", "3", "--",
            PYTHON, str(SCRIPT), "--epochs", "3"]
    log = workdir / "first.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                env={**env, "PROCCKPT_S3_UPLOAD_PAUSE": "0.5"},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180

        def final_upload_in_flight() -> bool:
            committed = {p.name for p in (local / "checkpoints").glob("ckpt-*")}
            return "epoch 2 loss" in log.read_text() and bool(
                committed - set(manifests(endpoint, "cut"))) and bool(dangling(endpoint, "cut"))

        while not final_upload_in_flight():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    last = max(p.name for p in (local / "checkpoints").glob("ckpt-*"))
    assert last not in manifests(endpoint, "cut") and not (local / "COMPLETE").exists()
    assert not any(k.endswith("/COMPLETE") for k in keys(endpoint, "cut"))

    again = run(argv, cwd=workdir, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{last} was committed here but not in s3://{BUCKET}/cut (its upload was cut " \
           "off): publishing it" in again.stderr, again.stderr[-3000:]
    assert last in manifests(endpoint, "cut")
    s3 = client(endpoint)
    record = json.loads(s3.get_object(Bucket=BUCKET, Key="cut/COMPLETE")["Body"].read())
    assert record.get("checkpoint") in manifests(endpoint, "cut"), record
    elsewhere = run(argv, cwd=workdir, env={**env, "PROCCKPT_LOCAL_DIR": str(workdir / "b")})
    assert elsewhere.returncode == 0 and "already finished" in elsewhere.stderr, \
        elsewhere.stderr[-3000:]


def test_a_corrupt_shared_chunk_is_refused_on_a_new_node_and_repaired_by_a_good_copy(
        workdir: Path, endpoint):
    """One flipped byte in the frozen base's object, which every checkpoint lists. A new node
    refuses (65) and moves the object out of chunks/; it was never replaced before (an upload
    skips an object of the right size), so every later checkpoint listed it. The node that
    has a good copy trains on and publishes again: the object goes back, whole, and a third
    node resumes from the prefix and ends bit-identical."""
    base = {**s3_env(endpoint)}
    argv = [*procckpt_argv(), "run", "--dir", f"s3://{BUCKET}/shared-chunk", "--keep", "2",
            "--", PYTHON, str(SCRIPT)]
    node_a = {**base, "PROCCKPT_LOCAL_DIR": str(workdir / "node-a")}
    first = run([*argv, "--epochs", "3"], cwd=workdir, env=node_a)
    assert first.returncode == 0, first.stderr[-3000:]
    chunk_ids = set.intersection(*(set(m.get("chunks") or {})
                                   for m in manifests(endpoint, "shared-chunk").values()))
    assert chunk_ids, "the frozen base is in no chunk every checkpoint lists"
    s3 = client(endpoint)
    algo, hexdigest = sorted(chunk_ids)[0].split(":")
    key = f"shared-chunk/chunks/{algo}/{hexdigest[:2]}/{hexdigest}"
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0x10
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    s3.delete_object(Bucket=BUCKET, Key="shared-chunk/COMPLETE")  # train on: one more epoch
    (workdir / "node-a" / "COMPLETE").unlink()

    refused = run([*argv, "--epochs", "4"], cwd=workdir,
                  env={**base, "PROCCKPT_LOCAL_DIR": str(workdir / "node-b")})
    assert refused.returncode == 65, refused.stderr[-3000:]
    assert f"moved to s3://{BUCKET}/shared-chunk/corrupt/{algo}/{hexdigest}" in refused.stderr
    assert key not in keys(endpoint, "shared-chunk")

    out = workdir / "out.pt"
    repaired = run([*argv, "--epochs", "4", "--out", str(out)], cwd=workdir, env=node_a)
    assert repaired.returncode == 0, repaired.stderr[-3000:]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() != bytes(body)
    third = workdir / "out-c.pt"  # a new node: the final checkpoint, from the prefix alone
    fetched = run([PYTHON, str(SCRIPT), "--epochs", "4", "--out", str(third)], cwd=workdir,
                  env={**base, "PROCCKPT_DIR": f"s3://{BUCKET}/shared-chunk",
                       "PROCCKPT_LOCAL_DIR": str(workdir / "node-c")})
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    assert "fetched from" in fetched.stderr and "set aside" not in fetched.stderr, \
        fetched.stderr[-3000:]
    assert_bit_identical(out, third)


def test_an_upload_replaces_an_object_whose_bytes_changed_at_the_same_size(workdir: Path,
                                                                          endpoint):
    """A byte flipped in the frozen base's object, in place: no node has downloaded it yet.
    An upload skipped an object of the right size, so every later checkpoint listed the
    damaged one. The next publish compares the object's ETag with the local bytes' and
    uploads them again."""
    argv = [*procckpt_argv(), "run", "--dir", f"s3://{BUCKET}/flip-in-place", "--", PYTHON,
            str(SCRIPT)]
    env = {**s3_env(endpoint), "PROCCKPT_LOCAL_DIR": str(workdir / "node-a")}
    first = run([*argv, "--epochs", "2"], cwd=workdir, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    chunk_id = sorted(set.intersection(*(set(m.get("chunks") or {}) for m in
                                         manifests(endpoint, "flip-in-place").values())))[0]
    algo, hexdigest = chunk_id.split(":")
    key = f"flip-in-place/chunks/{algo}/{hexdigest[:2]}/{hexdigest}"
    s3 = client(endpoint)
    good = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[7] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(bad))
    s3.delete_object(Bucket=BUCKET, Key="flip-in-place/COMPLETE")
    (workdir / "node-a" / "COMPLETE").unlink()
    again = run([*argv, "--epochs", "3"], cwd=workdir, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"s3://{BUCKET}/{key} is not the bytes of {chunk_id} (its ETag differs): " \
           "uploading them again" in again.stderr, again.stderr[-3000:]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == good
