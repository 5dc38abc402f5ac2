"""Lightning: exact, requeued, verified checkpoints from one callback.

    from procckpt.integrations.lightning import ProcckptCallback
    cb = ProcckptCallback()
    trainer = L.Trainer(..., callbacks=[cb]); trainer.fit(model, dl, ckpt_path=cb.resume_from)

The callback is a thin adapter: Lightning's hooks become the Checkpointer's safe points (after
each training batch), its training loader opens each epoch through procckpt (the position and
random streams of ``ckpt.batches()``), and a checkpoint is Lightning's own dictionary
(``Trainer.save_checkpoint`` writes the same) with procckpt's position and streams beside it,
in one ``state.pt`` of procckpt's store: manifest, checksums, keep-N, fallback, written in the
background unless it is a stop's. ``resume_from`` is that file for the newest checkpoint that
verifies: Lightning restores the model, optimizers, schedulers and its loops from it, procckpt
the data position and the random streams.

Under ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallel) each rank writes its
shards of the model and optimizer states through DCP, in parallel, named as Lightning's own
distributed checkpoint names them, and the rest of Lightning's dictionary is the checkpoint's
``meta.pt`` (a link to ``state.pt``): the checkpoint directory is a Lightning distributed
checkpoint, and ``resume_from`` is that directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError("procckpt.integrations.lightning needs Lightning: "
                          "pip install 'procckpt[lightning]'") from e

from torch.utils.data import DataLoader

from ..errors import ProcckptError
from ..protocol.control import ENV_TOKEN
from ..store import CheckpointInfo, CheckpointStore, PendingCheckpoint
from ..training.checkpointer import Checkpointer
from ..training.driven import DrivenLoop, kept_apart, positioned
from ..training.group import Sharded
from ..training.save.frozen import resolve_chunks
from ..training.state.payload import PAYLOAD
from ._common import checkpointer_resumed_from, newest_verified

__all__ = ["ProcckptCallback"]

logger = logging.getLogger(__name__)

#: The file of a Lightning distributed checkpoint that holds all but the sharded state
#: (lightning.fabric.strategies.model_parallel._METADATA_FILENAME).
_META = "meta.pt"


class ProcckptCallback(pl.Callback):
    """Checkpoints a Lightning ``Trainer`` where procckpt asks, and resumes it exactly.

    Args:
        dir: checkpoint directory; under ``procckpt run`` the launcher's choice wins.
        keep: how many recent checkpoints to keep.
        interval: also save every ``interval`` seconds (at the next batch's end).
        async_save: write checkpoints in the background (default: on; a stop's never).

    Attributes:
        resume_from: ``state.pt`` of the newest checkpoint that verifies (a Lightning
            checkpoint: ``ckpt_path=``, ``Model.load_from_checkpoint``), or None.
        checkpointer: the :class:`procckpt.Checkpointer` behind it (once ``fit`` started).
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, keep: int = 2,
                 interval: float | None = None, async_save: bool | None = None) -> None:
        super().__init__()
        self._settings = {"dir": dir, "keep": keep, "interval": interval,
                          "async_save": async_save}
        self._chosen = info = newest_verified(dir)
        self.resume_from: str | None = None
        if info is not None:  # a distributed checkpoint is the directory, else one file
            sharded = _META in info.manifest.get("files", {})
            self.resume_from = str(info.path if sharded else info.file(PAYLOAD))
        self.checkpointer: Checkpointer | None = None
        self._loop: DrivenLoop | None = None

    # -- Lightning's hooks -----------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.checkpointer is not None:
            return
        # Here, not in __init__: under DDP the process group exists only once fit started.
        shards = _sharded_state(trainer)
        statefuls: dict[str, Any] = {"lightning": _TrainerState(trainer, sharded=bool(shards))}
        if shards:
            statefuls["lightning_shards"] = shards
        ckpt = checkpointer_resumed_from(self._chosen, **self._settings, **statefuls)
        if shards:
            ckpt.store.adopt = _add_metadata_file
        else:  # state.pt may hold frozen weights as chunks (training/save/frozen.py)
            trainer.strategy.checkpoint_io = _ChunksPutBack(trainer.strategy.checkpoint_io,
                                                            ckpt.store)
        self.checkpointer = ckpt
        self._loop = DrivenLoop(ckpt)
        _position_train_loader(trainer, self._loop)
        _leave_requeue_to_procckpt(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._loop is not None:
            last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
            inside_accumulation = (batch_idx + 1) % trainer.accumulate_grad_batches != 0
            self._loop.batch_done(can_save=not (last or inside_accumulation))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loop is not None:
            self._loop.finish()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.checkpointer is not None:
            self.checkpointer.close()

    def state_dict(self) -> dict[str, Any]:
        return {}  # procckpt's own state lives beside Lightning's, not inside it


class _TrainerState:
    """Lightning's checkpoint of ``trainer``, as a stateful whose keys go at the top of
    ``state.pt`` (see payload.is_framework): Lightning itself loads it from ``ckpt_path``."""

    procckpt_framework = True
    #: What the resume audit compares when the first step begins (state/first_step.py): the
    #: model and the optimizers as the checkpoint holds them and as Lightning restored them,
    #: and its step counter. ``fit()`` without ``ckpt_path`` restores none of them.
    procckpt_audited_keys = ("state_dict", "optimizer_states", "global_step")
    procckpt_audited_counters = ("global_step",)
    procckpt_audit_advice = ("Lightning did not load the checkpoint: pass ckpt_path="
                             "cb.resume_from to trainer.fit() (a ProcckptCallback cb)")

    def __init__(self, trainer: pl.Trainer, *, sharded: bool = False) -> None:
        self._trainer = trainer
        self._sharded = sharded

    def procckpt_audited_state(self) -> dict[str, Any]:
        """The parts of ``procckpt_audited_keys``, live (the sharded ones are not compared)."""
        trainer = self._trainer
        if self._sharded:
            return {"global_step": trainer.global_step}
        return {"state_dict": trainer.lightning_module.state_dict(),
                "optimizer_states": [o.state_dict() for o in trainer.optimizers],
                "global_step": trainer.global_step}

    def state_dict(self) -> dict[str, Any]:
        # What Trainer.save_checkpoint writes, without its write: procckpt's store does that.
        dump = self._trainer._checkpoint_connector.dump_checkpoint
        if not self._sharded:
            return _plain(dump(weights_only=False))
        # The model's and the optimizers' states are _LightningShards': not gathered here.
        with _overridden(self._trainer.strategy, lightning_module_state_dict=lambda: {},
                         optimizer_state=lambda optimizer: {}):
            state = dump(weights_only=False)
        del state["state_dict"], state["optimizer_states"]
        return _plain(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # never called: Lightning loads resume_from itself

    def procckpt_modules(self) -> list[Any]:
        """The model whose frozen parameters procckpt writes once (training/save/frozen.py);
        Lightning reads them back through :class:`_ChunksPutBack`."""
        return [] if self._sharded else [self._trainer.lightning_module]


class _ChunksPutBack(pl.plugins.CheckpointIO):
    """The strategy's checkpoint I/O, but a procckpt ``state.pt`` it loads gets the frozen
    weights that procckpt stored once put back in place of their placeholders."""

    def __init__(self, inner: Any, store: CheckpointStore) -> None:
        self._inner = inner
        self._store = store

    def load_checkpoint(self, path: Any, map_location: Any = None, **kwargs: Any) -> Any:
        checkpoint = self._inner.load_checkpoint(path, map_location=map_location, **kwargs)
        folder = Path(path).absolute().parent
        if folder.parent == self._store.ckpt_root and Path(path).name == PAYLOAD:
            manifest = self._store._read_manifest(folder) or {}
            info = CheckpointInfo(folder, 0, manifest)
            checkpoint = resolve_chunks(checkpoint, info.chunk_store, info.chunks)
        return checkpoint

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self._inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self._inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self._inner.teardown()


class _LightningShards(Sharded):
    """This rank's shards of the model's and the optimizers' states under a sharded strategy,
    saved by procckpt through DCP under the names of Lightning's distributed checkpoint
    (``state_dict``, ``optimizer_0``, ...) and loaded by Lightning from ``resume_from``."""

    procckpt_framework = True

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer  # its model and optimizers exist once the strategy set up

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        strategy = self._trainer.strategy
        state: dict[str, Any] = {"state_dict": get_model_state_dict(strategy.model)}
        for i, optimizer in enumerate(strategy.optimizers):
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
            state[f"optimizer_{i}"] = get_optimizer_state_dict(strategy.model, optimizer)
        return state

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        raise AssertionError("Lightning loads its distributed checkpoint itself")


def _leave_requeue_to_procckpt(trainer: pl.Trainer) -> None:
    """Under ``procckpt run`` in a Slurm job, turn off Lightning's auto-requeue: it would
    ignore SIGTERM (the stop then waits for SIGKILL), and a SIGUSR1 reaching the training
    would make Lightning save its own checkpoint and requeue the job a second time. Called
    from ``setup``, before ``fit`` registers its signal handlers."""
    if ENV_TOKEN not in os.environ:
        return  # run alone, Lightning's requeue may be all the job has
    # The connector's environment is the one fit() asks (there is no public handle); of
    # Lightning's environments only SLURMEnvironment has auto_requeue.
    environment: Any = getattr(trainer._accelerator_connector, "cluster_environment", None)
    if getattr(environment, "auto_requeue", False):
        environment.auto_requeue = False
        if trainer.is_global_zero:
            logger.info("procckpt requeues this Slurm job: Lightning's auto_requeue is off")


def _sharded_state(trainer: pl.Trainer) -> _LightningShards | None:
    """The sharded state of ``trainer``'s strategy, None under one that is not sharded.

    Raises:
        ProcckptError: a sharded strategy procckpt does not save (FSDP1, DeepSpeed).
    """
    strategy = trainer.strategy
    kinds: dict[str, Any] = {name: getattr(pl.strategies, name, None)
             for name in ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")}
    if kinds["ModelParallelStrategy"] and isinstance(strategy, kinds["ModelParallelStrategy"]):
        return _LightningShards(trainer)
    for name in ("FSDPStrategy", "DeepSpeedStrategy"):
        if kinds[name] and isinstance(strategy, kinds[name]):
            raise ProcckptError(
                f"Lightning's {name} is not saved by procckpt: use ModelParallelStrategy "
                "(FSDP2: fully_shard in configure_model), whose shards procckpt writes "
                "through DCP, or leave ProcckptCallback out and use Lightning's own "
                "ModelCheckpoint")
    return None


def _add_metadata_file(pending: PendingCheckpoint) -> None:
    """Name ``state.pt`` also ``meta.pt``, the file of Lightning's distributed checkpoint
    that holds all but the shards (a hard link; a copy where links are not possible)."""
    source, target = pending.path / PAYLOAD, pending.path / _META
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
        pending.add_file(_META)
        return
    written = pending.files[PAYLOAD]
    pending.record_file(_META, written["bytes"], written["crc32"])


@contextlib.contextmanager
def _overridden(obj: Any, **methods: Any) -> Iterator[None]:
    """``obj``'s methods replaced by ``methods`` inside the block (on the instance only)."""
    for name, method in methods.items():
        setattr(obj, name, method)
    try:
        yield
    finally:
        for name in methods:
            delattr(obj, name)


def _plain(value: Any) -> Any:
    """``value`` with dict subclasses (Lightning's ``AttributeDict`` of hyperparameters) made
    plain dicts, so that the checkpoint loads with ``weights_only=True``."""
    if isinstance(value, dict):
        kind = OrderedDict if type(value) is OrderedDict else dict
        return kind((k, _plain(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _position_train_loader(trainer: pl.Trainer, loop: DrivenLoop) -> None:
    """Open the training loader through ``loop`` at each epoch, and keep the validation
    loaders apart from the training's random streams: wrap the strategy's
    ``process_dataloader``, the last step Lightning takes with a loader before iterating it
    (after adding a DistributedSampler under DDP)."""
    strategy = trainer.strategy
    process = strategy.process_dataloader

    def process_and_position(dataloader: object) -> object:
        dataloader = process(dataloader)
        if isinstance(dataloader, DataLoader):
            if trainer.training:
                positioned(dataloader, loop, lambda: trainer.current_epoch)
            elif trainer.state.fn == "fit":  # validation between training batches
                kept_apart(dataloader)
        elif trainer.training:
            logger.warning(
                "the training loader is a %s, not a DataLoader: procckpt cannot position it, "
                "so a resume in the middle of an epoch restarts that epoch's data as Lightning "
                "does (not exact); pass a torch DataLoader for an exact resume",
                type(dataloader).__name__)
        return dataloader

    strategy.process_dataloader = process_and_position
