"""The checkpoint plan of a run: the period of checkpoints and the deadline's lead, kept in step
with what checkpoints cost (costs.py, interval.py, grace.py put together)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..durations import format_duration
from ..protocol.events import append_event
from .config import RunConfig
from .costs import CheckpointCosts
from .deadline import Deadline
from .grace import Lead, deadline_lead
from .interval import Period, choose_period

__all__ = ["CheckpointPlan"]

logger = logging.getLogger(__name__)


class CheckpointPlan:
    """When to checkpoint without stopping (``period``), and how long before the deadline to
    ask for its checkpoint (``lead``); :meth:`refresh` re-plans from the journal."""

    def __init__(self, config: RunConfig, deadline: Deadline, journal: Path) -> None:
        self.config = config
        self.deadline = deadline
        self.journal = journal
        self.costs = CheckpointCosts(journal)
        self.period = Period(None, "not planned yet")
        self._step_seconds: float | None = None
        self._gap: float | None = None
        self._planned = False
        self._warned: float | None = None  # the lead last said to exceed the grace

    @property
    def lead(self) -> Lead:
        """The deadline's lead now: the deadline may learn its limit (a Slurm job's) late."""
        limit = self.deadline.limit
        return deadline_lead(self.config.grace_for(limit), self.costs.longest_durable,
                             self._step_seconds, limit, self.deadline.kill_wait,
                             self.deadline.signal_lead, self._gap)

    def refresh(self, step_seconds: float | None, gap: float | None = None, *,
                cycle: int | None = None, start: bool = False) -> bool:
        """Read the journal's new checkpoints and plan again; True if the period changed.

        Args:
            step_seconds: the training's seconds per step, where known (hang.py measures it).
            gap: the longest time between two safe points in a row, where known (hang.py).
            cycle: the cycle running: say (and journal) a grace too short for the costs as soon
                as a checkpoint measured shows it, once (again only when the lead grew by a
                tenth since): a run that ends in its first cycle is told too.
            start: at the cycle's start: plan even if the journal holds nothing new.
        """
        costs = self.costs
        self._step_seconds = step_seconds
        changed = costs.update()
        self._gap = max(gap or 0.0, costs.longest_gap or 0.0) or None
        if not changed and not start and self._planned:
            return False
        durable = costs.longest_durable
        if cycle is not None:
            lead = self.lead
            if lead.warning and (self._warned is None or lead.seconds > 1.1 * self._warned):
                self._warned = lead.seconds
                logger.warning("%s", lead.warning)
                append_event(self.journal, "grace-short", lead=round(lead.seconds, 3),
                             message=lead.warning, cycle=cycle)
        period = choose_period(self.config.interval, self.config.mtbf, costs.pause,
                               durable[0] if durable else None)
        old, self.period, self._planned = self.period, period, True
        if period.seconds == old.seconds:
            return False
        # Said (and journalled for procckpt status) when it is new, has a new basis (the first
        # measurement), or moved by over 10 %.
        if old.seconds is None or period.seconds is None \
                or period.why.split(":")[0] != old.why.split(":")[0] \
                or abs(period.seconds - old.seconds) > 0.1 * old.seconds:
            if period.seconds is not None:
                logger.info("periodic checkpoints every %s (%s)",
                            format_duration(period.seconds), period.why)
            append_event(self.journal, "interval",
                         seconds=None if period.seconds is None else round(period.seconds, 3),
                         why=period.why)
        return True
