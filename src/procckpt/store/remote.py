"""Checkpoints in object storage: ``--dir s3://bucket/prefix`` (AWS S3 and compatible servers).

Object storage has no rename, no lock and no appendable file, so a run on it keeps two places:

- **the local dir** (``$PROCCKPT_LOCAL_DIR``, else ``./procckpt-local/BUCKET/PREFIX``): the lock,
  the control channel, the journal, and the checkpoints as the engines write and read them
  (a cache of the remote ones, and where a checkpoint is staged before it is uploaded);
- **the remote prefix**, which holds the committed checkpoints::

      PREFIX/checkpoints/ckpt-00000007/MANIFEST.json   the commit: put last, only if absent
      PREFIX/chunks/blake3/ab/ab12...                   every file and chunk, named by its hash

A checkpoint is published once it is committed locally: each of its files (``state.pt``, a
DMTCP image, a framework's files) and chunks is uploaded, in parallel and in parts for large
ones, unless the prefix holds it already (content addressing: a frozen base is uploaded once);
then its manifest is put with ``If-None-Match: *``, so that it appears whole or not at all and
never replaces another writer's. A kill before that put leaves chunks no manifest lists, which
the next collection removes. Only then is the checkpoint acknowledged. A resume in a local dir
that lacks the newest remote checkpoint (another node) downloads it, checking every object
against its hash, into the local dir first; one that fails is set aside remotely (its manifest
moved to ``ckpt-N.corrupt/``) like a damaged local checkpoint.

Requests are retried by botocore's standard mode (exponential back-off with jitter, on 500, 503,
throttling and connection errors; ``AWS_MAX_ATTEMPTS``, default 8); then the operation ends with
one line naming the URL, and the local checkpoint stays. Credentials and the endpoint come from
the standard AWS chain (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws``, ...).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, StorageError, UsageError
from .chunks import ChunkStore, file_digest, is_chunk_id
from .files import file_crc32, fsync_dir, read_small_file
from .manifest import MANIFEST, CheckpointInfo

__all__ = ["S3Tier", "split_location", "marked_remote", "ENV_LOCAL", "ENV_UPLOAD_PAUSE"]

logger = logging.getLogger(__name__)

#: Where the local dir of a remote checkpoint dir is (default ./procckpt-local/BUCKET/PREFIX).
ENV_LOCAL = "PROCCKPT_LOCAL_DIR"
#: A test seam: seconds to wait after each object is uploaded, before the manifest is put (so
#: that a test can kill a checkpoint's upload in flight).
ENV_UPLOAD_PAUSE = "PROCCKPT_S3_UPLOAD_PAUSE"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MANIFEST_KEY = re.compile(r"/checkpoints/(ckpt-\d{8,})(\.corrupt)?/" + re.escape(MANIFEST) + "$")
_PART = 64 << 20
_PARALLEL = 8


def split_location(spec: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """(the local dir, the remote URL or None) of a checkpoint dir as the user gave it.

    Raises:
        UsageError: an ``s3://`` URL without a valid bucket name.
    """
    text = str(spec).strip()
    if not text.startswith("s3://"):
        return Path(os.path.expanduser(text)), None
    bucket, _, prefix = text[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket) or ".." in prefix.split("/"):
        raise UsageError(f"bad checkpoint dir {text!r}: expected s3://BUCKET/PREFIX with a valid "
                         "bucket name")
    local = os.environ.get(ENV_LOCAL) or Path("procckpt-local", bucket, *prefix.split("/"))
    return Path(local).absolute(), f"s3://{bucket}/{prefix}".rstrip("/")


def marked_remote(marker: Path) -> str | None:
    """The remote URL a checkpoint dir's marker names, or None."""
    try:
        remote = json.loads(read_small_file(marker)).get("remote")
    except (OSError, ValueError, AttributeError):
        return None
    return remote if isinstance(remote, str) else None


