"""The DMTCP engine: checkpoints of an unmodified command, taken as whole process images.

Each cycle gets a coordinator of its own, started here on a free port, so a run never joins a
foreign or stale one and two runs on a node never meet::

    cycle 1      dmtcp_coordinator --coord-port 0 --port-file DIR/dmtcp/coord-port
                 dmtcp_launch  --join-coordinator --coord-port P ... -- CMD
    cycle n      dmtcp_restart --join-coordinator --coord-port P ... ckpt-N/*.dmtcp
    request      dmtcp_command --coord-port P --bcheckpoint  (--kcheckpoint for "stop"),
                 from a thread, so that the supervisor's loop keeps running meanwhile

DMTCP writes its images into ``DIR/dmtcp/images/`` (its ``--ckptdir``); once they are complete
they are renamed into a store checkpoint (``ckpt-N/``, MANIFEST with sizes and CRC-32, fsync,
rename), the same guarantees as the hooks engine's ``state.pt``. The facts about DMTCP 4.2
that shaped this module (completion read from the files, checksums before a restart, the
restore watchdog, saved files) are measured in docs/dmtcp.md.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ....durations import parse_duration
from ....protocol.events import append_event
from ....store import CheckpointInfo, CheckpointStore
from .. import Confirmation, Engine
from ..images import fault_after_restore, newest_image
from .coordinator import Coordinator
from .cycle import Cycle, Job
from .forks import STALL_S, CopyWatch, StuckImages, fork_safe_env, own_processes
from .images import ImageDir, restore_saved_files
from .tools import DmtcpError, DmtcpTools

__all__ = ["DmtcpEngine", "CKPT_SIGNAL"]

logger = logging.getLogger(__name__)

#: DMTCP's internal checkpoint signal, moved off its default SIGUSR2 (procckpt's "snapshot"
#: signal) and off SIGUSR1 (NCCL's): a real-time signal nothing else here uses.
CKPT_SIGNAL = signal.SIGRTMIN + 6
#: How often the checkpoint thread looks for the finished images.
POLL = 0.05
#: How long a restore may take to reach the running state: a base plus time to read the image.
RESTORE_BASE_S = 60.0
RESTORE_BYTES_PER_S = 20e6
#: After the command exited, how long to still wait for the coordinator's restart script.
AFTER_EXIT_WAIT_S = 10.0
ENV_GZIP = "PROCCKPT_DMTCP_GZIP"
#: Overrides the restore time limit (a duration: 90s, 10m) for slow filesystems.
ENV_RESTORE_TIMEOUT = "PROCCKPT_DMTCP_RESTORE_TIMEOUT"
#: A restored command is imaged no sooner than this after DMTCP's running state. (The bad image
#: above was asked for while the restore ran and taken the moment it ran: a precaution, since
#: what in that moment made it bad is not known.)
SETTLE_AFTER_RESTORE_S = 2.0


class DmtcpEngine(Engine):
    """Snapshots by DMTCP; see the module docstring.

    Args:
        store: the run's checkpoint store (images go into its checkpoints).
        tools: the DMTCP installation (:func:`find_dmtcp`).
        gzip: compress images (several times slower; default from $PROCCKPT_DMTCP_GZIP).
        run: a seam for unit tests, ``subprocess.run``'s signature.
    """

    name = "dmtcp"

    def __init__(self, store: CheckpointStore, tools: DmtcpTools, *, gzip: bool | None = None,
                 environ: Mapping[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> None:
        environ = os.environ if environ is None else environ
        self.store = store
        self.tools = tools
        self.gzip = gzip if gzip is not None else environ.get(ENV_GZIP, "") in ("1", "true", "yes")
        limit = environ.get(ENV_RESTORE_TIMEOUT)
        self.restore_timeout = (parse_duration(limit, what=ENV_RESTORE_TIMEOUT) if limit
                                else None)
        self.work = store.root / "dmtcp"
        self.images = self.work / "images"
        self.port_file = self.work / "coord-port"
        self.image_dir = ImageDir(self.images)
        self._run = run
        self._version: str | None = None
        self._command: list[str] = []
        self._cycle: Cycle | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._job: Job | None = None
        self._confirmed: Confirmation | None = None
        self._failed_images: set[str] = set()
        self._warned_processes = False
        self._monitor: threading.Thread | None = None
        self.stuck_images = StuckImages(store.events_path)
        self.copies = CopyWatch()

    @property
    def stuck(self) -> str | None:
        """Why no image of this command will complete (a failure that repeats), once seen."""
        return self.stuck_images.message

    # -- the Engine interface -------------------------------------------------------------
    def start_cycle(self, argv: list[str], token: str) -> tuple[list[str], dict[str, str]]:
        if self._version is None:
            self._version = self.tools.version()
        self._command = list(argv)
        self._confirmed = None
        self._job = None
        self._reset_work_dir()
        image = self._newest_image()
        if image is not None:
            restore_saved_files(image, self.images)
        coordinator = Coordinator.start(self.tools, self.work, self.images, self.port_file,
                                        self._run)
        port = coordinator.port
        self._cycle = Cycle(token, coordinator, image)
        # -q -q: DMTCP's notes and warnings (running as root; "failed to restore this process
        # as session leader", which is harmless under procckpt) would fill the command's stderr
        # on every restart; its errors are still printed.
        common = ["--join-coordinator", "--coord-host", "127.0.0.1", "--coord-port", str(port),
                  "--ckptdir", str(self.images), "-q", "-q"]
        if image is None:
            logger.info("dmtcp: launching the command under DMTCP (coordinator port %d)", port)
            out = [self.tools.launch, *common, "--gzip" if self.gzip else "--no-gzip",
                   "--ckpt-signal", str(int(CKPT_SIGNAL)), *argv]
        else:
            images = [str(image.file(n)) for n in image.manifest["dmtcp"]["images"]]
            taken_from = image.manifest.get("command")
            if taken_from and taken_from != list(argv):
                logger.warning("dmtcp: %s is an image of `%s`; it is restarted as it is (the "
                               "command given now, `%s`, is not run). Use a new --dir to start "
                               "the new command", image.name, " ".join(taken_from), " ".join(argv))
            logger.info("dmtcp: restarting from %s (%s, written %s)", image.name,
                        _megabytes(image.nbytes), time.strftime(
                            "%H:%M:%S", time.localtime(image.created)))
            append_event(self.store.events_path, "resume", checkpoint=image.name,
                         engine=self.name, bytes=image.nbytes)
            out = [self.tools.restart, *common, *images]
        self._monitor = threading.Thread(target=self._watch_state, args=(self._cycle,),
                                         name="procckpt-dmtcp-monitor", daemon=True)
        self._monitor.start()
        return out, fork_safe_env(os.environ)

    def child_started(self, pid: int) -> None:
        """The supervisor started this cycle's command as ``pid`` (its own process group)."""
        if self._cycle is not None:
            self._cycle.pid = pid

    def request(self, action: str, reason: str) -> int:
        stop = action == "stop"
        with self._lock:
            self._seq += 1
            seq = self._seq
            job = self._job
            if job is not None and not job.answered:
                # One checkpoint at a time. A stop must be served by an image the process
                # stopped at (else the steps run after a running image would run again after
                # the restart): it follows the one in flight. Anything else shares it.
                if stop and not job.stop:
                    if job.then_stop is None:
                        job.then_stop = Job(seq, reason, True, thread=job.thread)
                    return job.then_stop.seq
                return job.seq
            job = Job(seq, reason, stop)
            job.thread = threading.Thread(target=self._serve, args=(job,),
                                          name="procckpt-dmtcp-checkpoint", daemon=True)
            self._job = job
        job.thread.start()
        return seq

    def confirmation(self, seq: int) -> Confirmation | None:
        with self._lock:
            c = self._confirmed
        if c is None or not (c.seq >= seq or c.stopping):
            return None
        return c

    def writing(self, seq: int) -> bool:
        # Bytes of the image that serves ``seq`` (or of the one it follows) have appeared, or
        # the finished images are being moved into the store. The write is bounded by the
        # checkpoint thread: an image that stops growing for STALL_S ends the cycle.
        with self._lock:
            job = self._job
            if job is None or job.answered:
                return False
            serves = job.seq == seq or (job.then_stop is not None and job.then_stop.seq == seq)
            return serves and (job.wrote or job.committing)

    def connected(self) -> bool:
        return self._cycle is not None and self._cycle.running.is_set()

    def end_cycle(self) -> Confirmation | None:
        cycle = self._cycle
        if cycle is None:
            return None
        cycle.over_at = time.monotonic()
        cycle.over.set()
        job = self._job
        if job is not None and job.thread is not None:
            # The images of a --kcheckpoint are complete when the command exits; what is left
            # is moving them into the store, which the next cycle must not race with. A
            # thread still waiting for images gives up AFTER_EXIT_WAIT_S after the exit; one
            # stuck in dmtcp_command is freed by stopping the coordinator.
            limit = cycle.over_at + AFTER_EXIT_WAIT_S + 5
            while job.thread.is_alive() and (job.committing or time.monotonic() < limit):
                job.thread.join(timeout=0.2)
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        cycle.coordinator.stop()
        if job is not None and job.thread is not None:
            job.thread.join(timeout=30)
        with self._lock:
            c = self._confirmed
        confirmed = c if c is not None and c.stopping and c.checkpoint is not None else None
        if job is not None and job.stop:
            self.stuck_images.stop_ended(confirmed is not None, job.wrote, job.sent_at,
                                         cycle.over_at, cycle.coordinator.peers, job.unusable)
        return confirmed

    def after_exit(self, exit_code: int, requested: bool, signalled: bool = False) -> str | None:
        """Called once the cycle ended (after :meth:`end_cycle`).

        Returns a message when the next cycle should run differently because this one failed
        to restore (it then restarts from the previous image); None otherwise. A command that
        exited 0 by itself finished: the run is marked complete. So does one that exited 0
        while a stop was asked for but before DMTCP wrote a byte of its image: DMTCP ends a
        command after the stop's image with exit code 0 too, but only once the image is written.
        """
        cycle = self._cycle
        if cycle is None:
            return None
        if exit_code == 0 and not signalled and not self._stopped_after_image():
            if requested:
                logger.info("dmtcp: the command finished by itself before the stop's image "
                            "was taken")
            self.store.mark_complete(token=cycle.token, engine=self.name)
            return None
        if requested:
            return None
        image = cycle.restored_from
        if image is None:
            return None  # a crash of the command itself: the supervisor's rules apply
        if cycle.running.is_set() and cycle.restore_failed is None:
            why = self._fault_after_restore(cycle, exit_code, signalled)
            if why is None:
                return None  # the command's own exit or crash: the supervisor's rules apply
        else:
            why = cycle.restore_failed or f"dmtcp_restart exited with {exit_code}"
        self._failed_images.add(image.name)
        append_event(self.store.events_path, "restore-failed", checkpoint=image.name,
                     exit_code=exit_code, problem=why)
        older = self._newest_image(quiet=True)
        if older is None:
            logger.error("dmtcp: restarting from %s failed (%s) and no older image is left; "
                         "the images stay in %s (see DIR/dmtcp/coordinator.log)", image.name,
                         why, self.store.ckpt_root)
            return None
        return (f"restarting from {image.name} failed ({why}); falling back to the previous "
                f"image, {older.name}")

    def _fault_after_restore(self, cycle: Cycle, exit_code: int, signalled: bool) -> str | None:
        """Why the image the cycle restored is taken for a failed restore although DMTCP
        brought it to its running state: a fault ended the command soon after it, before
        DMTCP began an image of its own (images.py, ``fault_after_restore``). None for any
        other end."""
        ran_for = cycle.over_at - cycle.running_at
        fault = fault_after_restore(exit_code, signalled, ran_for)
        job = self._job
        if fault is None or (job is not None and (job.wrote or job.committing)):
            return None
        return (f"the restored command was killed by {fault} {ran_for:.0f}s after DMTCP's "
                "running state, before any image of its own")

    def _stopped_after_image(self) -> bool:
        """Whether DMTCP may have ended the command after a stop's image (--kcheckpoint):
        a byte of it was seen, or it was complete (a committed one was first so)."""
        job = self._job
        return job is not None and job.stop and (job.wrote or job.committing)

    # -- images ---------------------------------------------------------------------------
    def _newest_image(self, quiet: bool = False) -> CheckpointInfo | None:
        """The newest checkpoint holding intact DMTCP images that has not failed to restore.

        Checksums are verified first: a truncated image would make mtcp_restart spin forever.
        """
        return newest_image(self.store, self.name, "DMTCP", self._failed_images, DmtcpError,
                            quiet)

    def _reset_work_dir(self) -> None:
        """An empty image dir and no port file from an earlier cycle."""
        self.work.mkdir(exist_ok=True)
        self.image_dir.reset()
        try:
            self.port_file.unlink()
        except FileNotFoundError:
            pass

    # -- the command's state ---------------------------------------------------------------
    def _watch_state(self, cycle: Cycle) -> None:
        """Until the command runs under DMTCP: note when it does (then look for copies of it
        while it runs), and kill a restore that does not get there in time."""
        started = time.monotonic()
        limit = None
        if cycle.restored_from is not None:
            limit = self.restore_timeout or (RESTORE_BASE_S + cycle.restored_from.nbytes
                                             / RESTORE_BYTES_PER_S)
        while not cycle.over.is_set():
            state = cycle.coordinator.status()
            if state is not None and state[0] >= 1 and state[1]:
                cycle.running_at = time.monotonic()
                cycle.running.set()
                if cycle.pid:
                    self.copies.watch(cycle.pid, cycle.restored_from is not None, cycle.over,
                                      self.stuck_images)
                return
            if limit is not None and time.monotonic() - started > limit and cycle.pid:
                cycle.restore_failed = f"the restore did not finish within {limit:.0f}s"
                logger.error("dmtcp: %s; killing it", cycle.restore_failed)
                cycle.kill()
                return
            cycle.over.wait(0.5)

    # -- checkpoints ----------------------------------------------------------------------
    def _serve(self, job: Job) -> None:
        """Serve ``job``, then the stop that arrived while it was in flight, if any."""
        follow: Job | None = job
        while follow is not None:
            job = follow
            c = self._checkpoint(job)
            with self._lock:  # with the answer: a later request() sees it, or is followed
                self._confirmed = c
                job.answered = True
                follow = job.then_stop
                if follow is not None:
                    self._job = follow
            if c.checkpoint is not None:
                try:
                    self.store.prune()
                except OSError as e:
                    logger.warning("dmtcp: could not delete old images: %s", e)
            if follow is not None:
                logger.info("dmtcp: the stop came while a running image was being taken; "
                            "taking one to stop at")

    def _checkpoint(self, job: Job) -> Confirmation:
        """Take and commit one checkpoint; its confirmation (with the error if it failed)."""
        cycle = self._cycle
        assert cycle is not None
        started = time.monotonic()
        if self.copies.seen is not None:  # no image of it is kept: none taken, it runs on
            return Confirmation(None, None, False, job.seq, "it runs forked copies of itself")
        try:
            with self.copies.checkpointing():
                written = self._take_images(cycle, job)
            if written is None:
                return Confirmation(None, None, job.stop, job.seq, "DMTCP wrote no complete image")
            names, write_seconds = written
            refused = self.stuck_images.refuse(names, job.processes)
            if refused is not None:
                job.unusable = True
                self.image_dir.reset()
                return Confirmation(None, None, job.stop, job.seq, refused)
            if len(names) > 1 and not self._warned_processes:
                self._warned_processes = True
                logger.warning("dmtcp: the command runs as %d processes (programs it started); "
                               "DMTCP restores them together, but procckpt's tests cover "
                               "one-process commands: check the first resume", len(names))
            self.stuck_images.completed()
            job.committing = True
            info = self._commit(names, job, write_seconds, cycle)
        except Exception as e:  # a failed checkpoint must not kill the supervisor
            logger.error("dmtcp: checkpoint failed: %s", e)
            return Confirmation(None, None, job.stop, job.seq, str(e))
        seconds = time.monotonic() - started
        logger.info("dmtcp: checkpoint %s: %s written in %.1fs, committed in %.1fs (%s)",
                    info.name, _megabytes(info.nbytes), write_seconds, seconds - write_seconds,
                    job.reason)
        append_event(self.store.events_path, "checkpoint", checkpoint=info.name,
                     bytes=info.nbytes, seconds=round(seconds, 3),
                     write_seconds=round(write_seconds, 3), reason=job.reason,
                     engine=self.name)
        return Confirmation(info.name, None, job.stop, job.seq, number=info.seq)

    def _take_images(self, cycle: Cycle, job: Job) -> tuple[list[str], float] | None:
        """Ask DMTCP for a checkpoint and wait until its images are complete.

        Returns the image file names and the seconds the write took, or None when the
        command or the coordinator went away first.
        """
        command = "--kcheckpoint" if job.stop else "--bcheckpoint"
        sent_at: float | None = None
        sends = 0
        next_check = 0.0
        written, grew_at = 0, 0.0
        while True:
            now = time.monotonic()
            if cycle.over.is_set() and now - cycle.over_at > AFTER_EXIT_WAIT_S:
                return None
            script = self.image_dir.finished_script()
            if script is not None and sent_at is not None:
                return self.image_dir.image_names(script), now - sent_at
            if sent_at is not None:  # also once the command is gone: it wrote before
                size = self.image_dir.bytes_written()
                if size != written:
                    written, grew_at = size, now
                    job.wrote = True
                elif not cycle.over.is_set() and now - grew_at > STALL_S:
                    # the command is frozen in DMTCP's checkpoint: end the cycle
                    self.stuck_images.stalled(now - sent_at, cycle.coordinator.peers, job.wrote)
                    job.unusable = True
                    cycle.kill()
                    return None
            if cycle.coordinator.exited:
                script = self.image_dir.finished_script()
                if script is None or sent_at is None:
                    return None
                return self.image_dir.image_names(script), now - sent_at
            settled = cycle.restored_from is None or \
                now - cycle.running_at >= SETTLE_AFTER_RESTORE_S
            if sent_at is None and cycle.running.is_set() and settled \
                    and not cycle.over.is_set():
                if cycle.coordinator.checkpoint(command,
                                                before_send=lambda: self._count(cycle, job)):
                    sends += 1
                    sent_at = next_check = grew_at = time.monotonic()
                    job.sent_at = job.sent_at or sent_at
                    written = self.image_dir.bytes_written()  # what an earlier image left
                    next_check += 5
                    continue
            elif sent_at is not None and now >= next_check and sends < 5:
                next_check = now + 2
                if self._lost(cycle):
                    logger.warning("dmtcp: the checkpoint request was not taken up; asking again")
                    sent_at = None
                    continue
            time.sleep(POLL if sent_at is not None else 0.2)

    @staticmethod
    def _count(cycle: Cycle, job: Job) -> None:
        """Note the command's processes as the request goes out (StuckImages.refuse)."""
        if cycle.pid:
            image = cycle.restored_from
            job.processes = own_processes(
                cycle.pid, len(image.manifest["dmtcp"]["images"]) if image else 0)

    def _lost(self, cycle: Cycle) -> bool:
        """Whether a sent checkpoint request seems not to have started: no image is being
        written, none is finished, and the coordinator reports its processes running."""
        images = self.image_dir
        if images.writing() or images.finished_script() is not None:
            return False
        state = cycle.coordinator.status()
        return (state is not None and state[1] and not images.writing()
                and images.finished_script() is None)

    def _commit(self, names: list[str], job: Job, write_seconds: float,
                cycle: Cycle) -> CheckpointInfo:
        meta: dict[str, Any] = {
            "engine": self.name, "reason": job.reason, "command": self._command,
            "restored_from": cycle.restored_from.name if cycle.restored_from else None,
            "write_seconds": round(write_seconds, 3), "job_id": os.environ.get("SLURM_JOB_ID"),
            "dmtcp": {"version": self._version, "images": names, "saved_files": {},
                      "ckptdir": str(self.images), "gzip": self.gzip},
        }
        return self.image_dir.commit(self.store, names, meta)


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
