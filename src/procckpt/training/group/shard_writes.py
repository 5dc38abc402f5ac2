"""Sharded state written in the background in DCP's format, from copies taken at the agreed step.

DCP plans from the live state and writes the copies.

A ``torch.distributed.checkpoint`` save has two halves. Planning reads only what does not
change while training goes on: each tensor's global shape, dtype, mesh and placements, hence
which chunk of which tensor this rank writes. Writing reads the values, which do change. So at
the agreed step each rank copies its local shards into its host arena (beside its part of the
replicated state); its writer thread then runs ``dcp.save`` on the live state dict with a
planner whose ``lookup_object`` answers from those copies (dcp_plans.py). The checkpoint is
DCP's own format (``.metadata``, ``__R_0.distcp``), resharded on load as before.

DCP's collectives (gathering the plans, the results, the metadata) then run on writer threads,
beside the training's own collectives: they use a gloo group of their own, made once, so that
the two never interleave on one group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ...errors import ProcckptError
from ..sharded.dcp import Sharded, dcp_errors, dcp_failure, dcp_state
from ..sharded.files import Sums, save_dcp
from .sums import gather_sums

__all__ = ["ShardWrites"]

#: How long a writer thread waits in DCP's collectives for the other ranks (a rank that died
#: mid-write would otherwise hold its peers' exit for gloo's default 30 minutes).
_GROUP_TIMEOUT = timedelta(minutes=10)


class ShardWrites:
    """The sharded half of one rank's background group checkpoints.

    Args:
        sharded: the :class:`Sharded` statefuls, by name.
    """

    def __init__(self, sharded: dict[str, Sharded]) -> None:
        self.sharded = sharded
        # Collective: every rank makes its Checkpointer, hence this group, at the same point.
        self.group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)

    def live(self) -> dict[str, Any]:
        """The state dicts DCP plans from (collective where ``get_state_dict`` is)."""
        return dcp_state(self.sharded)

    @staticmethod
    def locals_of(live: dict[str, Any]) -> dict[str, Any]:
        """DCP's flattened view of ``live`` with each DTensor replaced by this rank's local
        shard: what the arena copies (plain tensors and values)."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.tensor import DTensor

        flat, _ = flatten_state_dict(live)
        return {fqn: value.to_local() if isinstance(value, DTensor) else value
                for fqn, value in flat.items()}

    def write(self, live: dict[str, Any], copies: dict[str, Any], directory: str) -> Sums:
        """Collective over the writer threads: DCP's save of ``live`` into ``directory``,
        with the values of ``copies`` (:meth:`locals_of` of ``live``, as copied). Returns
        the sizes and CRCs of the files every rank wrote (for rank 0's commit)."""
        try:
            sums = save_dcp(live, directory, self.group, copies)
        except dcp_errors() as e:
            raise ProcckptError(f"sharded state: {dcp_failure(e)}") from e
        return gather_sums(sums, self.group)

