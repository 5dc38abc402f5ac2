"""A word_language_model-shaped script: a small RNN over a token stream cut into consecutive
chunks, its hidden state carried from one batch to the next and reset at each epoch.

``--hidden local`` keeps the carried state in a local variable, as pytorch/examples does: a
resume starts the next batch from a fresh hidden state and silently differs. ``--hidden
extras`` keeps it in ``ckpt.extras`` (README: state the script resets at every epoch).
``--seed clock`` seeds from the clock: no two runs agree, resumed or not."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import procckpt


class Chunks:
    """Consecutive (input, target) chunks of one long token stream: a loader whose order
    matters, as a language model's does."""

    def __init__(self, tokens: torch.Tensor, length: int) -> None:
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __iter__(self):
        for i in range(len(self)):
            start = i * self.length
            yield (self.tokens[start:start + self.length],
                   self.tokens[start + 1:start + 1 + self.length])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", choices=("local", "extras"), required=True)
    parser.add_argument("--seed", choices=("fixed", "clock"), default="fixed")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(time.time_ns() if args.seed == "clock" else 0)
    tokens = torch.randint(0, 32, (4 * 8 * 10 + 1,))
    loader = Chunks(tokens, 8)  # 40 batches an epoch
    embed, rnn, head = nn.Embedding(32, 16), nn.RNN(16, 16), nn.Linear(16, 32)
    model = nn.ModuleList([embed, rnn, head])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)
    for _epoch in ckpt.epochs(args.epochs):
        if args.hidden == "local":
            hidden = torch.zeros(1, 16)
        elif ckpt.batch == 0:  # a new epoch, not a mid-epoch resume
            ckpt.extras["hidden"] = torch.zeros(1, 16)
        for x, y in ckpt.batches(loader):
            if args.hidden == "extras":
                hidden = ckpt.extras["hidden"]
            out, hidden = rnn(embed(x), hidden.detach())
            loss = nn.functional.cross_entropy(head(out), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.hidden == "extras":
                ckpt.extras["hidden"] = hidden.detach()


if __name__ == "__main__":
    main()
