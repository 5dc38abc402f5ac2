"""A small CNN on synthetic FashionMNIST-shaped data (1x28x28 images, 10 classes).

Exercises what makes exact resume hard: a shuffling DataLoader (optionally with worker
processes), dropout, random augmentation inside the data set, Adam, a learning-rate schedule,
and a best-accuracy value carried across restarts. The procckpt lines are marked.

    python examples/cnn_classifier.py --workers 2
    procckpt run --time-limit 30s --grace 8s -- python examples/cnn_classifier.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import procckpt  # procckpt 1/3


class SyntheticFashion(Dataset):
    """Each class is a fixed random pattern; an image is its class's pattern under heavy
    noise. Noise is also drawn per access (a random augmentation: it uses the RNG of whichever
    process loads the sample, the main one or a DataLoader worker)."""

    def __init__(self, n: int, seed: int) -> None:
        patterns = torch.rand((10, 1, 28, 28), generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.images = 0.3 * patterns[self.labels] + 0.7 * torch.rand((n, 1, 28, 28), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.randn((1, 28, 28))
        return self.images[index] + noise, self.labels[index]


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(16 * 5 * 5, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="pause per step (seconds)")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--out", default=None, help="save the final parameters to this file")
    args = parser.parse_args()

    torch.manual_seed(0)
    train = SyntheticFashion(args.train_size, seed=1)
    val = SyntheticFashion(512, seed=2)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    val_loader = DataLoader(val, batch_size=256)
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = procckpt.Checkpointer(args.ckpt_dir, model=model, optimizer=optimizer,  # procckpt 2/3
                                 scheduler=scheduler)
    best_acc = ckpt.extras.get("best_acc", 0.0)
    for epoch in ckpt.epochs(args.epochs):  # procckpt 3/3 (with ckpt.batches below)
        model.train()
        last_loss = float("nan")  # a resume at the very end of an epoch trains no batch here
        for images, labels in ckpt.batches(loader):
            loss = loss_fn(model(images), labels)
            last_loss = loss.item()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        scheduler.step()
        model.eval()
        correct = 0
        with torch.inference_mode():
            for images, labels in val_loader:
                correct += int((model(images).argmax(1) == labels).sum())
        acc = correct / len(val)
        best_acc = max(best_acc, acc)
        ckpt.extras["best_acc"] = best_acc
        ckpt.report_metric(acc)
        print(f"epoch {epoch} | loss {last_loss:.4f} | val acc {acc:.3f} | best {best_acc:.3f}",
              flush=True)
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
