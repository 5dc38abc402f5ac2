"""What asks for a checkpoint at a safe point, and the answer that goes back to the launcher.

A checkpoint is wanted when the launcher asks (``control/request.json``), a signal arrives, the
script calls ``request_checkpoint()``, the interval is up, an epoch ends (``save_every``) or the
metric improved (:meth:`SaveTriggers.report_metric`). Signals only set a flag: the save happens at
the next safe point, never inside
a handler. In a process group these wishes are only this rank's; the group acts on what the
rank agreement reduced them to (``adopt``).
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
import time

from ...protocol import control as ctl
from ...store import CheckpointInfo
from .flags import Flags

__all__ = ["SaveTriggers", "POLL_SECONDS"]

logger = logging.getLogger(__name__)

#: How often a safe point looks at the control directory for a launcher's request.
POLL_SECONDS = 0.2


class SaveTriggers:
    """One rank's reasons to checkpoint, and its channel to the launcher (if launched).

    Args:
        control: the control channel of ``procckpt run``; None when the script runs alone.
        polls_control: whether this rank reads requests (see ``PROCCKPT_POLL_RANKS``).
        answers: whether this rank acknowledges them (rank 0).
    """

    def __init__(self, control: ctl.ControlChannel | None, *, polls_control: bool,
                 answers: bool, interval: float | None, save_every: int | None,
                 save_best: bool, metric_mode: str = "max") -> None:
        self.control = control
        self.polls_control = polls_control
        self.answers = answers
        self.interval = interval
        self.save_every = save_every
        self.save_best = save_best
        self.metric_mode = metric_mode
        self.metric: float | None = None
        self.best_metric: float | None = None
        #: Why the process is to stop after its next checkpoint (a signal, the launcher).
        self.stop_reason: str | None = None
        self.request: ctl.Request | None = None
        self.best_pending = False
        self.last_save = time.monotonic()
        self._next_poll = 0.0
        # An answer the control directory refused (a full disk for a moment), sent again at
        # the next polls: the launcher asks for no periodic checkpoint while one is unanswered.
        self._unsent: ctl.Ack | None = None
        self._sending = threading.Lock()  # answers come from the writer thread too

    def report_metric(self, value: float) -> bool:
        """Note a validation metric; True if it is the best so far (then, with ``save_best``,
        a checkpoint is wanted at the next safe point)."""
        value = float(value)
        self.metric = value
        best = self.best_metric
        better = best is None or (value > best if self.metric_mode == "max" else value < best)
        if better:
            self.best_metric = value
            self.best_pending = self.save_best
        return better

    def install_signal_handlers(self) -> None:
        """SIGTERM asks for a stop at the next safe point, unless the script (or its launcher,
        e.g. torchrun) handles SIGTERM itself."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self.control is not None and \
                signal.getsignal(ctl.STACK_DUMP_SIGNAL) in (signal.SIG_DFL, signal.SIG_IGN):
            # The launcher's hang detection asks for the stacks with this signal; the C-level
            # handler prints them even while Python code is stuck (also in forked workers).
            faulthandler.register(ctl.STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_term(signum: int, frame: object) -> None:
            self.stop_reason = signal.Signals(signum).name  # only record

        signal.signal(signal.SIGTERM, on_term)

    def ask(self, stop: bool, reason: str) -> None:
        """The script asks for a checkpoint at the next safe point (and a stop after it)."""
        if stop:
            self.stop_reason = reason
        else:
            self.request = ctl.Request("", 0, ctl.ACTION_CHECKPOINT, reason, time.time())

    def poll(self, now: float) -> None:
        """Read the launcher's newest request, at most every :data:`POLL_SECONDS`."""
        if self.control is None or not self.polls_control or now < self._next_poll:
            return
        self._next_poll = now + POLL_SECONDS
        if self._unsent is not None:
            self._send(None)
        request = self.control.poll()
        if request is not None:
            if request.action == ctl.ACTION_STOP:
                self.stop_reason = request.reason
            self.request = request

    def wanted(self, now: float, epoch_end: bool, epoch: int) -> Flags | None:
        """What this rank would save for at this safe point; None for nothing (and no object
        built: this runs after every step)."""
        stop = self.stop_reason is not None
        checkpoint = self.request is not None
        interval = bool(self.interval and now - self.last_save >= self.interval)
        at_epoch = bool(epoch_end and self.save_every and epoch % self.save_every == 0)
        if not (stop or checkpoint or interval or at_epoch or self.best_pending):
            return None
        return Flags(stop=stop, checkpoint=checkpoint, interval=interval, best=self.best_pending,
                     epoch=at_epoch, seq=self.request.seq if self.request is not None else 0)

    def adopt(self, agreed: Flags) -> None:
        """Take on what other ranks asked for, so that this rank saves (and stops) with them."""
        if agreed.stop and self.stop_reason is None:
            self.stop_reason = "stop requested on another rank"
        mine = self.request.seq if self.request is not None else 0
        if (agreed.stop or agreed.checkpoint) and (self.request is None or agreed.seq > mine):
            token = self.control.token if self.control is not None and agreed.seq else ""
            self.request = ctl.Request(
                token, agreed.seq, ctl.ACTION_STOP if agreed.stop else ctl.ACTION_CHECKPOINT,
                self.stop_reason or "checkpoint requested on another rank", time.time())

    def reason_for(self, flags: Flags) -> str | None:
        """The reason a checkpoint taken for ``flags`` is recorded with."""
        if flags.stop:
            return self.stop_reason
        if flags.checkpoint:
            return self.request.reason if self.request is not None else "checkpoint"
        return flags.reason()

    def take_request(self) -> ctl.Request | None:
        """The request a checkpoint about to be taken answers; it is no longer pending."""
        request, self.request = self.request, None
        return request

    def answer(self, info: CheckpointInfo | None, step: int, stopping: bool,
               error: str | None = None) -> None:
        """Acknowledge the pending request (if any) with ``info``; it is no longer pending."""
        self.acknowledge(self.take_request(), info, step, stopping, error)

    def acknowledge(self, request: ctl.Request | None, info: CheckpointInfo | None, step: int,
                    stopping: bool, error: str | None = None) -> None:
        """Tell the launcher which checkpoint answers ``request`` (or that none could)."""
        if self.control is None or not self.answers:
            return
        seq = request.seq if request is not None and request.token else 0
        self._send(ctl.Ack(token=self.control.token, seq=seq,
                           checkpoint=info.name if info else None, step=step,
                           stopping=stopping, error=error, time=time.time()))

    def _send(self, ack: ctl.Ack | None) -> None:
        """Write ``ack`` (None: the one not written yet) for the launcher; one that cannot be
        written is kept and tried again at each poll, until a newer one replaces it."""
        assert self.control is not None
        with self._sending:
            if ack is None:
                ack = self._unsent
                if ack is None:
                    return
            try:
                self.control.acknowledge(ack)
            except OSError as e:  # a full disk: kept, and the launcher learns of the exit
                if self._unsent is None:
                    logger.warning("could not answer procckpt run in %s (%s); trying again "
                                   "at each step", self.control.dir, e.strerror or e)
                self._unsent = ack
                return
            if self._unsent is not None and ack is self._unsent:
                logger.info("answered procckpt run in %s", self.control.dir)
            self._unsent = None
