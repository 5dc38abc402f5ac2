"""A PyTorch CPU training script that knows nothing about procckpt: the DMTCP engine checkpoints
it with no code change.

It trains a small MLP on a shuffled synthetic data set, prints ``step N`` after every optimizer
step and saves the final parameters to ``--out``. It has no resume logic of its own: under
``procckpt run --engine dmtcp`` a restarted cycle continues from the saved process image, so the
printed steps of all cycles together count up without going back (DMTCP must be installed:
docs/dmtcp.md).

    python examples/plain_torch_train.py --out params.pt
    procckpt run --engine dmtcp --time-limit 30s -- python examples/plain_torch_train.py \
        --step-sleep 0.05 --out params.pt
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--subprocess-every", type=int, default=0,
                        help="run a short subprocess every N steps (as scripts do for git, "
                             "nvidia-smi, a data download)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(args.n, 16)
    y = (x.sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(args.hidden, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    for _epoch in range(args.epochs):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if args.subprocess_every and step % args.subprocess_every == 0:
                subprocess.run(["true"], check=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    torch.save(model.state_dict(), args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
