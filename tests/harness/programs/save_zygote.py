"""Starts "training processes" quickly for the crash test: imports torch once, then forks one
child per round on request. Each child resumes with procckpt.Checkpointer from DIR and saves
over and over (each checkpoint's tensor filled with its step) until it is killed.

With "frozen" after DIR the tensor is a frozen parameter of a module: each checkpoint then
writes it as a new chunk (it changed) and collects the previous one.

Protocol on stdin/stdout, one line each: "go" -> "pid N" (then "ready" from the child once it
has resumed and is about to save); "reap" -> "status S".
"""

from __future__ import annotations

import os
import sys

import torch

import procckpt


class Holder:
    """A stateful whose tensor always equals its step, so a torn checkpoint would show."""

    def __init__(self) -> None:
        self.step = 0
        self.weights = torch.zeros(1 << 20)  # 4 MiB

    def state_dict(self) -> dict:
        return {"step": self.step, "w": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.weights.copy_(state["w"])


class FrozenHolder(torch.nn.Module, Holder):
    """The same, its tensor a parameter that does not train (stored as a chunk)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.step = 0
        self.weights = torch.nn.Parameter(torch.zeros(1 << 20), requires_grad=False)

    state_dict = Holder.state_dict  # type: ignore[assignment]

    def load_state_dict(self, state: dict) -> None:  # type: ignore[override]
        with torch.no_grad():
            Holder.load_state_dict(self, state)


def child(directory: str, frozen: bool) -> None:
    holder = FrozenHolder() if frozen else Holder()
    ckpt = procckpt.Checkpointer(directory, holder=holder, keep=2)
    if ckpt.resumed_from is not None and not torch.all(holder.weights == holder.step):
        raise RuntimeError("the checkpoint it resumed from is not what was saved")
    print("ready", flush=True)  # the zygote's stdout: the test starts its random wait now
    while True:
        holder.step += 1
        with torch.no_grad():
            holder.weights.fill_(holder.step)
        ckpt.step = holder.step
        ckpt.save("crash-test")


def main() -> None:
    directory = sys.argv[1]
    pid = 0
    for line in sys.stdin:
        command = line.strip()
        if command == "go":
            pid = os.fork()
            if pid == 0:
                try:
                    child(directory, frozen="frozen" in sys.argv[2:])
                except BaseException as e:  # noqa: BLE001 - report anything, then die
                    print(f"failed {e!r}", flush=True)
                finally:
                    os._exit(1)
            print(f"pid {pid}", flush=True)
        elif command == "reap":
            _, status = os.waitpid(pid, 0)
            print(f"status {status}", flush=True)


if __name__ == "__main__":
    main()
