"""A tiny training script for the tests: a few epochs of a small MLP with dropout on a shuffled
DataLoader, checkpointed by procckpt. Prints one line per step to stdout ("step N") so tests
can see where each cycle started and stopped."""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import procckpt


def _first_failure(restart: int, marker: str | None) -> bool:
    """Whether --fail-at-step fails now: on the first start, or once per ``marker`` file."""
    if marker is None:
        return restart == 0
    if os.path.exists(marker):
        return False
    with open(marker, "w"):
        pass
    return True


def main() -> None:  # noqa: C901, PLR0915 (a test program's every switch)
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32, help="the hidden layer's width")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--fail-at-step", type=int, default=None,
                        help="exit 3 at this step (only on the first start)")
    parser.add_argument("--fail-once", default=None,
                        help="with --fail-at-step: fail the first time the step is reached, "
                             "whichever start that is (this file marks it done)")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="die of SIGSEGV at this step, at every start (a bug), once "
                             "the checkpoints in flight are durable")
    parser.add_argument("--hang-at-step", type=int, default=None,
                        help="stop making progress after this step (only on the first start)")
    parser.add_argument("--finish-at-step", type=int, default=None,
                        help="end training early here: ckpt.finish(), then break")
    parser.add_argument("--hang-how", choices=("sleep", "lock"), default="sleep",
                        help="sleep forever, or block forever on a lock another thread holds")
    parser.add_argument("--prepare-seconds", type=float, default=0.0,
                        help="Python work after Checkpointer() before the loop (data prep)")
    parser.add_argument("--validate-seconds", type=float, default=0.0,
                        help="a validation pass of this long at the end of each epoch")
    parser.add_argument("--stuck-worker-after", type=int, default=None,
                        help="a DataLoader worker blocks forever once it has loaded this many "
                             "samples (only on the first start)")
    parser.add_argument("--ema", choices=("none", "unsaved", "saved", "tensors"),
                        default="none",
                        help="keep an exponential moving average of the weights, in no "
                             "checkpoint or handed to the Checkpointer (an AveragedModel), or "
                             "as a list of tensors in no checkpoint")
    parser.add_argument("--start-seconds", type=float, default=0.0,
                        help="a slow start before Checkpointer() (imports, reading a config)")
    parser.add_argument("--slow-first-start", type=float, default=0.0,
                        help="as --start-seconds, in the first cycle alone (PROCCKPT_RESTART 0)")
    args = parser.parse_args()
    time.sleep(args.start_seconds)
    if os.environ.get("PROCCKPT_RESTART", "0") == "0":
        time.sleep(args.slow_first_start)

    torch.manual_seed(0)
    x = torch.randn(args.n, 16)
    y = (x.sum(1) > 0).long()
    data = TensorDataset(x, y)
    if args.stuck_worker_after is not None and os.environ.get("PROCCKPT_RESTART", "0") == "0":
        data = StuckWorkerData(data, args.stuck_worker_after)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers)
    model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(args.width, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema: Any = None if args.ema == "none" else [
        p.detach().clone() for p in model.parameters()] if args.ema == "tensors" else \
        torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ckpt = procckpt.Checkpointer(args.ckpt_dir, model=model, optimizer=optimizer,
                                 save_every=args.save_every,
                                 **({"ema": ema} if args.ema == "saved" else {}))
    print(f"start step {ckpt.step} restart {os.environ.get('PROCCKPT_RESTART', '-')}", flush=True)
    if args.prepare_seconds:
        prepare_data(args.prepare_seconds)
    for _epoch in ckpt.epochs(args.epochs):
        for xb, yb in ckpt.batches(loader):
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if isinstance(ema, list):  # the common way: tensors updated in place
                with torch.no_grad():
                    for average, p in zip(ema, model.parameters()):
                        average.mul_(0.9).add_(p, alpha=0.1)
            elif ema is not None:
                ema.update_parameters(model)
            if args.fail_at_step is not None and ckpt.step + 1 == args.fail_at_step \
                    and _first_failure(ckpt.restart, args.fail_once):
                raise SystemExit(3)
            if ckpt.step + 1 == args.crash_at_step:
                # Once the checkpoints in flight are durable: where the restart resumes from
                # must not depend on how fast the machine wrote them.
                ckpt.flush()
                os.kill(os.getpid(), signal.SIGSEGV)
            print(f"step {ckpt.step + 1}", flush=True)
            if ckpt.step + 1 == args.finish_at_step:
                ckpt.finish()
                break
            if args.hang_at_step is not None and ckpt.step + 1 == args.hang_at_step \
                    and ckpt.restart == 0:
                stuck_waiting_for_data() if args.hang_how == "sleep" else stuck_on_a_lock()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if ckpt.finished:
            break
        if args.validate_seconds:
            validate(model, x, args.validate_seconds)
    print("done", flush=True)
    if args.out:
        torch.save(model.state_dict() if ema is None else
                   {"model": model.state_dict(), "ema": {str(i): t for i, t in enumerate(ema)}
                    if isinstance(ema, list) else ema.state_dict()}, args.out)


def prepare_data(seconds: float) -> None:
    """What tokenizing or building an index looks like: Python code, no safe point (half of
    one core: bursts of work between short reads)."""
    end = time.monotonic() + seconds
    vocab: dict[str, int] = {}
    while time.monotonic() < end:
        burst = time.monotonic() + 0.01
        while time.monotonic() < burst:
            for word in "the quick brown fox jumps over the lazy dog".split():
                vocab[word] = vocab.get(word, 0) + 1
        time.sleep(0.01)


def validate(model: nn.Module, x: torch.Tensor, seconds: float) -> None:
    """A long validation pass: batches through the model in eval mode, no random numbers
    drawn (so the training's state is the same with or without it)."""
    print("validating", flush=True)
    model.eval()
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            for start in range(0, len(x), 16):
                model(x[start:start + 16]).argmax(1)
                time.sleep(0.002)
    model.train()


class StuckWorkerData(torch.utils.data.Dataset):
    """A data set whose worker processes block for ever after ``after`` samples each (a read
    from a dead file system, a deadlock in a decoder): the main process waits for a batch
    that never comes."""

    def __init__(self, data: TensorDataset, after: int) -> None:
        self.data, self.after, self.loaded = data, after, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        if torch.utils.data.get_worker_info() is not None:
            self.loaded += 1
            if self.loaded > self.after:
                stuck_in_a_worker()
        return self.data[index]


def stuck_in_a_worker() -> None:
    while True:
        time.sleep(3600)


def stuck_on_a_lock() -> None:
    """A deadlock: the lock's holder never lets go."""
    import threading

    lock, held = threading.Lock(), threading.Event()

    def hold() -> None:
        lock.acquire()
        held.set()
        time.sleep(3600)

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    with lock:
        pass


def stuck_waiting_for_data() -> None:
    """What a dead data worker or a lost collective looks like from the outside."""
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
