"""A Hugging Face Trainer script with procckpt's three lines: a tiny BERT classifier built from
its config (no hub), a data set that masks a random token of each sample when it is read (a
random transform), dropout, a linear LR schedule; the Trainer's own loader shuffles. Writes the
final weights to ``--out``. Under torchrun with ``--ddp``: DDP over gloo, a CPU process a rank.

Prints "resume_from PATH" (or "resume_from -") and "step N" after each optimizer step.

    procckpt run --time-limit 1m -- python examples/transformers_train.py --epochs 5
    procckpt run -- torchrun --standalone --nproc-per-node 2 examples/transformers_train.py --ddp
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import framework_common
from procckpt.integrations.transformers import ProcckptCallback


class Sentences(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, 64, (n, 8), generator=g)
        self.labels = (self.ids[:, 0] > 32).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i].clone()
        ids[torch.randint(1, 8, ())] = 2  # mask a random token: a random transform
        return {"input_ids": ids, "labels": self.labels[i]}


class Steps(TrainerCallback):
    """Prints each step; sleeps (a slower step) and hangs once where asked."""

    def __init__(self, step_sleep: float, hang_at_step: int | None) -> None:
        self.step_sleep, self.hang_at_step = step_sleep, hang_at_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        marker = Path("hung-once")
        if state.global_step == self.hang_at_step and not marker.exists():
            marker.touch()
            time.sleep(3600)  # stuck: only the hang timeout ends this
        print(f"step {state.global_step}", flush=True)


def main() -> None:
    parser = framework_common.parser()
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=None,
                        help="the Trainer's own checkpoints too, every N steps into hf-output")
    parser.add_argument("--save-total-limit", type=int, default=None,
                        help="of which the Trainer keeps the newest N")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    training = TrainingArguments(
        output_dir="hf-output", per_device_train_batch_size=8, num_train_epochs=args.epochs,
        learning_rate=1e-3, lr_scheduler_type="linear",
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        logging_strategy="no", report_to=[], seed=0, use_cpu=not args.cuda,
        dataloader_num_workers=args.workers, gradient_accumulation_steps=args.accumulate,
        disable_tqdm=True)

    cb = ProcckptCallback()
    if os.environ.get("RANK", "0") == "0":
        print(f"resume_from {cb.resume_from or '-'}", flush=True)
    trainer = Trainer(model=model, args=training, train_dataset=Sentences(args.n),
                      callbacks=[cb, Steps(args.step_sleep, args.hang_at_step)])
    trainer.train(resume_from_checkpoint=cb.resume_from)
    if args.out and trainer.is_world_process_zero():
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
