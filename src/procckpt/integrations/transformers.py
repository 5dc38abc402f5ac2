"""Hugging Face ``Trainer``: exact, requeued, verified checkpoints from one callback.

    from procckpt.integrations.transformers import ProcckptCallback
    cb = ProcckptCallback()
    trainer = Trainer(..., callbacks=[cb]); trainer.train(resume_from_checkpoint=cb.resume_from)

The Trainer writes its own checkpoint (weights, optimizer, scheduler, RNG, ``trainer_state.json``)
when procckpt asks for one, and procckpt moves those files into a checkpoint of its store beside
its ``state.pt`` (the data position and random streams), under one manifest with checksums:
keep-N, fallback and the launcher's acknowledgement apply to the Trainer's files too. A
checkpoint directory is therefore also a Trainer checkpoint: ``resume_from`` is the newest one
that verifies.

What procckpt replaces: the Trainer resumes mid-epoch by reading the batches trained on again
(``skip_first_batches``) after loading the random streams of the checkpoint, so the order and
the random transforms of the resumed epoch differ from the uninterrupted run's. Here its
training loader opens each epoch through procckpt (the order drawn from the epoch's streams,
the batches trained on passed over without loading them, samples seeded by their index), and
the Trainer's own skipping is turned off for that loader.

The user's own checkpoints (``save_strategy``, ``save_total_limit``) are left alone: a
checkpoint only procckpt wants is written by the Trainer into a staging folder of procckpt's,
with its rotation off, so it never counts against ``save_total_limit``; one that falls on a
step the user's schedule saves too is copied from the user's folder, which stays.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

try:
    import transformers.trainer as hf_trainer
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("procckpt.integrations.transformers needs Transformers: "
                      "pip install 'procckpt[transformers]'") from e

from torch.utils.data import DataLoader

from ..errors import ProcckptError
from ..store import PendingCheckpoint
from ..training.checkpointer import Checkpointer
from ..training.driven import DrivenLoop, positioned
from ..training.fingerprints import CheckHook
from ..training.state.first_step import StateExpectation
from ._common import checkpointer_resumed_from, newest_verified

__all__ = ["ProcckptCallback"]

logger = logging.getLogger(__name__)

#: The Trainer's own state in its checkpoint (transformers' TRAINER_STATE_NAME).
_STATE = "trainer_state.json"
#: The Trainer's checkpoint folder for a step (transformers' PREFIX_CHECKPOINT_DIR).
_FOLDER = "checkpoint-{}"
#: Where the Trainer writes a checkpoint only procckpt wants, in the store's checkpoints/
#: (a .tmp-ckpt- name: never loaded, removed at the next start if left behind).
_STAGING = ".tmp-ckpt-trainer"


class ProcckptCallback(TrainerCallback):
    """Checkpoints a Hugging Face ``Trainer`` where procckpt asks, and resumes it exactly.

    Args:
        dir: checkpoint directory; under ``procckpt run`` the launcher's choice wins.
        keep: how many recent checkpoints to keep.
        interval: also save every ``interval`` seconds (at the next optimizer step's end).

    Attributes:
        resume_from: the newest checkpoint directory that verifies (a Trainer checkpoint:
            ``trainer.train(resume_from_checkpoint=...)``), or None.
        checkpointer: the :class:`procckpt.Checkpointer` behind it (once training started).
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, keep: int = 2,
                 interval: float | None = None) -> None:
        self._settings = {"dir": dir, "keep": keep, "interval": interval}
        self._chosen = info = newest_verified(dir)
        self.resume_from: str | None = str(info.path) if info is not None else None
        self.checkpointer: Checkpointer | None = None
        self._loop: DrivenLoop | None = None
        self._train_loader: Any = None
        self._objects: dict[str, Any] = {}
        #: The reason of the checkpoint procckpt asked the Trainer to write, until it has.
        self._wanted: str | None = None
        #: The exit code procckpt check's stop ends the process with, once the Trainer wrote.
        self._leave_with: int | None = None
        self._written: Path | None = None
        self._copy = False  # the Trainer's folder is the user's own: copy, do not move
        #: args.output_dir and save_total_limit while the Trainer writes into procckpt's
        #: staging folder, to put back in on_save.
        self._redirected: tuple[Any, Any] | None = None
        _hand_skipping_to_procckpt()

    # -- the Trainer's events --------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, *,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if self.checkpointer is not None:
            return
        sharded = [name for name in ("deepspeed", "fsdp") if getattr(args, name, None)]
        if sharded:
            raise ProcckptError(
                f"the Trainer runs with {sharded[0]}, whose checkpoints are directory trees "
                "that procckpt's Trainer integration does not adopt yet: run without "
                "ProcckptCallback (the Trainer's own save_strategy), with plain DDP, or "
                "shard through Accelerate or Lightning with procckpt (docs/frameworks.md)")
        # Here: under DDP the process group exists once the TrainingArguments made it.
        ckpt = checkpointer_resumed_from(self._chosen, **self._settings, async_save=False)
        ckpt.store.adopt = self._adopt_trainer_files
        # A checkpoint procckpt wants is written by the Trainer first (see on_save).
        ckpt._checkpoint = self._ask_trainer  # type: ignore[method-assign]
        ckpt._check.stop_through = self._ask_trainer_then_leave  # and procckpt check's stop
        ckpt._check.compared = self._trainers_states
        self.checkpointer, self._loop = ckpt, DrivenLoop(ckpt)
        _audit_the_step_counter(ckpt, state)
        self._train_loader = train_dataloader
        base = getattr(train_dataloader, "base_dataloader", train_dataloader)
        if not isinstance(base, DataLoader):
            raise ProcckptError(f"the Trainer's training loader is a {type(base).__name__}, "
                                "not a DataLoader: procckpt cannot position it")
        positioned(base, self._loop, lambda: getattr(train_dataloader, "iteration", 0))

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loop is not None:  # a micro-batch of gradient accumulation: no safe point
            self._loop.ckpt._progress.batch_done()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loop is None:
            return
        self._objects = kwargs  # the model, optimizer and scheduler, for procckpt check
        # The epoch's count is whole after its last batch when the loader has a length; over
        # a stream (the count is a fraction of max_steps) Accelerate's loader, which fetches
        # a batch ahead, knows it handed out the last one.
        last_of_epoch = (state.epoch is not None and float(state.epoch).is_integer()) or \
            bool(getattr(self._train_loader, "end_of_dataloader", False))
        self._loop.batch_done(can_save=not last_of_epoch)
        if self._wanted is not None:
            self._save_here(args, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loop is not None and state.max_steps and state.global_step >= state.max_steps:
            self._wanted = "end"  # the final checkpoint, with the Trainer's files
            self._save_here(args, control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._wanted is None or self.checkpointer is None:
            return  # a checkpoint of the Trainer's own schedule: left where it wrote it
        reason, self._wanted = self._wanted, None
        self._written = Path(args.output_dir) / _FOLDER.format(state.global_step)
        if self._redirected is not None:
            args.output_dir, args.save_total_limit = self._redirected
            self._redirected = None
        ckpt = self.checkpointer
        try:
            if reason == "end":
                ckpt.save("end")
            elif self._leave_with is not None:  # procckpt check's stop
                ckpt.save(reason)
                CheckHook.leave(ckpt, self._leave_with)
            else:
                Checkpointer._checkpoint(ckpt, reason)  # writes, answers, may stop
        finally:
            self._written = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loop is not None:
            self._loop.finish()
            self._loop.ckpt.close()

    # -- internals -------------------------------------------------------------------------
    def _ask_trainer(self, reason: str) -> None:
        self._wanted = reason

    def _trainers_states(self) -> dict[str, Any]:
        """What the Trainer saves in its own files: procckpt check compares it too."""
        return {name: obj.state_dict() for name in ("model", "optimizer", "lr_scheduler")
                if (obj := self._objects.get(name)) is not None}

    def _ask_trainer_then_leave(self, reason: str, code: int) -> None:
        self._wanted, self._leave_with = reason, code

    def _save_here(self, args: Any, control: Any) -> None:
        """Have the Trainer write the checkpoint procckpt wants at this step: where the
        user's schedule saves anyway, into the user's folder (copied from, kept); else into
        procckpt's staging folder, its rotation off (moved from)."""
        self._copy = bool(control.should_save)  # the user's own save at this step
        if not self._copy:
            assert self.checkpointer is not None
            self._redirected = (args.output_dir, args.save_total_limit)
            args.output_dir = str(self.checkpointer.store.ckpt_root / _STAGING)
            args.save_total_limit = None
        control.should_save = True

    def _adopt_trainer_files(self, pending: PendingCheckpoint) -> None:
        """Move the Trainer's checkpoint files into procckpt's (on the rank that commits)."""
        folder = self._written
        if folder is None:
            return
        if not folder.is_dir():
            raise ProcckptError(f"the Trainer wrote no checkpoint in {folder}")
        for path in sorted(folder.iterdir()):
            if not path.is_file():
                raise ProcckptError(
                    f"the Trainer's checkpoint {folder} holds a directory ({path.name}), which "
                    "procckpt does not adopt: use a plain DDP setup")
            pending.adopt_file(path, copy=self._copy)
        if not self._copy:
            folder.rmdir()
            with contextlib.suppress(OSError):  # the staging folder, empty now
                folder.parent.rmdir()


def _audit_the_step_counter(ckpt: Checkpointer, state: Any) -> None:
    """Have the resume audit compare the Trainer's step counter when the first step begins
    with the one of the checkpoint it resumed from (``trainer_state.json``): ``train()``
    without ``resume_from_checkpoint`` starts again at 0 (state/first_step.py)."""
    info = ckpt.resumed_from
    if info is None:
        return
    try:
        saved = json.loads(info.file(_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a checkpoint the Trainer wrote: nothing to compare
    if isinstance(saved, int):
        ckpt._audit.expect_state(StateExpectation(
            {"global_step": (saved, "counter")}, lambda: {"global_step": state.global_step},
            "the Trainer did not load the checkpoint: pass resume_from_checkpoint="
            "cb.resume_from to trainer.train() (a ProcckptCallback cb)",
            frozenset({"global_step"})))


def _hand_skipping_to_procckpt() -> None:
    """The Trainer's ``skip_first_batches`` returns a loader that procckpt positions as it
    is: procckpt passes over the batches trained on (the Trainer would read them again)."""
    original = hf_trainer.skip_first_batches
    if getattr(original, "procckpt", False):
        return

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        base = getattr(dataloader, "base_dataloader", dataloader)
        if getattr(base, "_procckpt_loop", None) is not None:
            return dataloader
        return original(dataloader, num_batches)

    skip_first_batches.procckpt = True  # type: ignore[attr-defined]
    hf_trainer.skip_first_batches = skip_first_batches

