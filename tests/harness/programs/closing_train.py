"""A loop as tutorials write it, with code that closes each epoch and code after the loop, both
reading what the last batch left (``loss``): a resume that started after an epoch's last batch,
inside an empty loop, would crash there (NameError) or compute something else.

    python closing_train.py --out OUT [--workers N] [--pause-at-step S --pause 3]
    python closing_train.py --out OUT --steps-alone 40      # ckpt.steps(N), a final evaluation

Prints ``step N`` after each step (``N`` counted over the run); 256 samples in batches of 8,
32 batches an epoch. ``--out`` holds the final weights and the best loss, or with
``--steps-alone`` the final loss the code after the loop computed.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import procckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--steps-alone", type=int, default=None,
                        help="train this many steps with ckpt.steps(N) instead of epochs")
    parser.add_argument("--pause-at-step", type=int, default=None,
                        help="sleep --pause seconds inside this step (a test stops it there)")
    parser.add_argument("--pause", type=float, default=3.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=args.workers)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)

    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step = ckpt.step + 1
        print(f"step {step}", flush=True)
        if step == args.pause_at_step:
            time.sleep(args.pause)
        return loss

    if args.steps_alone is not None:
        for number in ckpt.steps(args.steps_alone):
            x, y = data[number % len(data)]
            loss = train(x[None], y[None])
        final = float(loss)  # the final evaluation reads the last step's loss
        torch.save({"final": torch.tensor(final), **model.state_dict()}, args.out)
        return

    best = ckpt.extras.get("best", float("inf"))
    for _epoch in ckpt.epochs(args.epochs):
        for x, y in ckpt.batches(loader):
            loss = train(x, y)
        best = min(best, float(loss))  # the epoch's closing code: the last batch's loss
        ckpt.extras["best"] = best
    torch.save({"best": torch.tensor(best), **model.state_dict()}, args.out)


if __name__ == "__main__":
    main()
