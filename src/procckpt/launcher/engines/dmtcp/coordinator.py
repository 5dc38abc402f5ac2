"""One cycle's ``dmtcp_coordinator``: started on a free port, asked by ``dmtcp_command``, stopped.

Each cycle gets a coordinator of its own, so a run never joins a foreign or stale one and two
runs on a node never meet. Every ``dmtcp_command`` call has a time bound and runs without the
user's ``DMTCP_*`` settings, which could send it to another coordinator.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ...child import die_with_parent
from .tools import DmtcpError, DmtcpTools

__all__ = ["Coordinator", "clean_env"]

logger = logging.getLogger(__name__)

_PEERS_RE = re.compile(r"NUM_PEERS=(\d+)")
_RUNNING_RE = re.compile(r"RUNNING=(yes|no)")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]

#: How long a checkpoint request waits for the command to be back to its fewest processes.
#: Measured in a CI run: a request that landed while the script's ``subprocess.run(["true"])``
#: was alive never got an image written (DMTCP 4.2), and the cycle's work since the last
#: image was lost. Such a child lives well under a second; workers that stay are waited for
#: this long, then the request goes as before.
CHILD_WAIT_S = 2.0


class Coordinator:
    """A running ``dmtcp_coordinator`` and the commands sent to it.

    Args:
        run: a seam for unit tests, ``subprocess.run``'s signature (for ``dmtcp_command``).
    """

    def __init__(self, tools: DmtcpTools, proc: subprocess.Popen[bytes], port: int,
                 run: Runner = subprocess.run) -> None:
        self.tools = tools
        self.proc = proc
        self.port = port
        self._run = run
        #: The processes under DMTCP when the last checkpoint was asked for.
        self.peers = 0
        #: The fewest processes seen running under DMTCP in this cycle: the command's own.
        self.fewest: int | None = None

    @classmethod
    def start(cls, tools: DmtcpTools, work: Path, images: Path, port_file: Path,
              run: Runner = subprocess.run) -> Coordinator:
        """Start a coordinator that writes images into ``images``; logs go to ``work``.

        Raises:
            DmtcpError: it did not start, or did not say its port, within 30 s.
        """
        log = open(work / "coordinator.log", "ab")
        try:
            proc = subprocess.Popen(
                [tools.coordinator, "--exit-on-last", "--coord-port", "0", "--port-file",
                 str(port_file), "--ckptdir", str(images), "--interval", "0", "-q"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=clean_env(os.environ),
                # Its own session: the supervisor's signals and clean-up of the command's
                # process group must not take the coordinator along before it has written
                # the restart script that says the images are complete. Like the command, it
                # dies with the launcher (a coordinator without clients would linger 8 h).
                start_new_session=True, preexec_fn=die_with_parent)
        finally:
            log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            port = _read_port(port_file)
            if port is not None:
                return cls(tools, proc, port, run)
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        _stop_process(proc)
        raise DmtcpError(f"dmtcp_coordinator did not start (exit code {proc.returncode}); see "
                         f"{work / 'coordinator.log'}")

    @property
    def exited(self) -> bool:
        return self.proc.poll() is not None

    def command(self, *args: str, timeout: float = 30,
                ) -> subprocess.CompletedProcess[str] | None:
        """Run ``dmtcp_command ARGS`` against this coordinator; None if it could not run."""
        argv = [self.tools.command, "--coord-host", "127.0.0.1", "--coord-port", str(self.port),
                *args]
        try:
            return self._run(argv, capture_output=True, text=True, timeout=timeout,
                             env=clean_env(os.environ))
        except (OSError, subprocess.SubprocessError) as e:
            logger.debug("dmtcp_command %s failed: %s", " ".join(args), e)
            return None

    def status(self) -> tuple[int, bool] | None:
        """(peers, running) as the coordinator reports them; None if it does not answer."""
        done = self.command("--status", timeout=10)
        if done is None or done.returncode != 0:
            return None
        peers, running = _PEERS_RE.search(done.stdout), _RUNNING_RE.search(done.stdout)
        if peers is None or running is None:
            return None
        state = int(peers.group(1)), running.group(1) == "yes"
        if state[1] and state[0] >= 1:
            self.fewest = state[0] if self.fewest is None else min(self.fewest, state[0])
        return state

    def checkpoint(self, command: str, child_wait: float = CHILD_WAIT_S,
                   before_send: Callable[[], object] | None = None) -> bool:
        """Send one checkpoint command; False if the coordinator cannot take it now.

        While the command runs more processes than its fewest (a child that comes and goes),
        the request waits up to ``child_wait`` seconds for them to be gone. ``before_send`` is
        called right before the command goes out.
        """
        state = self.status()
        until = time.monotonic() + child_wait
        while (state is not None and state[1] and self.fewest is not None
               and state[0] > self.fewest and time.monotonic() < until):
            time.sleep(0.05)
            state = self.status()
        if state is None or not state[1] or state[0] < 1:
            return False  # a restore or another checkpoint is still in progress
        self.peers = state[0]
        if before_send is not None:
            before_send()
        done = self.command(command, timeout=3600)
        if done is None:
            return False
        # DMTCP 4.2 answers a --kcheckpoint with status 2 and this sentence even on success.
        return done.returncode == 0 or "checkpointed and killed" in done.stdout

    def stop(self) -> None:
        _stop_process(self.proc)


def clean_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment without DMTCP_* settings: a user's DMTCP_COORD_HOST/PORT or
    DMTCP_CHECKPOINT_INTERVAL must not send our commands to another coordinator."""
    return {k: v for k, v in environ.items() if not k.startswith("DMTCP_")}


def _read_port(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("dmtcp_coordinator (pid %d) survived SIGKILL", proc.pid)
