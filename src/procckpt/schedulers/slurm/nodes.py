"""Whether a node of this job is lost: Slurm's view of it, and a knock on its slurmd.

A rank whose node died leaves its peers with a broken connection and the step waiting for
it; Slurm itself marks the node NOT_RESPONDING only at its next ping (``SlurmdTimeout`` / 3,
100 s by default) and DOWN after ``SlurmdTimeout`` (300 s). So after a failure the launcher
also knocks on each node's slurmd (a TCP connect to its port: nodes reach each other's
slurmd, Slurm's own messages fan out that way). A knock counts only when the knock on this
node's own slurmd is answered, so a firewall or a container without the network is never
taken for lost nodes.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from .job import SlurmJob

__all__ = ["LostNode", "lost_nodes", "LOST_STATES"]

logger = logging.getLogger(__name__)

#: Node state flags (``scontrol show node``'s ``State=``, joined by ``+``) that mean the node
#: is gone for the job; sinfo's ``*`` suffix means NOT_RESPONDING too.
LOST_STATES = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "POWER_DOWN",
                         "POWERING_DOWN", "REBOOT_ISSUED"})
SLURMD_PORT = 6818  # Slurm's default SlurmdPort
KNOCK_TIMEOUT = 3.0

@dataclass(frozen=True)
class LostNode:
    name: str
    why: str  # in words: "Slurm says DOWN+NOT_RESPONDING", "its slurmd ... does not answer"

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


def knock(address: str, port: int) -> str | None:
    """None when something listens at ``address:port``, else why not."""
    try:
        with socket.create_connection((address, port), timeout=KNOCK_TIMEOUT):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _lost_state(state: str) -> bool:
    flags = set(state.rstrip("*~#!%$@^-").split("+"))
    return state.endswith("*") or bool(flags & LOST_STATES)


def _slurmd(record: dict[str, str], port: int) -> tuple[str, int] | None:
    """Where a node's slurmd listens (its ``NodeAddr``, its own ``Port`` or the cluster's)."""
    address = record.get("NodeAddr")
    return (address, int(record.get("Port") or port)) if address else None


def lost_nodes(job: SlurmJob) -> list[LostNode]:
    """The nodes of this job that Slurm calls lost or whose slurmd does not answer; [] when
    all answer, or when that cannot be told (no scontrol, no node list)."""
    names = job.node_names()
    if len(names) < 2:
        return []  # the batch node is the launcher's own: if it is alive, so is the job's
    records = job.node_records(names)
    port = SLURMD_PORT
    if (configured := job.config_value("SlurmdPort")) and configured.isdigit():
        port = int(configured)
    own = job.env.node_name
    own_slurmd = _slurmd(records.get(own or "", {}), port)
    own_answer = knock(*own_slurmd) if own_slurmd else "this node is not known"
    lost = []
    for name in names:
        record = records.get(name, {})
        state = record.get("State", "")
        if state and _lost_state(state):
            lost.append(LostNode(name, f"Slurm says {state}"))
        elif name != own and own_answer is None and (slurmd := _slurmd(record, port)):
            if (why := knock(*slurmd)) is not None:
                lost.append(LostNode(name, f"its slurmd at {slurmd[0]}:{slurmd[1]} does not "
                                           f"answer: {why}"))
    if own_answer is not None:
        logger.debug("no knock on the nodes' slurmd: this node's own does not answer (%s)",
                     own_answer)
    return lost
