"""The checksums of the files each rank wrote into a DCP checkpoint, gathered on every rank, so
that rank 0's manifest lists every file with its size and CRC-32."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..sharded.files import Sums
from .backend_threads import let_go

__all__ = ["gather_sums"]


def gather_sums(sums: Sums, group: Any = None,
                device: torch.device | None = None) -> Sums:
    """Collective: the sums of the files every rank wrote, on every rank."""
    device = device or torch.device("cpu")
    data = json.dumps(sums).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    let_go(size, *sizes)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    texts = [torch.zeros(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(texts, mine, group=group)
    let_go(mine, *texts)
    merged: Sums = {}
    for text, n in zip(texts, lengths):
        raw = bytes(text[:n].cpu().tolist())
        merged.update({name: (int(v[0]), int(v[1])) for name, v in json.loads(raw).items()})
    return merged
