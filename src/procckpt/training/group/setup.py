"""Joining the process group: rank, world size, rendezvous from torchrun's or srun's variables."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ...errors import UsageError
from .backend_threads import settle_at_exit

__all__ = ["default_backend", "init_distributed", "polls_control", "first_host", "ENV_POLL_RANKS"]

#: Which ranks read ``control/``: "all" (default), "local0" (one per node: less load on a
#: shared file system), or a comma-separated list of global ranks. The agreement spreads a
#: request to the other ranks either way.
ENV_POLL_RANKS = "PROCCKPT_POLL_RANKS"


def init_distributed(backend: str | None = None) -> tuple[int, int, int]:
    """Initialise the default process group from torchrun's or srun's environment.

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Under ``srun``
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) the rendezvous address is the step's first
    node and the port is derived from the job and step ids (MASTER_ADDR / MASTER_PORT in the
    environment win). Without either it starts nothing and returns (0, 1, 0).

    Returns:
        (rank, world_size, local_rank)
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1"))) > 1:
        rank = int(env["SLURM_PROCID"])
        world = int(env.get("SLURM_NTASKS") or env["SLURM_NPROCS"])
        local = int(env.get("SLURM_LOCALID", 0))
        env.setdefault("MASTER_ADDR", _slurm_first_node())
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        step = int(env.get("SLURM_STEP_ID", "0") or 0)
        env.setdefault("MASTER_PORT", str(20000 + (job * 7 + step) % 20000))
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    else:
        return 0, 1, 0
    if world > 1 and not dist.is_initialized():
        if backend is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            backend = default_backend(_local_world_size(env), gpus)
        dist.init_process_group(backend, rank=rank, world_size=world)
    if world > 1:
        settle_at_exit()
    return rank, world, local


def default_backend(local_world_size: int, gpus: int) -> str:
    """``nccl`` when every rank on this node can have a GPU of its own, else ``gloo``: NCCL
    refuses two ranks on one device, as on a one-GPU machine running two ranks."""
    return "nccl" if gpus >= max(1, local_world_size) else "gloo"


def _local_world_size(env: Mapping[str, str]) -> int:
    """How many ranks run on this node: torchrun's LOCAL_WORLD_SIZE, or srun's tasks per node
    (``SLURM_TASKS_PER_NODE`` reads like ``2(x3),1``: this node's count is not known, the
    largest is safe)."""
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"])
    counts = re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_TASKS_PER_NODE", ""))
    return max((int(c) for c in counts), default=1)


def _slurm_first_node() -> str:
    """The first host of the step (or job): where rank 0 runs under srun's default block
    distribution. Its name from the host list when the name resolves here (no rank calls
    scontrol then); otherwise its address as Slurm knows it (``NodeAddr``), since node names
    need not be in DNS."""
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or ""
    name = first_host(nodes)
    if not name:
        return "127.0.0.1"
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    from ...schedulers.slurm.job import node_address

    address = node_address(name)
    if address is None:
        raise UsageError(f"the first node of this job, {name}, has no address here (its name "
                         "does not resolve and scontrol does not know it): set MASTER_ADDR")
    return address


def first_host(hostlist: str) -> str:
    """The first name of a Slurm host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", hostlist.strip())
    if head is None:
        return ""
    prefix, ranges = head.group(1), head.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def polls_control(rank: int, local_rank: int | None = None,
                  spec: str | None = None) -> bool:
    """Whether this rank reads ``control/`` (see :data:`ENV_POLL_RANKS`)."""
    spec = (os.environ.get(ENV_POLL_RANKS, "all") if spec is None else spec).strip().lower()
    if spec in ("", "all"):
        return True
    if spec == "local0":
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0) \
            if local_rank is None else local_rank
        return local == 0
    try:
        chosen = {int(x) for x in spec.split(",") if x.strip()}
    except ValueError:
        raise UsageError(f"bad {ENV_POLL_RANKS}={spec!r}: use all, local0 or a list of ranks "
                         "like 0,8,16") from None
    return rank in chosen
