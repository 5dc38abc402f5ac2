"""Whether a data set's samples are a function of their index, so that a resume may skip them.

A skip passes over the trained batches without loading them; that is exact only if loading a
sample again gives the same sample. A forked child finds out without touching the data set of
the training process (see :func:`not_repeatable`); when in doubt, the resume replays.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["not_repeatable", "own_state", "PROBE_TIMEOUT"]

#: Seconds the test loads may take before the resume replays instead.
PROBE_TIMEOUT = 120.0
#: The samples the probe loads (first, middle, last), and how deep it looks into the data
#: set's attributes for state of its own.
PROBE_SAMPLES = 3
STATE_DEPTH = 3
STATE_OBJECTS = 256


def not_repeatable(dataset: Any, seed: Callable[[int], None], workers: int = 0,
                   worker_init: Callable[[int], None] | None = None) -> str:
    """Why skipping the samples of ``dataset`` would not be exact ("" when it would);
    ``seed(index)`` seeds the global streams as a worker does before loading that sample.
    With ``workers`` and their ``worker_init`` (a DataLoader's ``worker_init_fn``), the child
    is set up as worker 0 first: a generator the function gives the worker's data set is one
    the data set holds when it loads.

    A sample must be a function of its index and the global random streams. Chance must not
    decide that: a coin-flip augmentation from a generator of the data set's own gives the same
    sample twice in a row half the time. So, for a few samples (first, middle, last), each is
    loaded once (a lazily opened file or a cache fills), then the data set's own state is
    noted (the generators it holds, a few attributes deep), each sample is loaded
    twice more from the same random state and compared (NaN equal to NaN), and the state is
    noted again: a sample that differs, or a state that moved, means replay.

    The loads run in a forked child, so that they move nothing the data set keeps (a generator
    of its own, a cache) in this process: the run goes on as if they had not happened.
    """
    try:
        size = len(dataset)
    except TypeError:
        return "a data set without len()"
    if not size:
        return ""
    if not hasattr(os, "fork"):
        return "no fork() here to load a sample without touching the data set"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os._exit, no clean-up of the parent's state
        code = 3
        try:
            os.close(read)
            if workers and worker_init is not None:
                _as_worker(dataset, workers, worker_init)
            why = _probe(dataset, size, seed)
            os.write(write, why.encode()[:4096])
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    ended = _wait_child(pid, PROBE_TIMEOUT)
    with os.fdopen(read, "rb") as f:
        why = f.read().decode(errors="replace")
    if ended != 0:
        return f"a test load of the data set in a child process failed ({ended})"
    return why


def _as_worker(dataset: Any, workers: int, worker_init: Callable[[int], None]) -> None:
    """Make this (forked, probing) process look like a DataLoader's worker 0 of ``workers``
    to ``get_worker_info()``, and run the loader's ``worker_init_fn`` in it."""
    from torch.utils.data._utils import worker

    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=workers, seed=seed,
                                            dataset=dataset)
    worker_init(0)


def _probe(dataset: Any, size: int, seed: Callable[[int], None]) -> str:
    """The child's side of :func:`not_repeatable`: why the data set is not repeatable."""
    indices = sorted({0, size // 2, size - 1})[:PROBE_SAMPLES]
    for i in indices:  # first loads: lazy opens, caches
        seed(i)
        dataset[i]
    before = own_state(dataset)
    for i in indices:
        loads = []
        for _ in range(2):
            seed(i)
            loads.append(dataset[i])
        if not _same(*loads):
            return (f"sample {i}, loaded twice from the same random state, differed: the data "
                    "set draws from a generator of its own or reads something that changes; "
                    "draw from torch's, Python's or NumPy's global streams to make the resume "
                    "skip instead")
    after = own_state(dataset)
    moved = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if moved:
        return (f"the data set's own state changed as samples were read ({', '.join(moved[:3])})"
                ": a generator of its own, which a skip would not move; draw from "
                "torch's, Python's or NumPy's global streams to make the resume skip instead")
    return ""


def own_state(dataset: Any) -> dict[str, Any]:
    """What a data set keeps that reading may move and a skip would not: the state of every
    random generator it holds (in its attributes, at most :data:`STATE_DEPTH` deep), by
    attribute path. (A counter of reads or a cache changes too, but a sample that depends on
    it differs between two loads.)"""
    np = sys.modules.get("numpy")
    found: dict[str, Any] = {}
    seen: set[int] = set()
    todo: list[tuple[str, Any, int]] = [("self", dataset, 0)]
    while todo and len(seen) < STATE_OBJECTS:
        path, obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        state = _generator_state(obj, np)
        if state is not None:
            found[path] = state
            continue
        if depth >= STATE_DEPTH or isinstance(obj, (torch.Tensor, bytes, bytearray)) or \
                (np is not None and isinstance(obj, np.ndarray)):
            continue
        if isinstance(obj, dict):
            items = list(obj.items())[:16]
            todo += [(f"{path}[{k!r}]", v, depth + 1) for k, v in items]
        elif isinstance(obj, (list, tuple)):
            todo += [(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(obj[:16])]
        else:
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                todo += [(f"{path}.{k}", v, depth + 1) for k, v in list(attributes.items())[:64]]
    return found


def _generator_state(obj: Any, np: Any) -> Any:
    """The state of a random generator, comparable with ``==``; None for anything else."""
    if isinstance(obj, torch.Generator):
        return bytes(obj.get_state().numpy())
    if isinstance(obj, random.Random):
        return obj.getstate()
    if np is not None:
        if isinstance(obj, np.random.Generator):
            return repr(obj.bit_generator.state)
        if isinstance(obj, np.random.RandomState):
            kind, keys, pos, has_gauss, gauss = obj.get_state()
            return kind, keys.tobytes(), pos, has_gauss, gauss
    return None


def _wait_child(pid: int, timeout: float) -> int | str:
    """The exit code of child ``pid``, or what ended it; killed after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"no answer in {timeout:.0f}s"
        time.sleep(0.005)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return f"signal {os.WTERMSIG(status)}"


def _same(a: Any, b: Any) -> bool:
    """Whether two loaded samples are equal, through tensors, arrays and containers; a NaN
    equals a NaN in the same place (it is the same sample)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(torch.isnan(a), torch.isnan(b))
                        and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    np = sys.modules.get("numpy")
    if np is not None and (isinstance(a, np.ndarray) or isinstance(b, np.ndarray)):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and a.shape == b.shape
                and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot say: not provably the same
        return False


