"""State split across ranks (FSDP2, DTensor): saved and resharded through DCP.

DCP keeps its index as a pickle; the reader and planner here unpickle only what DCP itself
writes, and load tensors with ``weights_only``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import ProcckptError

__all__ = ["Sharded", "dcp_errors", "dcp_failure", "dcp_failures", "dcp_state", "load_sharded",
           "sharded_of"]


class Sharded:
    """A model (and its optimizers) whose state is split across ranks: FSDP2 ``fully_shard``,
    DTensor, tensor parallel. Pass it to the Checkpointer like any other state::

        ckpt = procckpt.Checkpointer(train=procckpt.Sharded(model, optimizer), scheduler=sched)

    In a process group it is saved with ``torch.distributed.checkpoint`` (each rank writes its
    own shards, in parallel) and can be resharded to another world size; without one it is
    an ordinary state dict.
    """

    def __init__(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.optimizers:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not self.optimizers:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def sharded_of(statefuls: Mapping[str, Any]) -> dict[str, Sharded]:
    return {name: obj for name, obj in statefuls.items() if isinstance(obj, Sharded)}


def _framework_loads(obj: Sharded) -> bool:
    """Whether ``obj`` is a framework's sharded checkpoint (``procckpt_framework``): its
    entries go at the top of DCP's checkpoint, named as the framework names them, and the
    framework loads them itself (Lightning's distributed checkpoint)."""
    return getattr(obj, "procckpt_framework", False) is True


def dcp_state(sharded: Mapping[str, Sharded]) -> dict[str, Any]:
    """What DCP saves of the ``Sharded`` statefuls: each one's state dict under its name, a
    framework's entries at the top level (collective where ``get_state_dict`` is)."""
    state: dict[str, Any] = {}
    for name, obj in sharded.items():
        if not _framework_loads(obj):
            state[name] = obj.state_dict()
            continue
        entries = obj.state_dict()
        clash = sorted(set(entries) & (set(sharded) | set(state)))
        if clash:
            raise ProcckptError(f"the {name} checkpoint has entries named like other state: "
                                f"{', '.join(clash)}")
        state.update(entries)
    return state


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What to catch around ``dcp.save`` / ``dcp.load``: DCP reports a failure (on every rank
    of the group) as its ``CheckpointException``, which derives from ``BaseException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def dcp_failures(error: BaseException) -> dict[int, BaseException]:
    """Each failed rank's own error, when ``error`` is DCP's gathering of them; else {}."""
    failures = getattr(error, "failures", None)  # rank -> (error, its traceback)
    if not isinstance(failures, dict):
        return {}
    return {rank: pair[0] for rank, pair in sorted(failures.items())}


def dcp_failure(error: BaseException) -> str:
    """One line for an error out of DCP: each failed rank's own error, when DCP gathered them."""
    failures = dcp_failures(error)
    if failures:
        return "; ".join(f"rank {rank}: {_first_line(e)}" for rank, e in failures.items())
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _safe_dcp_reader(path: Path) -> Any:
    """A DCP reader that unpickles only DCP's own metadata classes.

    DCP stores its index (``.metadata``) as a pickle and loads non-tensor values with
    ``torch.load(weights_only=False)``. procckpt hands DCP only checkpoints whose files all
    passed the manifest's checksums, and on top of that restricts both loads to what DCP
    itself writes, so that a planted file cannot run code.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            meta_path = self._get_metadata_path(rank)
            with self.fs.create_stream(meta_path, "rb") as f:
                metadata = _DcpMetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(str(path))


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and isinstance(getattr(torch, name, None),
                                                 (torch.dtype, torch.layout, torch.memory_format))
                ) or (module == "torch" and name == "Size")
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "PurePosixPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP metadata refers to {module}.{name}, which DCP itself never writes")
        return super().find_class(module, name)


def _safe_load_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.planner import ReadItem

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return _Planner()


def load_sharded(statefuls: Mapping[str, Any], path: Path, names: list[str],
                 use_group: bool, frozen_set: Path | None = None) -> dict[str, Any] | None:
    """Load the :class:`Sharded` states ``names`` from checkpoint ``path`` (resharding).

    ``frozen_set``: a DCP checkpoint with the frozen parameters of the same states, saved
    apart (frozen_shards.py). Returns those parameters as loaded, ``{name: {"model": ...}}``,
    or None without a set."""
    targets = sharded_of(statefuls)
    missing = [n for n in names if n not in targets]
    if missing:
        raise ProcckptError(
            f"checkpoint {path.name} holds sharded state {', '.join(missing)} that this script "
            "does not pass as procckpt.Sharded(...); use the same Checkpointer arguments")
    extra = [n for n in targets if n not in names]
    if extra:
        raise ProcckptError(
            f"checkpoint {path.name} has no sharded state for {', '.join(extra)}: it was written "
            "with other Checkpointer arguments; use a new checkpoint dir")
    names = [n for n in names if not _framework_loads(targets[n])]
    if not names:
        return None
    # Imported only here: torch.distributed.checkpoint pulls in DTensor, torch.fx and sympy
    # (about 0.9 s and 45 MB), which a restart without sharded state would pay for nothing.
    import torch.distributed.checkpoint as dcp

    def load(state: dict[str, Any], source: Path) -> None:
        dcp.load(state, storage_reader=_safe_dcp_reader(source), planner=_safe_load_planner(),
                 no_dist=not use_group)

    try:
        if frozen_set is None:
            load({n: targets[n] for n in names}, path)
            return None
        # As DCP does with a Stateful: its state dict, loaded in place, then handed back;
        # here in two halves, each from the checkpoint that holds it.
        held = _safe_dcp_reader(frozen_set).read_metadata().state_dict_metadata
        rest: dict[str, Any] = {}
        frozen: dict[str, Any] = {}
        for n in names:
            state = targets[n].state_dict()
            model = state["model"]
            apart = {k: v for k, v in model.items() if f"{n}.model.{k}" in held}
            rest[n] = {**state, "model": {k: v for k, v in model.items() if k not in apart}}
            if apart:
                frozen[n] = {"model": apart}
        load(rest, path)
        load(frozen, frozen_set)
        for n in names:
            if n in frozen:
                rest[n]["model"].update(frozen[n]["model"])
            targets[n].load_state_dict(rest[n])
        return frozen
    except dcp_errors() as e:
        raise ProcckptError(f"cannot load the sharded state of {path.name}: "
                            f"{dcp_failure(e)}") from e
