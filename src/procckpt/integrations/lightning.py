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
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError("procckpt.integrations.lightning needs Lightning: "
                          "pip install 'procckpt[lightning]'") from e

from torch.utils.data import DataLoader

from ..training.checkpointer import Checkpointer
from ..training.driven import DrivenLoop, kept_apart, positioned
from ..training.payload import PAYLOAD
from ._common import checkpointer_resumed_from, newest_verified

__all__ = ["ProcckptCallback"]

logger = logging.getLogger(__name__)


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
        self.resume_from: str | None = str(info.file(PAYLOAD)) if info is not None else None
        self.checkpointer: Checkpointer | None = None
        self._loop: DrivenLoop | None = None

    # -- Lightning's hooks -----------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.checkpointer is not None:
            return
        # Here, not in __init__: under DDP the process group exists only once fit started.
        ckpt = checkpointer_resumed_from(self._chosen, **self._settings,
                                         lightning=_TrainerState(trainer))
        self.checkpointer = ckpt
        self._loop = DrivenLoop(ckpt)
        _position_train_loader(trainer, self._loop)

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

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # What Trainer.save_checkpoint writes, without its write: procckpt's store does that.
        state = self._trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return _plain(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # never called: Lightning loads resume_from itself


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

    strategy.process_dataloader = process_and_position  # type: ignore[method-assign]
