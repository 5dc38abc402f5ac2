"""One ``procckpt run``, wired: the store opened and locked, the engine chosen, the deadline
and restart policy found, then the run loop (node 0) or a follower (the other nodes)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Callable

from ..errors import CommandNotFoundError
from ..protocol.events import append_event
from ..store import CheckpointStore
from .config import RunConfig
from .deadline import Deadline, LocalDeadline, NoDeadline
from .engines import Engine
from .restart import LocalRestart, RestartPolicy
from .tier import memory_tier
from .warm import warm_restarts

__all__ = ["launch", "Scheduled"]

logger = logging.getLogger("procckpt")

#: A scheduler's deadline and restart policy for this run, or None where it has no job here
#: (the commands hand in Slurm's: the launcher does not import the schedulers).
Scheduled = Callable[[RunConfig], "tuple[Deadline, RestartPolicy] | None"]


def launch(config: RunConfig, scheduled: Scheduled) -> int:
    """Everything ``procckpt run`` does after parsing; returns the exit code."""
    from .supervisor import Supervisor

    exe = config.command[0]
    if "/" not in exe and shutil.which(exe) is None:
        raise CommandNotFoundError(f"command not found: {exe} (check the spelling and PATH)")
    store = CheckpointStore(config.dir, keep=config.keep, journal=append_event,
                            remote=config.remote).open()
    if config.remote is not None:
        logger.info("checkpoints go to %s; the lock, control channel and journal stay in %s",
                    config.remote, store.root)
    if config.node_rank > 0:  # node 0's launcher holds the lock and leads
        from .follower import Follower

        return Follower(config, store).run().exit_code
    with store.lock(), _lease(store):
        if store.remote is not None:  # a kill during an upload left one here only
            marker = store.complete_path
            store.remote.publish_missing(store.checkpoints(), store.chunks,
                                         marker.read_bytes() if marker.exists() else None)
        complete = store.completion()
        if complete and not config.force:
            step = complete.get("step")
            logger.info("the run in %s already finished%s; nothing to do. Use --force or a new "
                        "--dir to train again", store.root,
                        "" if step is None else f" (step {step})")
            return 0
        if config.force:
            archived = store.archive()
            if archived is not None:
                logger.info("--force: earlier checkpoints moved to %s", archived)
        store.clean_temporaries()
        store.fetch_remote()  # a new node: its newest checkpoint is in the prefix
        engine = _engine_for(config, store)
        deadline, policy = scheduled(config) or _local(config)
        with memory_tier(config.memory_tier and config.nodes == 1, engine.name) as tier, \
                warm_restarts(config.warm_restarts and config.max_restarts > 0, engine.name,
                              config.command, config.nodes == 1) as warm:
            return Supervisor(config, store, engine, deadline, policy,
                              tier=tier, warm=warm).run().exit_code


def _lease(store: CheckpointStore) -> contextlib.AbstractContextManager[object]:
    """The prefix's lease (store/lease.py), held while this run lasts; none for a local dir."""
    if store.remote is None:
        return contextlib.nullcontext()
    from ..store.lease import PrefixLease

    return PrefixLease(store.remote)


def _engine_for(config: RunConfig, store: CheckpointStore) -> Engine:
    """The engine --engine asks for (auto: see engines/choice.py); logs which and why."""
    from .engines.choice import choose_engine
    from .engines.hooks import HooksEngine

    choice = choose_engine("hooks" if config.nodes > 1 else config.engine, config.command,
                           store)
    if config.nodes > 1:
        choice = dataclasses.replace(choice, reason=f"--nodes {config.nodes}: the ranks of every "
                                     "node answer through procckpt.Checkpointer")
    logger.info("engine: %s (%s)", choice.name, choice.reason)
    if choice.warning is not None:
        logger.warning("%s", choice.warning)
    if choice.name == "dmtcp":
        from .engines.dmtcp import DmtcpEngine, DmtcpTools

        assert isinstance(choice.tools, DmtcpTools)
        return DmtcpEngine(store, choice.tools)
    if choice.name == "criu":
        from .engines.criu import CriuEngine, CriuTools

        assert isinstance(choice.tools, CriuTools)
        return CriuEngine(store, choice.tools)
    return HooksEngine(store)


def _local(config: RunConfig) -> tuple[Deadline, RestartPolicy]:
    """No scheduler's job: --time-limit's cycles, restarted here."""
    deadline: Deadline = (LocalDeadline(config.time_limit) if config.time_limit is not None
                          else NoDeadline())
    return deadline, LocalRestart(config.max_restarts)
