"""``auto_shard``: ``fully_shard`` a whole model in groups the planner chooses.

FSDP1 had ``auto_wrap_policy``; FSDP2 leaves the grouping to the user, who
calls ``fully_shard`` per block. For a model of thousands of small modules that
means either thousands of groups, each paying its hooks and collectives every
step (pytorch/pytorch#173680), or grouping by hand. ``auto_shard`` picks the
modules (units), orders them, and lets the Rust planner merge consecutive ones
into groups of at most ``group_bytes`` unsharded bytes ([Note: Module grouping]
in ``rust/planner/src/modules.rs``); each group is one ``fully_shard([...])``
call, so it trains exactly as the same grouping done by hand.

[Note: Grouping units]
A unit is a module whose whole subtree is sharded together: walking the model
from the root in registration order, a child whose not-yet-sharded parameters
fit in ``group_bytes`` is one unit; a larger child is split into its children
(its own direct parameters then go to the root's group, as with a hand-written
per-block ``fully_shard``), except where none of its children holds parameters
to shard (a large ``nn.Linear``): nothing smaller is left, so it is a unit of
its own, over the budget, and the planner gives it a group alone. A module the
user already passed to ``fully_shard`` keeps its group: the walk does not enter
it, and no group spans it. Containers
without a forward (``ModuleList``, ``ModuleDict``) are never units; their
elements are. Modules without parameters to shard are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from fsdp_rs._core import module_groups
from fsdp_rs.runtime.api.fully_shard import FSDPModule, fully_shard, is_managed
from fsdp_rs.runtime.api.policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["DEFAULT_GROUP_BYTES", "auto_shard", "auto_shard_groups"]

DEFAULT_GROUP_BYTES = 1 << 27
"""128 MiB of unsharded parameters per group: about one transformer block of a
7B model in bf16; a step holds about two groups unsharded at a time."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _check_args(module: nn.Module, group_bytes: Any, example_inputs: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"auto_shard: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"auto_shard: {type(module).__name__} was already passed to fully_shard; call "
            "auto_shard on the model before sharding its root"
        )
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, int):
        raise TypeError(
            f"auto_shard: group_bytes must be an int (bytes), got {type(group_bytes).__name__}"
        )
    if group_bytes < 1:
        raise ValueError(f"auto_shard: group_bytes must be >= 1, got {group_bytes}")
    if example_inputs is not None and not isinstance(example_inputs, tuple | dict):
        raise TypeError(
            "auto_shard: example_inputs must be a tuple of positional arguments or a dict of "
            f"keyword arguments for the model's forward, got {type(example_inputs).__name__}"
        )


def _param_bytes(
    module: nn.Module, ignored: set[int], param_dtype: torch.dtype | None, seen: set[int]
) -> int:
    """Unsharded bytes of the parameters in ``module``'s subtree that no
    ``fully_shard`` took yet and that are not ignored; ``seen`` (ids) counts a
    shared parameter once."""
    total = 0
    for p in module.parameters():
        if id(p) in seen or id(p) in ignored or is_managed(p):
            continue
        seen.add(id(p))
        size = p.element_size()
        if param_dtype is not None and p.is_floating_point():
            size = param_dtype.itemsize
        total += p.numel() * size
    return total