class S3Tier:
    """The remote prefix of a checkpoint dir (see the module's docstring)."""

    def __init__(self, url: str) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as e:
            raise StorageError(f"checkpoints in {url} need boto3: pip install 'procckpt[s3]'") \
                from e
        self.url = url
        self.bucket, _, self.prefix = url[len("s3://"):].partition("/")
        attempts = int(os.environ.get("AWS_MAX_ATTEMPTS") or 8)
        self._client = boto3.client("s3", config=Config(
            retries={"mode": "standard", "total_max_attempts": attempts},
            connect_timeout=10, read_timeout=120, max_pool_connections=4 * _PARALLEL))
        self._md5s: dict[tuple[str, int, int, int], tuple[str, str]] = {}
        self._transfer = TransferConfig(multipart_threshold=_PART, multipart_chunksize=_PART,
                                        max_concurrency=4)

    # -- keys -------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _manifest_key(self, name: str) -> str:
        return self._key("checkpoints", name, MANIFEST)

    def _chunk_key(self, chunk_id: str) -> str:
        algo, hexdigest = chunk_id.split(":")
        return self._key("chunks", algo, hexdigest[:2], hexdigest)

    def _chunk_id_of(self, key: str) -> str | None:
        """The chunk a key under ``PREFIX/chunks/`` holds, if the key has the shape procckpt
        gives its objects (``ALGO/HH/HEX``, HH the digest's first two digits); None for any
        other key (a README, the user's own files at a bucket root), which is never deleted."""
        parts = key[len(self._key("chunks")) + 1:].split("/")
        if len(parts) != 3 or parts[2][:2] != parts[1]:
            return None
        chunk_id = f"{parts[0]}:{parts[2]}"
        return chunk_id if is_chunk_id(chunk_id) else None

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """Turn the client's failure (after its retries) into procckpt's one line."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError) as e:
            brief = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StorageError(f"{what} {self.url} failed ({brief}); check the endpoint, the "
                               "credentials and the bucket, then run again: the checkpoints in "
                               "the local dir are intact") from e

    # -- reading ----------------------------------------------------------------------------
    def committed(self) -> list[str]:
        """The names of the checkpoints committed in the prefix, newest first."""
        return self._listed()[0]

    def _listed(self) -> tuple[list[str], list[str]]:
        """One listing of the prefix's manifests: the committed checkpoints (newest first)
        and the set-aside ones (``ckpt-N.corrupt``)."""
        names: list[str] = []
        aside: list[str] = []
        with self._failing("listing"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key("checkpoints") + "/")
            for page in pages:
                for obj in page.get("Contents", []):
                    found = _MANIFEST_KEY.search("/" + obj["Key"])
                    if found:
                        (aside if found.group(2) else names).append(
                            found.group(1) + (found.group(2) or ""))
        return sorted(names, key=lambda n: int(n.split("-")[1]), reverse=True), aside

    def manifest(self, name: str) -> dict[str, Any] | None:
        """The manifest of remote checkpoint ``name``; None if it is not there or unreadable."""
        body = self._get(self._manifest_key(name), "reading a manifest in")
        try:
            manifest = json.loads(body) if body is not None else None
        except ValueError:
            return None
        return manifest if isinstance(manifest, dict) else None

    def _get(self, key: str, what: str) -> bytes | None:
        """The object at ``key``; None if there is none."""
        got = self._get_with_etag(key, what)
        return None if got is None else got[0]

    def _get_with_etag(self, key: str, what: str) -> tuple[bytes, str] | None:
        """The object at ``key`` and its ETag; None if there is none."""
        from botocore.exceptions import ClientError

        try:
            with self._failing(what):
                got = self._client.get_object(Bucket=self.bucket, Key=key)
                return got["Body"].read(), got["ETag"]
        except StorageError as e:
            if isinstance(e.__cause__, ClientError) and \
                    e.__cause__.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise

    def fetch(self, name: str, ckpt_root: Path, chunks: ChunkStore) -> str | None:
        """Download remote checkpoint ``name`` into ``ckpt_root`` (its chunks into
        ``chunks``), every object checked against its hash; None, or why it cannot be used."""
        manifest = self.manifest(name) or {}
        objects = manifest.get("objects")
        if not isinstance(objects, dict) or set(objects) != set(manifest.get("files", {})):
            return "its manifest is missing or malformed"
        tmp = ckpt_root / f".tmp-fetch-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        jobs = [(cid, tmp / file) for file, cid in objects.items()]
        jobs += [(cid, chunks.path(cid)) for cid, n in (manifest.get("chunks") or {}).items()
                 if not chunks.has(cid, int(n))]
        try:
            with ThreadPoolExecutor(_PARALLEL) as pool:
                problems = [p for p in pool.map(self._download, jobs) if p]
            if problems:
                return problems[0]
            if (problem := _files_against(manifest, tmp)) is not None:
                return problem
            local = {k: v for k, v in manifest.items() if k != "objects"}
            (tmp / MANIFEST).write_text(json.dumps(local, indent=1, sort_keys=True))
            fsync_dir(tmp)
            try:
                os.rename(tmp, ckpt_root / name)
            except OSError:
                if not (ckpt_root / name).is_dir():
                    raise
                return None  # another rank on this node fetched it first: the same bytes
            fsync_dir(ckpt_root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return None

    def _download(self, job: tuple[str, Path]) -> str | None:
        from botocore.exceptions import ClientError

        chunk_id, target = job
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
        try:
            with self._failing("downloading from"):
                try:
                    self._client.download_file(self.bucket, self._chunk_key(chunk_id), str(part),
                                               Config=self._transfer)
                except ClientError as e:
                    if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                        return f"object {chunk_id} is missing"
                    raise
            if file_digest(part, chunk_id.split(":")[0]) != chunk_id:
                return f"object {chunk_id} fails its hash (it is corrupt){self._moved(chunk_id)}"
            os.rename(part, target)
            return None
        finally:
            with contextlib.suppress(OSError):
                part.unlink()

    def _moved(self, chunk_id: str) -> str:
        """Move a corrupt object out of ``chunks/`` (to ``corrupt/``, kept for a look): the
        next upload of a checkpoint that lists it, from a node with a good copy, puts it
        back (an upload skips only an object the prefix has); ', moved to KEY' or ''."""
        source, aside = self._chunk_key(chunk_id), self._key("corrupt", *chunk_id.split(":"))
        try:
            with self._failing("setting a corrupt object aside in"):
                self._client.copy_object(Bucket=self.bucket, Key=aside,
                                         CopySource={"Bucket": self.bucket, "Key": source})
                self._delete([source])
        except StorageError as e:
            logger.warning("%s", e)
            return ""
        return f", moved to s3://{self.bucket}/{aside}"

    # -- writing ----------------------------------------------------------------------------
    def publish(self, info: CheckpointInfo, chunks: ChunkStore) -> None:
        """Upload checkpoint ``info`` (committed locally) and commit it in the prefix.

        Raises:
            StorageError: the server could not be reached or refused (after retries), or the
                prefix has a checkpoint of this name already (another run writes there).
        """
        from botocore.exceptions import ClientError

        started = time.monotonic()
        objects = {name: file_digest(info.file(name)) for name in info.manifest["files"]}
        jobs = [(cid, info.file(name)) for name, cid in objects.items()]
        jobs += [(cid, chunks.path(cid)) for cid in info.chunks]
        with ThreadPoolExecutor(_PARALLEL) as pool:
            uploaded = sum(pool.map(self._upload, jobs))
        body = json.dumps({**info.manifest, "objects": objects}, indent=1, sort_keys=True)
        with self._failing("committing a checkpoint to"):
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._manifest_key(info.name),
                                        Body=body.encode(), IfNoneMatch="*")
            except ClientError as e:
                if e.response["Error"]["Code"] != "PreconditionFailed":
                    raise
                raise StorageError(f"{self.url} has a checkpoint {info.name} already: another "
                                   "run writes there; give each run its own prefix") from e
        logger.debug("%s published to %s: %d object(s), %.1f MB uploaded in %.2fs", info.name,
                     self.url, len(jobs), uploaded / 1e6, time.monotonic() - started)

    def publish_missing(self, local: list[CheckpointInfo], chunks: ChunkStore,
                        complete: bytes | None) -> list[str]:
        """Publish the local checkpoints newer than the prefix's newest, oldest first
        (committed here, their upload cut off by a kill), then a local ``COMPLETE`` the prefix
        lacks; the names published. Run by the launcher that holds the dir, before anything
        else: what a resume here trains from must be what a new node would find."""
        names = self.committed()
        newest = max((int(n.split("-")[1]) for n in names), default=0)
        missing = sorted((i for i in local if i.seq > newest), key=lambda i: i.seq)
        for info in missing:
            logger.warning("%s was committed here but not in %s (its upload was cut off): "
                           "publishing it", info.name, self.url)
            self.publish(info, chunks)
        if complete is not None and (missing or not local or local[0].seq >= newest) \
                and self.completion() is None:
            self.mark_complete(complete)
        return [i.name for i in missing]

    def _upload(self, job: tuple[str, Path]) -> int:
        """Upload one object unless the prefix has it; the bytes uploaded."""
        from botocore.exceptions import ClientError

        chunk_id, path = job
        size = os.stat(path).st_size
        key = self._chunk_key(chunk_id)
        with self._failing("uploading to"):
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=key)
                if head["ContentLength"] == size:
                    if self._same_bytes(head.get("ETag"), path):
                        return 0
                    logger.warning("s3://%s/%s is not the bytes of %s (its ETag differs): "
                                   "uploading them again", self.bucket, key, chunk_id)
            except ClientError as e:
                if e.response["Error"]["Code"] not in ("NoSuchKey", "404", "NotFound"):
                    raise
            self._client.upload_file(str(path), self.bucket, key, Config=self._transfer)
        time.sleep(float(os.environ.get(ENV_UPLOAD_PAUSE) or 0))
        return size

    def _same_bytes(self, etag: str | None, path: Path) -> bool:
        """Whether an object's ETag is the one ``path``'s bytes give: their MD5, or for an
        upload in parts the MD5 of the parts' MD5s and the count (S3's, MinIO's, Ceph's). An
        ETag of another form (encryption with KMS) cannot tell: then the size decides. Each
        file is read once a process (the frozen base, listed by every checkpoint)."""
        found = re.fullmatch(r'"?([0-9a-f]{32})(?:-(\d+))?"?', etag or "")
        if found is None:
            return True
        st = os.stat(path)
        known = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if known not in self._md5s:
            whole, parts = hashlib.md5(usedforsecurity=False), []
            with open(path, "rb") as f:
                while block := f.read(_PART):
                    whole.update(block)
                    parts.append(hashlib.md5(block, usedforsecurity=False).digest())
            joined = hashlib.md5(b"".join(parts), usedforsecurity=False).hexdigest()
            self._md5s[known] = (whole.hexdigest(), f"{joined}-{len(parts)}")
        single, multi = self._md5s[known]
        return found.group(0).strip('"') == (multi if found.group(2) else single)

    def fetch_newer(self, newest_local: int, ckpt_root: Path, chunks: ChunkStore) -> None:
        """Download the newest remote checkpoint when it is newer than every local one (the
        local dir is new, or another node wrote since); each that fails is set aside.

        Raises:
            CheckpointCorruptError: no local checkpoint, and the prefix's all fail (or were
                set aside before): starting from scratch would silently drop the run.
        """
        names, aside = self._listed()
        failed = []
        for name in names:
            if int(name.split("-")[1]) <= newest_local:
                return
            problem = self.fetch(name, ckpt_root, chunks)
            if problem is None:
                logger.info("%s fetched from %s", name, self.url)
                return
            self.set_aside(name, problem)
            failed.append(f"{name}: {problem}")
        if newest_local == 0 and (failed or aside):
            what = "; ".join(failed) if failed else f"set aside before: {', '.join(aside)}"
            raise CheckpointCorruptError(
                f"no checkpoint in {self.url} can be used ({what}); refusing to start from "
                "scratch: restore the objects, or give a new prefix to train anew")

    def completion(self) -> dict[str, Any] | None:
        """What ``PREFIX/COMPLETE`` says (the run finished), or None."""
        body = self._get(self._key("COMPLETE"), "reading the completion marker in")
        if body is None:
            return None
        try:
            record = json.loads(body)
        except ValueError:
            record = None
        return record if isinstance(record, dict) else {"time": time.time()}

    def mark_complete(self, record: bytes) -> None:
        with self._failing("writing the completion marker to"):
            self._client.put_object(Bucket=self.bucket, Key=self._key("COMPLETE"), Body=record)

    # -- keep N, set aside, collect ------------------------------------------------------------
    def prune(self, newest: int, also: set[str]) -> None:
        """Uncommit every remote checkpoint but the ``newest`` N and those named in ``also``
        (the local dir's kept ones: the best, say), then remove the objects that no remaining
        manifest (set-aside ones included) lists. Manifests go first, so a crash in between
        leaves objects to collect later, never a manifest without its objects."""
        names, aside = self._listed()
        keep = set(names[:newest]) | also
        doomed = [n for n in names if n not in keep]
        with self._failing("pruning"):
            if doomed:
                self._delete([self._manifest_key(n) for n in doomed])
            listed: set[str] = set()
            for name in [n for n in names if n in keep] + aside:
                manifest = self.manifest(name) or {}
                listed.update((manifest.get("objects") or {}).values())
                listed.update(manifest.get("chunks") or {})
            stale = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key("chunks") + "/")
            for page in pages:
                for obj in page.get("Contents", []):
                    chunk_id = self._chunk_id_of(obj["Key"])
                    if chunk_id is not None and chunk_id not in listed:
                        stale.append(obj["Key"])
            if stale:
                self._delete(stale)

    def set_aside(self, name: str, problem: str) -> None:
        """Move remote checkpoint ``name``'s manifest aside (``ckpt-N.corrupt``)."""
        if name not in self.committed():
            return
        with self._failing("setting a damaged checkpoint aside in"):
            self._client.copy_object(Bucket=self.bucket, Key=self._manifest_key(name + ".corrupt"),
                                     CopySource={"Bucket": self.bucket,
                                                 "Key": self._manifest_key(name)})
            self._delete([self._manifest_key(name)])
        logger.warning("%s/checkpoints/%s set aside: %s", self.url, name, problem)

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            self._client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})


def _files_against(manifest: dict[str, Any], folder: Path) -> str | None:
    """Why the files fetched into ``folder`` do not match what ``manifest`` says of them (their
    sizes and CRC-32s), or None. Each matched its object's hash: a mismatch here is the
    manifest's, not the objects' (a field edited or damaged), and its checkpoint cannot be
    verified when it loads."""
    for name, expect in sorted((manifest.get("files") or {}).items()):
        try:
            crc, size = file_crc32(folder / name)
        except OSError as e:
            return f"its file {name} cannot be read after the fetch ({e.strerror or e})"
        if not isinstance(expect, dict) or expect.get("bytes") != size \
                or expect.get("crc32") != crc:
            return (f"its manifest is damaged: it says {name} has "
                    f"{expect.get('bytes') if isinstance(expect, dict) else '?'} bytes and "
                    f"CRC-32 {expect.get('crc32') if isinstance(expect, dict) else '?'}, but "
                    f"the object that matches its hash has {size} bytes and CRC-32 {crc}")
    return None
