"""An S3-compatible server for the tests: moto's server mode on loopback, and a proxy in front
of it that can answer 503 to some or all requests (a server under load, one that is down)."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["moto_server", "FlakyProxy", "s3_env", "free_port", "bucket"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_env(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the test server through the standard AWS variables."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "procckpt-test",
            "AWS_SECRET_ACCESS_KEY": "procckpt-test", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_MAX_ATTEMPTS": "4"}


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on a free loopback port, for the block; yields its endpoint URL."""
    port = free_port()
    # Its log goes to a file: moto logs every request, and a pipe nobody reads would fill
    # and stop the server in the middle of a test.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError("moto's server did not start: "
                                       + log.read().decode()[-2000:]) from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


class FlakyProxy:
    """A loopback HTTP proxy to ``upstream`` that answers 503 to every ``fail_every``-th
    request (0: never), or to all of them while :attr:`down` is set."""

    def __init__(self, upstream: str, fail_every: int = 0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.fail_every = fail_every
        self.down = False
        self.requests = 0
        self.refused = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.requests += 1
                    refuse = proxy.down or (proxy.fail_every > 0
                                            and proxy.requests % proxy.fail_every == 0)
                    proxy.refused += refuse
                if refuse:
                    message = b"<Error><Code>ServiceUnavailable</Code></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(message)))
                    self.end_headers()
                    self.wfile.write(message)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

        class QuietServer(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that hung up (a killed process, a retry): not the test's news

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def bucket(endpoint: str, name: str) -> None:
    """Make bucket ``name`` on the server at ``endpoint``."""
    import boto3

    env = s3_env(endpoint)
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                 region_name=env["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)

