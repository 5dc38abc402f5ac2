"""A Lightning training script with procckpt's three lines: a shuffling DataLoader (0 or more
workers) over a data set with a random transform in ``__getitem__``, dropout, a step-wise LR
schedule, validation after each epoch. Run under ``procckpt run`` (or alone); writes the final
weights to ``--out``. Under torchrun with ``--ddp``: DDP over gloo, one CPU process a rank; with
``--fsdp``: FSDP2 (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``), each rank
holding and saving half of the model and optimizer state.

With ``--frozen-base``, the classifier sits on a frozen encoder (its weights do not train):
procckpt writes those once, into chunks every later checkpoint shares.
Prints "resume_from PATH" (or "resume_from -") and "step N" after each training step.

    procckpt run --time-limit 1m -- python examples/lightning_train.py --epochs 5
    procckpt run -- torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --ddp
    procckpt run --time-limit 1m -- torchrun --standalone --nproc-per-node 2 \
        examples/lightning_train.py --fsdp
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import framework_common
from procckpt.integrations.lightning import ProcckptCallback


class Classifier(L.LightningModule):
    def __init__(self, step_sleep: float, hang_at_step: int | None, marker: Path,
                 frozen_base: bool = False) -> None:
        super().__init__()
        width = 8
        self.base = None
        if frozen_base:  # a stand-in for a pretrained encoder
            width = 256
            self.base = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width))
            self.base.requires_grad_(False)
        self.net = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(32, 2))
        self.step_sleep, self.hang_at_step, self.marker = step_sleep, hang_at_step, marker

    def forward(self, x):
        return self.net(x if self.base is None else self.base(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        step = self.trainer.global_step + 1
        if step == self.hang_at_step and not self.marker.exists():
            self.marker.touch()
            time.sleep(3600)  # stuck: only the hang timeout ends this
        print(f"step {step}", flush=True)
        return loss

    def configure_model(self):
        """Under ModelParallelStrategy: each linear layer, then the whole, sharded over the
        ranks (FSDP2)."""
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


def main() -> None:
    parser = framework_common.parser()
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 over the ranks of torchrun (ModelParallelStrategy)")
    parser.add_argument("--frozen-base", action="store_true",
                        help="a frozen encoder under the classifier (written once)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Classifier(args.step_sleep, args.hang_at_step, Path("hung-once"), args.frozen_base)
    train = DataLoader(framework_common.NoisyBlobs(args.n), batch_size=8, shuffle=True,
                       num_workers=args.workers)
    val = DataLoader(framework_common.NoisyBlobs(32, seed=2), batch_size=16)

    cb = ProcckptCallback()
    if os.environ.get("RANK", "0") == "0":
        print(f"resume_from {cb.resume_from or '-'}", flush=True)
    strategy = "ddp" if args.ddp else "auto"
    if args.fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]),
                                         tensor_parallel_size=1)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="gpu" if args.cuda else "cpu",
                        devices=2 if args.ddp or args.fsdp else 1, strategy=strategy,
                        callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train, val, ckpt_path=cb.resume_from)
    state = model.state_dict()
    if args.fsdp:  # every rank takes part in gathering the full weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if args.out and trainer.global_rank == 0:
        torch.save({k: v.cpu() for k, v in state.items()}, args.out)


if __name__ == "__main__":
    main()
