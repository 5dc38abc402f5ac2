"""The state the first step after a resume starts from: is it the one the checkpoint holds?

A resume restores the model and the optimizer, and then the script or its framework runs until
the first step. A framework that was never told to load the checkpoint (Lightning's ``fit()``
without ``ckpt_path``, the Trainer's ``train()`` without ``resume_from_checkpoint``) trains a
fresh model from step 0 while the data position says otherwise; a script that re-initialises
the weights or loads pretrained ones after the Checkpointer restored them does the same. The
resume audit (audit.py) catches these: at the resume it takes a fingerprint of every tensor of
the state as restored (as the checkpoint holds it, where a framework loads it itself), and when
the first step begins it takes one of the live state and compares them, tensor by tensor, with
the framework's own step counter beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .contents import fingerprint

__all__ = ["StateExpectation", "state_prints", "restored_state", "ADVICE"]

#: What a difference in a script's own loop usually means.
ADVICE = ("the script changed them after procckpt.Checkpointer restored them (weights "
          "initialised or pretrained weights loaded after the Checkpointer was made): make the "
          "Checkpointer last, or load pretrained weights only when ckpt.resumed_from is None")

#: A part's leaves: a tensor's fingerprint with its dtype and shape, or a counter's value.
Prints = dict[str, tuple[int, str]]


@dataclass
class StateExpectation:
    """The state as restored (``restored``: each tensor's fingerprint and each counter's value,
    by name), how to read the same parts live, and what a difference usually means."""

    restored: Prints
    live: Callable[[], Mapping[str, Any]]
    advice: str = ADVICE
    counters: frozenset[str] = field(default_factory=frozenset)

    def problem(self, checkpoint: str, step: int) -> str | None:
        """What differs between the live state and the restored one, in one sentence; None
        when nothing does (only names both hold are compared)."""
        now = state_prints(self.live(), self.counters)
        # A tensor cast or reshaped since (model.half() after the Checkpointer): its values
        # cannot be compared by fingerprint, and casting is no sign of a missed load.
        common = [name for name in self.restored
                  if name in now and now[name][1] == self.restored[name][1]]
        counters = [n for n in common if n in self.counters and now[n] != self.restored[n]]
        tensors = [n for n in common if n not in self.counters and now[n] != self.restored[n]]
        if not counters and not tensors:
            return None
        parts = []
        if tensors:
            total = len([n for n in common if n not in self.counters])
            shown = ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "")
            parts.append(f"{len(tensors)} of {total} tensors differ from those {checkpoint} "
                         f"holds ({shown})")
        parts.extend(f"{name} is {now[name][0]}, not {self.restored[name][0]}"
                     for name in counters)
        return (f"the state step {step + 1} starts from is not the one it resumed from: "
                f"{'; '.join(parts)}. {self.advice[0].upper()}{self.advice[1:]}")


def state_prints(parts: Mapping[str, Any], counters: frozenset[str] = frozenset(),
                 known: Mapping[int, tuple[int, int]] | None = None) -> Prints:
    """Every tensor in ``parts`` (state dicts, nested), by its path ("model.fc.weight",
    "optimizer.state.0.exp_avg"), as its fingerprint; the top-level ``counters`` as values.
    ``known``: fingerprints taken already, by the ``id`` of the tensor, with its address
    (mapped.py takes those of the copies a restore makes)."""
    found: Prints = {}
    for name, value in parts.items():
        if name in counters:
            if isinstance(value, int) and not isinstance(value, bool):
                found[name] = (value, "counter")
            continue
        _leaves(value, name, found, known or {})
    return found


def _leaves(value: Any, path: str, found: Prints, known: Mapping[int, tuple[int, int]]) -> None:
    if isinstance(value, torch.Tensor):
        taken = known.get(id(value))
        crc = taken[1] if taken is not None and taken[0] == value.data_ptr() \
            else fingerprint(value).crc
        found[path] = (crc, f"{value.dtype}{tuple(value.shape)}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _leaves(item, f"{path}.{key}", found, known)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _leaves(item, f"{path}.{i}", found, known)


def audited(obj: Any) -> bool:
    """Whether a stateful's state is compared at the first step: a model or an optimizer
    (their wrappers included)."""
    return isinstance(obj, (nn.Module, torch.optim.Optimizer))


def restored_state(statefuls: Mapping[str, Any], payload: Mapping[str, Any],
                   known: Mapping[int, tuple[int, int]] | None = None,
                   ) -> tuple[Prints, frozenset[str], str | None]:
    """The state a resume restored, fingerprinted right after the restore: the models' and
    optimizers' state dicts as loaded, and for a framework that loads its checkpoint itself,
    the parts of the payload it names (``procckpt_audited_keys``). Returns the prints, the
    counters among them, and a framework's advice (None for a script's own loop). ``known``:
    fingerprints the restore took as it copied (see :func:`state_prints`)."""
    prints: Prints = {}
    counters: frozenset[str] = frozenset()
    advice = None
    for name, obj in statefuls.items():
        keys = getattr(obj, "procckpt_audited_keys", None)
        if keys is not None:
            counters = counters | frozenset(getattr(obj, "procckpt_audited_counters", ()))
            prints.update(state_prints({k: payload.get(k) for k in keys}, counters))
            advice = getattr(obj, "procckpt_audit_advice", None)
        elif audited(obj):
            prints.update(state_prints({name: obj.state_dict()}, known=known))
    return prints, counters, advice


def live_state(statefuls: Mapping[str, Any]) -> dict[str, Any]:
    """The parts :func:`restored_state` fingerprinted, as they are now."""
    parts: dict[str, Any] = {}
    for name, obj in statefuls.items():
        live = getattr(obj, "procckpt_audited_state", None)
        if callable(live):
            parts.update(live())
        elif audited(obj):
            parts[name] = obj.state_dict()
    return parts