def _has_sharded(module: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _splits(module: nn.Module, ignored: set[int], param_dtype: torch.dtype | None) -> bool:
    """Whether some child of ``module`` holds parameters to shard."""
    return any(_param_bytes(c, ignored, param_dtype, set()) for c in module.children())


def _units(
    module: nn.Module, group_bytes: int, ignored: set[int], param_dtype: torch.dtype | None
) -> list[tuple[nn.Module | None, int]]:
    """``(unit, bytes)`` in registration order; ``(None, 0)`` marks a module
    the user sharded (a boundary). See [Note: Grouping units]."""
    out: list[tuple[nn.Module | None, int]] = []
    for child in module.children():
        if isinstance(child, FSDPModule):
            out.append((None, 0))
            continue
        size = _param_bytes(child, ignored, param_dtype, set())
        if size == 0 and not _has_sharded(child):
            continue
        whole = not isinstance(child, _CONTAINERS) and not _has_sharded(child)
        if whole and (size <= group_bytes or not _splits(child, ignored, param_dtype)):
            out.append((child, size))
        else:
            out.extend(_units(child, group_bytes, ignored, param_dtype))
    return out


def _forward_order(model: nn.Module, units: list[nn.Module], example_inputs: Any) -> list[int]:
    """Each unit's position in the order one forward of ``example_inputs``
    first called it (not called: after those that were, in registration
    order). The forward runs without gradients and changes nothing else."""
    first: dict[int, int] = {}

    def record(module: nn.Module, args: Any) -> None:
        first.setdefault(id(module), len(first))

    handles = [u.register_forward_pre_hook(record) for u in units]
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            else:
                model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    late = len(units)
    return [first.get(id(u), late + i) for i, u in enumerate(units)]


def auto_shard_groups(
    module: nn.Module,
    *,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    example_inputs: tuple | dict | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> list[list[nn.Module]]:
    """The groups ``auto_shard`` would make, without sharding anything: lists of
    modules, each list one ``fully_shard`` call, in the order they run (the
    root's own group, made last, is not listed)."""
    _check_args(module, group_bytes, example_inputs)
    param_dtype = mp_policy.param_dtype if mp_policy is not None else None
    ignored = {id(p) for p in ignored_params or ()}
    entries = _units(module, group_bytes, ignored, param_dtype)
    boundary, units, sizes = False, [], []
    boundaries = []
    for unit, size in entries:
        if unit is None:
            boundary = True
            continue
        units.append(unit)
        sizes.append(size)
        boundaries.append(boundary)
        boundary = False
    if example_inputs is not None and units:
        if any(unit is None for unit, _ in entries):
            # The recording forward would run those modules' hooks before the
            # root is sharded, making each of them a root of its own.
            raise ValueError(
                "auto_shard: example_inputs cannot order a model some of whose modules were "
                "already passed to fully_shard (the recording forward would initialize them "
                "as roots): call fully_shard on them after auto_shard_groups, or leave out "
                "example_inputs to group in registration order"
            )
        order = np.argsort(_forward_order(module, units, example_inputs), kind="stable")
        units = [units[i] for i in order]
        sizes = [sizes[i] for i in order]
    sizes_array = np.asarray(sizes, dtype=np.int64)
    ids = module_groups(sizes_array, np.asarray(boundaries, dtype=bool), group_bytes)
    groups: list[list[nn.Module]] = []
    for unit, gid in zip(units, ids.tolist(), strict=True):
        if gid == len(groups):
            groups.append([])
        groups[gid].append(unit)
    return groups


def auto_shard(
    module: nn.Module,
    *,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    example_inputs: tuple | dict | None = None,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """``fully_shard`` ``module`` in groups of consecutive submodules of at most
    ``group_bytes`` unsharded bytes each (a single larger module alone), then
    its root; returns ``module``.

    Modules already passed to ``fully_shard`` keep their groups. Consecutive
    means registration order, or with ``example_inputs`` (a tuple of positional
    or a dict of keyword arguments) the order one forward of them (run here
    without gradients) calls the modules. The other arguments are
    ``fully_shard``'s, given to every call. The groups are
    ``auto_shard_groups(...)``; training is bit for bit that of the same
    ``fully_shard`` calls written by hand."""
    groups = auto_shard_groups(
        module,
        group_bytes=group_bytes,
        example_inputs=example_inputs,
        mp_policy=mp_policy if isinstance(mp_policy, MixedPrecisionPolicy) else None,
        ignored_params=ignored_params,
    )
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
    )
    for group in groups:
        fully_shard(group if len(group) > 1 else group[0], **kwargs)
    fully_shard(module, **kwargs)
    return module
