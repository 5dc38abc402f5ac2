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

State kept as plain tensors counts too (an EMA as ``[p.detach().clone() for p in
model.parameters()]``, updated in place; a running sum): a tensor, or a list, tuple or dict of
them, that none of the statefuls or ``ckpt.extras`` holds and that training changed in place
(its version counter moved) by the first safe point and again by the next one. Tensors made
once and never changed (the data), and a loop's variable bound to new ones every step (a
batch, which the collate wrote in place), are left out.
"""

from __future__ import annotations

import sysconfig
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["unsaved_statefuls", "describe_unsaved", "HeldTensors", "iterators_held"]


class HeldTensors:
    """Tensors the script holds in one variable (a tensor, or a list, tuple or dict of
    them), with a ``state_dict()`` so that the check fingerprints them like an object."""

    def __init__(self, obj: Any, tensors: dict[str, torch.Tensor]) -> None:
        self.obj = obj
        self.ids = {id(t) for t in tensors.values()}  # the script's own tensor objects
        self.tensors = {k: t.detach() for k, t in tensors.items()}  # sharing the versions
        self._versions = self._now()

    def changed_since_found(self) -> bool:
        """Whether training changed them in place since they were found: tensors a loop's
        variable held for one step (a batch's, written in place by the collate) did not."""
        return self._now() != self._versions

    def _now(self) -> list[int]:
        return [_version(t) for t in self.tensors.values()]

    @property
    def kind(self) -> str:
        if isinstance(self.obj, torch.Tensor):
            return "a tensor"
        n = len(self.tensors)
        return f"a {type(self.obj).__name__} of {n} tensor{'s' if n != 1 else ''}"

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

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
                      extras: Mapping[str, Any] | None = None) -> dict[str, tuple[Any, str]]:
    """Each object with a state the script's frames (from ``frame`` outwards) hold and no
    registered stateful (nor ``extras``) covers: its variable's name -> (the object, where it
    was found); tensors held in a variable as a :class:`HeldTensors`."""
    covered, tensors = _covered(registered.values())
    tensors.update(id(t) for t in _tensors_in(list((extras or {}).values()), depth=3))
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
            elif (held := _changed_tensors(obj, tensors)) is not None:
                found.setdefault(name, (held, where))
    return _without_aliases(found)


def _without_aliases(found: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]]:
    """Drop held tensors that another variable holds too (a loop's variable left pointing
    at one tensor of the list: ``for average, p in zip(ema, ...)``)."""
    held = {name: obj.ids for name, (obj, _) in found.items() if isinstance(obj, HeldTensors)}
    aliases = {name for name, ids in held.items()
               if any(other != name and (ids < more or (ids == more and other < name))
                      for other, more in held.items())}
    return {name: value for name, value in found.items() if name not in aliases}


def describe_unsaved(found: Mapping[str, tuple[Any, str]]) -> str:
    """'ema (AveragedModel, in main()), scaler (GradScaler, a global of train.py)'."""
    return ", ".join(f"{name} ({_kind(obj)}{', ' + where if where else ''})"
                     for name, (obj, where) in found.items())


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (nor training state)
        return 0


def _changed_in_place(t: torch.Tensor) -> bool:
    return _version(t) > 0


def _kind(obj: Any) -> str:
    return obj.kind if isinstance(obj, HeldTensors) else type(obj).__name__


def _tensors_in(obj: Any, depth: int = 2) -> list[torch.Tensor]:
    """The tensors of ``obj``: itself, or those in its lists, tuples and dicts (so deep)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth <= 0:
        return []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) \
        else ()
    return [t for item in items for t in _tensors_in(item, depth - 1)]


def _changed_tensors(obj: Any, covered: set[int]) -> HeldTensors | None:
    """``obj`` as held tensors if it is a tensor (or a list, tuple or dict of them, nothing
    else in it) that no stateful covers and that training changed in place."""
    if not isinstance(obj, (torch.Tensor, list, tuple, dict)) or isinstance(obj, torch.Size):
        return None
    if isinstance(obj, torch.Tensor):
        tensors = {"0": obj}
    elif isinstance(obj, dict):
        if not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            return None
        tensors = {str(k): v for k, v in obj.items()}
    else:
        if not obj or not all(isinstance(v, torch.Tensor) for v in obj):
            return None
        tensors = {str(i): v for i, v in enumerate(obj)}
    if any(id(t) in covered or isinstance(t, nn.Parameter) or t.requires_grad
           for t in tensors.values()):
        return None  # the model's own tensors, or ones autograd makes (a loss, a batch's)
    if not any(_changed_in_place(t) for t in tensors.values()):
        return None  # made once, never changed in place: data, a constant
    return HeldTensors(obj, tensors)


def _is_the_scripts(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: not a file of the script
        return filename == "<string>" or filename == "<stdin>"
    path = str(Path(filename).resolve())
    return not path.startswith(_PACKAGE) and not path.startswith(_LIBRARIES)


def _covered(registered: Any) -> tuple[set[int], set[int]]:
    """The ids of the registered objects (and of what they wrap), and of every parameter and
    buffer of the registered modules."""
    objects: set[int] = set()
    tensors: set[int] = set()
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


#: Iterators over a container of the script's (a list's, a range's): not where data comes from.
_CONTAINERS: tuple[Any, ...] = ([], (), range(0), "", b"", {}, {}.values(), {}.items(), set(),
                                 bytearray())
_CONTAINER_ITERATORS = frozenset(type(iter(x)).__name__ for x in _CONTAINERS)


def iterators_held(frame: types.FrameType | None) -> list[str]:
    """The iterators the script's loop frame holds (its variables, and the attributes of its
    ``self``): a loop that draws its batches from one (``next(data_iter)``) reads data that
    procckpt neither positions nor sees. Named as "data_iter (a _SingleProcessDataLoaderIter,
    in run())"."""
    if frame is None or not _is_the_scripts(frame.f_code.co_filename):
        return []
    where = frame.f_code.co_name
    where = f", in {where}()" if where != "<module>" else ""
    names = dict(frame.f_locals)
    owner = names.get("self")
    if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
        names.update({f"self.{k}": v for k, v in vars(owner).items()})
    return [f"{name} (a {type(obj).__name__}{where})" for name, obj in names.items()
            if _draws_data(obj)]


def _draws_data(obj: Any) -> bool:
    if not isinstance(obj, Iterator) or type(obj).__name__ in _CONTAINER_ITERATORS:
        return False
    module = type(obj).__module__ or ""
    return module.split(".")[0] != "procckpt" and type(obj).__name__ != "count"
