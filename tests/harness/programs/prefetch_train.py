"""A nanoGPT-shaped script: an iteration-based loop (``ckpt.steps``) whose batches come from
``torch.randint`` on the global generator, fetched one step ahead (before the loop and at the
end of each step), as nanoGPT's train.py does.

``--adapt naive`` keeps nanoGPT's pre-loop fetch as it is: on a resume it draws from the fresh
seed, and the batch carried across the checkpoint is lost. ``--adapt extras`` keeps the carried
batch in ``ckpt.extras``, as the README says. Prints "step N" per step."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import procckpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--adapt", choices=("naive", "extras"), required=True)
    p.add_argument("--max-iters", type=int, default=120)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    torch.manual_seed(1337)
    data = torch.randint(0, 64, (4096,))  # the "corpus", made before the Checkpointer
    block, batch = 16, 8
    model = nn.Sequential(nn.Embedding(64, 32), nn.Dropout(0.1), nn.Linear(32, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block - 1, (batch,))
        x = torch.stack([data[i:i + block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
        return x, y

    if args.adapt == "extras":
        X, Y = ckpt.extras["batch"] if "batch" in ckpt.extras else get_batch()
    else:
        X, Y = get_batch()  # fetch the very first batch
    for iter_num in ckpt.steps(args.max_iters):
        logits = model(X)
        loss = nn.functional.cross_entropy(logits.view(-1, 64), Y.view(-1))
        X, Y = get_batch()  # prefetch the next batch, as nanoGPT does
        if args.adapt == "extras":
            ckpt.extras["batch"] = (X, Y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {iter_num}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
