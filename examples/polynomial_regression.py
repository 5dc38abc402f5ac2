"""Fit f(x) = 7x^2 - x + 2 from 8 noisy samples with a degree-2 polynomial model.

The model, data and schedule follow the restart example of the Khipu cluster guide (L1 loss,
SGD, 1000 epochs, a short sleep per epoch so that the run spans several time-limit cycles).
The three procckpt lines are marked. Runs on its own or under the launcher:

    python examples/polynomial_regression.py
    procckpt run --time-limit 20s --grace 5s -- python examples/polynomial_regression.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import procckpt  # procckpt 1/3


def f(x: torch.Tensor) -> torch.Tensor:
    return 7 * x * x - x + 2


class PolynomialRegressionModel(nn.Module):
    """y = sum_i c_i x^i with one learnable coefficient per power of x."""

    def __init__(self, polynomial_degree: int) -> None:
        super().__init__()
        self.degree = polynomial_degree
        self.coefficients = nn.ParameterList(
            nn.Parameter(torch.randn(1, dtype=torch.float64)) for _ in range(polynomial_degree + 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = torch.zeros((x.shape[0], 1), dtype=x.dtype, device=x.device)
        for power, coefficient in enumerate(self.coefficients):
            result = result + torch.pow(x, power) * coefficient
        return result

    def __str__(self) -> str:
        terms = [f"{c.item():+.4f} x^{i}" for i, c in reversed(list(enumerate(self.coefficients)))]
        return "f(x) = " + " ".join(terms)


def make_data() -> tuple[torch.Tensor, ...]:
    """16 noisy points of f drawn from [-3, 3): 8 to train on, 4 to validate, 4 to test."""
    torch.manual_seed(42)
    x_all = torch.arange(-3.0, 3.0, 0.01, dtype=torch.float64).unsqueeze(1)
    y_all = f(x_all) + (torch.rand(x_all.shape, dtype=torch.float64) * 4.0 - 2.0)
    torch.manual_seed(1969)
    chosen = torch.randperm(x_all.shape[0])[:16]
    x, y = x_all[chosen], y_all[chosen]
    return x[:8], y[:8], x[8:12], y[8:12], x[12:], y[12:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--sleep", type=float, default=0.01, help="seconds to pause per epoch")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint dir (default: $PROCCKPT_DIR "
                        "or ./procckpt-checkpoints)")
    parser.add_argument("--out", default=None, help="save the final parameters to this file")
    args = parser.parse_args()

    x_train, y_train, x_val, y_val, _, _ = make_data()
    torch.manual_seed(1969)
    model = PolynomialRegressionModel(polynomial_degree=2)
    loss_fn = nn.L1Loss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    ckpt = procckpt.Checkpointer(args.ckpt_dir, model=model, optimizer=optimizer,  # procckpt 2/3
                                 save_every=100)
    print(f"start: epoch {ckpt.epoch}, {model}", flush=True)
    for epoch in ckpt.epochs(args.epochs):  # procckpt 3/3
        model.train()
        loss = loss_fn(model(x_train), y_train)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.inference_mode():
            val_loss = loss_fn(model(x_val), y_val)
        if epoch % 100 == 0:
            print(f"epoch {epoch:4d} | train L1 {loss.item():.4f} | val L1 {val_loss.item():.4f}",
                  flush=True)
        time.sleep(args.sleep)
    print(f"final: {model}", flush=True)
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
