"""Stateful objects the training loop holds that no checkpoint does: a resume starts them afresh.

A script can keep state the Checkpointer was never given: an EMA or ``AveragedModel`` of the
weights, a second optimizer, a ``GradScaler``, a metric with buffers. A resume restores
everything it was given and builds these anew, so they differ from an uninterrupted run without
an error anywhere. They are found where the script keeps them: the variables of the frames
running the training loop (the script's own frames, not procckpt's, the standard library's or
an installed package's) and the globals of their modules. An object counts when it has
``state_dict()`` and ``load_state_dict()`` and holds state that none of the Checkpointer's
statefuls covers: a module whose parameters and buffers all belong to a registered module (a
submodule, a ``DistributedDataParallel`` or ``torch.compile`` wrapper) is covered, and so is a
wrapper of a registered optimizer or scheduler. Modules without parameters or buffers (a loss)
and data loaders and data sets (their position is procckpt's business) are left out.
"""

from __future__ import annotations

import sysconfig
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["unsaved_statefuls", "describe_unsaved"]

#: Attributes through which a wrapper holds what it wraps (DDP/FSDP and compile: module and
#: _orig_mod; Accelerate's optimizer and scheduler wrappers) ...
_WRAPPED = ("module", "_orig_mod", "optimizer", "scheduler")
#: ... and through which a registered holder of several holds them (procckpt.Sharded).
_HELD = ("model", "optimizers")
_PACKAGE = str(Path(__file__).resolve().parents[1])
_LIBRARIES = tuple(sorted({str(Path(p).resolve()) for key in ("stdlib", "platstdlib",
                                                              "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(key))}, key=len, reverse=True))


def unsaved_statefuls(registered: Mapping[str, Any], frame: types.FrameType | None,
                      ) -> dict[str, tuple[Any, str]]:
    """Each object with a state the script's frames (from ``frame`` outwards) hold and no
    registered stateful covers: its variable's name -> (the object, where it was found)."""
    covered, tensors = _covered(registered.values())
    found: dict[str, tuple[Any, str]] = {}
    seen: set[int] = set()
    scopes: list[tuple[dict[str, Any], str]] = []
    modules: list[tuple[dict[str, Any], str]] = []
    while frame is not None:
        if _is_the_scripts(frame.f_code.co_filename):
            where = frame.f_code.co_name
            scopes.append((frame.f_locals, f"in {where}()" if where != "<module>" else ""))
            modules.append((frame.f_globals, f"a global of {Path(frame.f_code.co_filename).name}"))
        frame = frame.f_back
    for names, where in [*scopes, *modules]:
        for name, obj in list(names.items()):
            if id(obj) in seen or name.startswith("__"):
                continue
            seen.add(id(obj))
            if _holds_unsaved_state(obj, covered, tensors):
                found.setdefault(name, (obj, where))
    return found


def describe_unsaved(found: Mapping[str, tuple[Any, str]]) -> str:
    """'ema (AveragedModel, in main()), scaler (GradScaler, a global of train.py)'."""
    return ", ".join(f"{name} ({type(obj).__name__}{', ' + where if where else ''})"
                     for name, (obj, where) in found.items())


def _is_the_scripts(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: not a file of the script
        return filename == "<string>" or filename == "<stdin>"
    path = str(Path(filename).resolve())
    return not path.startswith(_PACKAGE) and not path.startswith(_LIBRARIES)


def _covered(registered: Any) -> tuple[set[int], set[int]]:
    """The ids of the registered objects (and of what they wrap), and of every parameter and
    buffer of the registered modules."""
    objects, tensors = set(), set()
    for obj in registered:
        held = [getattr(obj, a, None) for a in (*_WRAPPED, *_HELD)]
        for inner in (obj, *held, *(x for h in held if isinstance(h, (list, tuple)) for x in h)):
            if inner is None or isinstance(inner, (list, tuple)):
                continue
            objects.add(id(inner))
            if isinstance(inner, nn.Module):
                tensors.update(id(t) for t in (*inner.parameters(), *inner.buffers()))
    return objects, tensors


def _holds_unsaved_state(obj: Any, covered: set[int], tensors: set[int]) -> bool:
    if isinstance(obj, (type, types.ModuleType, DataLoader, Dataset)) \
            or not callable(getattr(obj, "state_dict", None)) \
            or not callable(getattr(obj, "load_state_dict", None)) \
            or type(obj).__module__.split(".")[0] == "procckpt":
        return False
    if id(obj) in covered or any(id(getattr(obj, a, None)) in covered for a in _WRAPPED):
        return False
    if isinstance(obj, nn.Module):
        held = [*obj.parameters(), *obj.buffers()]
        return bool(held) and not all(id(t) in tensors for t in held)
    if hasattr(obj, "__iter__") or hasattr(obj, "__next__"):
        return False  # a stateful loader or data set: the data position is procckpt's
    try:
        state = obj.state_dict()
    except Exception:  # not ours to judge: a state_dict() that needs arguments, say
        return False
    return bool(state)  # a disabled GradScaler's is empty
