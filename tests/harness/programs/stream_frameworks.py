"""examples/streaming_train.py's stream (Hugging Face ``datasets`` over local JSON Lines files,
``procckpt.ShuffleBuffer``, a StatefulDataLoader with 2 workers) trained through a framework:
``--framework accelerate`` (the loader prepared with ``use_stateful_dataloader``, then
``ckpt.batches()``), ``lightning`` (``ProcckptCallback``; the data set's epoch set in
``on_train_epoch_start``) or ``trainer`` (the Hugging Face Trainer's own DataLoader with 2
workers over the ShuffleBuffer, ``max_steps`` for 2 epochs: replayed on a resume). Writes the
final weights to ``--out``; prints "resumed S" as training starts (S: the step it resumed from)
and "step N trained I I I ..." (the batch's sample ids) after each step (Accelerate with
``--accumulate``: each micro-batch; the Trainer also prints "step N" after each).
``--corrupt-on-resume``: a resumed process flips every label its loader hands out (a transform
changed between two starts), for the audit to catch."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import procckpt  # noqa: E402
import streaming_train as example  # noqa: E402


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(example.VOCAB, 32), nn.Dropout(0.2), nn.Linear(32, 2))


def data_and_loader(args: argparse.Namespace) -> tuple[procckpt.ShuffleBuffer, object]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    folder = Path(args.data)
    if not folder.exists():
        example.make_data(folder, args.files, args.rows, parquet=False)
    data = procckpt.ShuffleBuffer(example.streamed(sorted(folder.glob("*.jsonl")), False),
                                  size=32, seed=0)
    return data, StatefulDataLoader(data, batch_size=8, num_workers=args.workers,
                                    collate_fn=collate(args))


def resumed() -> bool:
    return os.environ.get("PROCCKPT_RESTART", "0") != "0"


def collate(args: argparse.Namespace, base=None):
    """The loader's collate function; with --corrupt-on-resume, in a resumed process, one that
    flips the labels."""
    from torch.utils.data import default_collate

    base = base or default_collate
    if args.noise:  # a random transform, drawn where the batch is made
        def noisy(samples):
            batch = base(samples)
            batch["noise"] = torch.rand(len(batch["id"]))
            return batch
        return noisy
    if not (args.corrupt_on_resume and resumed()):
        return base

    def flipped(samples):
        batch = base(samples)
        for key in ("label", "labels"):
            if key in batch:
                batch[key] = 1 - batch[key]
        return batch
    return flipped


def with_lightning(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    import lightning as L

    from procckpt.integrations.lightning import ProcckptCallback

    data, loader = data_and_loader(args)

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def on_train_start(self) -> None:
            print("resumed", self.trainer.global_step, flush=True)

        def on_train_epoch_start(self) -> None:
            data.set_epoch(self.current_epoch)

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self.net(batch["tokens"]), batch["label"])
            if "noise" in batch:
                loss = loss * (1 + 0.01 * batch["noise"].mean())
            time.sleep(args.step_sleep)
            print("step", self.trainer.global_step + 1, "trained", *batch["id"].tolist(),
                  flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    classifier = Classifier()
    cb = ProcckptCallback()
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", callbacks=[cb],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(classifier, loader, ckpt_path=cb.resume_from)
    return classifier.net.state_dict()


def with_accelerate(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True), gradient_accumulation_steps=args.accumulate)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    data, loader = data_and_loader(args)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    ckpt = procckpt.Checkpointer(model=net, optimizer=optimizer)
    print("resumed", ckpt.step, flush=True)
    for epoch in ckpt.epochs(args.epochs):
        data.set_epoch(epoch)
        for batch in ckpt.batches(loader):
            with accelerator.accumulate(net):  # (a plain step without --accumulate)
                loss = nn.functional.cross_entropy(net(batch["tokens"]), batch["label"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            time.sleep(args.step_sleep)
            print("step", ckpt.step + 1, "trained", *batch["id"].tolist(), flush=True)
    return accelerator.unwrap_model(net).state_dict()


def with_trainer(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from procckpt.integrations.transformers import ProcckptCallback

    folder = Path(args.data)
    if not folder.exists():
        example.make_data(folder, args.files, args.rows, parquet=False)
    data = procckpt.ShuffleBuffer(example.streamed(sorted(folder.glob("*.jsonl")), False),
                                  size=32, seed=0)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def forward(self, tokens, labels, id=None):  # the Trainer's collator says "labels"
            if self.training and id is not None:
                print("step", at["step"] + 1, "trained", *id.tolist(), flush=True)
            return {"loss": nn.functional.cross_entropy(self.net(tokens), labels)}

    at = {"step": 0}

    class Steps(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            print("resumed", state.global_step, flush=True)

        def on_step_begin(self, targs, state, control, **kwargs):
            at["step"] = state.global_step

        def on_step_end(self, targs, state, control, **kwargs):
            time.sleep(args.step_sleep)
            print(f"step {state.global_step}", flush=True)

    classifier = Classifier()
    training = TrainingArguments(
        output_dir="hf-output", per_device_train_batch_size=8,
        max_steps=args.epochs * args.files * args.rows // 8, learning_rate=3e-3,
        save_strategy="no", logging_strategy="no", report_to=[], seed=0, use_cpu=True,
        dataloader_num_workers=2, remove_unused_columns=False, disable_tqdm=True)
    cb = ProcckptCallback()
    from transformers import default_data_collator

    trainer = Trainer(model=classifier, args=training, train_dataset=data,
                      data_collator=collate(args, default_data_collator), callbacks=[cb, Steps()])
    trainer.train(resume_from_checkpoint=cb.resume_from)
    return classifier.net.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["lightning", "accelerate", "trainer"],
                        required=True)
    parser.add_argument("--data", default="data")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--corrupt-on-resume", action="store_true")
    parser.add_argument("--workers", type=int, default=2,
                        help="the StatefulDataLoader's worker processes (Lightning, Accelerate)")
    parser.add_argument("--noise", action="store_true",
                        help="collate draws a random transform (`noise`), where it runs")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="Accelerate: micro-batches a gradient is accumulated over")
    args = parser.parse_args()
    train = {"lightning": with_lightning, "accelerate": with_accelerate,
             "trainer": with_trainer}[args.framework]
    weights = train(args)
    if args.out:
        torch.save({k: v.detach().cpu() for k, v in weights.items()}, args.out)


if __name__ == "__main__":
    main()
