"""Tensors inside module inputs and outputs: the containers FSDP2 looks into.

[Note: Containers]
A sharded module's inputs and outputs may hold tensors in lists, tuples, dicts,
NamedTuples and dataclass instances, nested. FSDP2 finds them there to hook the
backward (pre-backward on outputs, post-backward on inputs) and to cast them
(``MixedPrecisionPolicy``); a tensor it did not find would miss its hook, and
backward would then run a module whose parameters were never all-gathered.
``torch.utils._pytree`` knows no dataclass that was not registered with it, so
the walk here is its own. Containers are rebuilt only where a tensor in them was
replaced; everything else (and the object passed in, when nothing changed) is
returned as it is. Sets and other iterables are not entered, as FSDP2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.utils import _to_kwargs

__all__ = ["cast_floats", "elsewhere", "map_tensors", "tensors_in", "to_device"]

_MAX_DEPTH = 64


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields") and hasattr(x, "_asdict")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _children(x: Any) -> Iterator[Any] | None:
    """The values ``x`` holds, in a fixed order, or None for a leaf."""
    if _is_namedtuple(x) or isinstance(x, (list, tuple)):
        return iter(x)
    if _is_dataclass_instance(x):
        return (getattr(x, f.name) for f in dataclasses.fields(x))
    if isinstance(x, dict):
        return iter(x.values())
    return None


def _rebuild(x: Any, values: list[Any]) -> Any:
    """``x`` with its values (in ``_children`` order) replaced by ``values``."""
    if _is_namedtuple(x):
        return type(x)(*values)
    if isinstance(x, tuple):
        return tuple(values) if type(x) is tuple else type(x)(values)
    if isinstance(x, list):
        return values if type(x) is list else type(x)(values)
    if _is_dataclass_instance(x):
        names = [f.name for f in dataclasses.fields(x)]
        return dataclasses.replace(x, **dict(zip(names, values, strict=True)))
    new = x.copy()  # a dict, keeping its class (OrderedDict, defaultdict, ...)
    for key, value in zip(x, values, strict=True):
        new[key] = value
    return new


def _check_depth(x: Any, depth: int) -> None:
    if depth >= _MAX_DEPTH:
        raise RuntimeError(
            f"fsdp_rs: module inputs or outputs nest containers deeper than {_MAX_DEPTH} "
            f"(at a {type(x).__name__}); a container that holds itself cannot be walked"
        )


def tensors_in(tree: Any, keep: Callable[[torch.Tensor], bool] | None = None) -> list[torch.Tensor]:
    """The tensors in ``tree`` (those ``keep`` accepts), in traversal order."""
    found: list[torch.Tensor] = []

    def visit(x: Any, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            if keep is None or keep(x):
                found.append(x)
            return
        children = _children(x)
        if children is None:
            return
        _check_depth(x, depth)
        for child in children:
            visit(child, depth + 1)

    visit(tree, 0)
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` in it replaced by ``fn(t)``; containers
    are rebuilt only where ``fn`` returned another object."""

    # (the value, whether it changed): Dynamo traces this (the traced hooks
    # cast inputs with it), and it cannot tell two containers' identity apart
    def visit(x: Any, depth: int) -> tuple[Any, bool]:
        if isinstance(x, torch.Tensor):
            y = fn(x)
            return y, y is not x
        children = _children(x)
        if children is None:
            return x, False
        _check_depth(x, depth)
        visited = [visit(child, depth + 1) for child in children]
        if not any(changed for _, changed in visited):
            return x, False
        return _rebuild(x, [value for value, _ in visited]), True

    return visit(tree, 0)[0]


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype``
    (``MixedPrecisionPolicy.cast_forward_inputs`` and ``output_dtype``)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(cast, tree)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def elsewhere(inputs: tuple[tuple, dict], device: torch.device) -> bool:
    """Whether a tensor in the forward inputs is on another device than ``device``."""
    args, kwargs = inputs
    tensors = args if not kwargs and all(map(_is_tensor, args)) else tensors_in(inputs)
    return any(t.device != device for t in tensors)


def to_device(args: tuple, kwargs: dict, device: torch.device | None) -> tuple[tuple, dict]:
    """The root's forward inputs moved to the parameters' ``device``, as FSDP2
    (and DDP) move them: by torch's ``_to_kwargs``, so in the containers it
    enters (lists, tuples, dicts, NamedTuples, ``PackedSequence``; not
    dataclasses). Inputs already there are returned as they are. The eager and
    the traced root hooks both call this."""
    if device is None or not elsewhere((args, kwargs), device):
        return args, kwargs
    args_tuple, kwargs_tuple = _to_kwargs(args, kwargs, device, False)
    return args_tuple[0], kwargs_tuple[0]
