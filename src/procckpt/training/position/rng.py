"""Capture and restore every random-number stream a training run draws from.

States are kept as tensors, ints, floats and strings only, so that a checkpoint holding them
loads with ``torch.load(weights_only=True)``: no pickle of a NumPy array or a Python tuple
subclass is ever needed.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng", "generator_states", "restore_generators"]


def capture_rng() -> dict[str, Any]:
    """Return the state of Python's, NumPy's, torch's CPU and (if used) CUDA generators."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                          "pos": int(pos), "has_gauss": int(has_gauss),
                          "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back into the state :func:`capture_rng` returned."""
    py = state["python"]
    internal = tuple(int(x) for x in py["state"].tolist())
    random.setstate((int(py["version"]), internal, py["gauss_next"]))
    torch.set_rng_state(state["torch"].cpu())
    np = _numpy()
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"],
                             s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = [t.cpu() for t in state["cuda"]]
        if len(saved) != torch.cuda.device_count():
            # A different GPU count: restore what overlaps; the rest keeps its seed.
            saved = saved[: torch.cuda.device_count()]
        for index, s in enumerate(saved):
            torch.cuda.set_rng_state(s, index)


def generator_states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [g.get_state() for g in generators]


def restore_generators(generators: list[torch.Generator], states: list[torch.Tensor]) -> None:
    for g, s in zip(generators, states):
        g.set_state(s)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
