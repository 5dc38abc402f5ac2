"""A nanoGPT-shaped training script: a small character-level GPT, batches drawn at random from
one long token tensor (``get_batch``), AdamW with weight decay on the matrices only, a warm-up
then cosine learning rate set by hand every iteration, gradient clipping, an evaluation every
``--eval-every`` iterations. The model is built from its config (no download); the text is
made here. The three procckpt lines are marked: the loop is ``ckpt.steps()``, and the batch
fetched ahead for the next iteration is kept in ``ckpt.extras`` so that a resume trains on the
same batches as an uninterrupted run.

    python examples/nanogpt_train.py --max-iters 200
    procckpt run --time-limit 1m -- python examples/nanogpt_train.py
    procckpt check --steps 20 -- python examples/nanogpt_train.py --max-iters 40
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import procckpt  # procckpt 1/3


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, dropout=config.dropout,
                                          batch_first=True)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd),
                                 nn.Dropout(config.dropout))
        mask = torch.triu(torch.ones(config.block_size, config.block_size, dtype=torch.bool), 1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_text(length: int, vocab: int) -> torch.Tensor:
    """A token stream with structure to learn: words of a small random lexicon, repeated."""
    g = torch.Generator().manual_seed(0)
    words = [torch.randint(1, vocab, (int(n),), generator=g)
             for n in torch.randint(2, 7, (200,), generator=g)]
    order = torch.randint(0, len(words), (length,), generator=g)
    tokens, n = [], 0
    for i in order.tolist():
        tokens += [*words[i].tolist(), 0]  # 0 separates words
        n += len(words[i]) + 1
        if n >= length:
            break
    return torch.tensor(tokens[:length])


def lr_at(it: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth (nanoGPT's get_lr)."""
    if it < args.warmup:
        return args.lr * (it + 1) / (args.warmup + 1)
    progress = min(1.0, (it - args.warmup) / max(1, args.max_iters - args.warmup))
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.lr / 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause per "
                        "iteration (to see several time-limit cycles)")
    parser.add_argument("--out", default=None, help="save the final parameters to this file")
    args = parser.parse_args()

    torch.manual_seed(1337)
    config = GPTConfig()
    data = make_text(20_000, config.vocab_size)
    train, val = data[:18_000], data[18_000:]

    def get_batch(split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(split) - config.block_size - 1, (args.batch_size,))
        x = torch.stack([split[i:i + config.block_size] for i in ix])
        y = torch.stack([split[i + 1:i + 1 + config.block_size] for i in ix])
        return x, y

    model = GPT(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    ckpt = procckpt.Checkpointer(model=model, optimizer=optimizer)  # procckpt 2/3

    X, Y = ckpt.extras["batch"] if "batch" in ckpt.extras else get_batch(train)
    # nanoGPT's loop runs max_iters + 1 iterations: it breaks once iter_num > max_iters.
    for it in ckpt.steps(args.max_iters + 1):  # procckpt 3/3
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, args)
        if it % args.eval_every == 0 or it == args.max_iters:
            model.eval()
            with torch.no_grad():
                losses = [model(*get_batch(val)).item() for _ in range(4)]
            model.train()
            print(f"iter {it}: val loss {sum(losses) / len(losses):.4f}", flush=True)
        loss = model(X, Y)
        X, Y = get_batch(train)  # fetched ahead, as nanoGPT does...
        ckpt.extras["batch"] = (X, Y)  # ...so it is saved with this step
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        time.sleep(args.step_sleep)
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
