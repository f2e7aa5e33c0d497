"""Predicted peak memory of a training step, before running it.

``predict_memory`` reads the group plans of a module sharded with fsdp-rs (on
any device, ``meta`` included: nothing is allocated) and runs the planner's
memory model ([Note: Memory model] in ``rust/planner/src/memory.rs``) over them;
``saved_activation_bytes`` counts what autograd saves per block in one forward,
the input the planner cannot know from the parameters. Together they tell a
user whether a step fits before it runs; ``python -m fsdp_rs.bench memory``
prints the prediction next to the measured peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_rs.planning import peak_memory
from fsdp_rs.runtime.params import state_of
from fsdp_rs.runtime.streams import device_module

__all__ = ["Activations", "group_memory", "predict_memory", "saved_activation_bytes"]

BACKWARD_PREFETCH = 1  # FSDP2's default: one group's all-gather ahead in backward


def _fqns(module: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in module.named_modules()}


def _states(module: nn.Module) -> list:
    """The fsdp-rs states under ``module`` with a parameter group, in module order
    (the order their groups first run forward in a sequential model)."""
    seen, out = set(), []
    for m in module.modules():
        state = state_of(m)
        if state is not None and state.group is not None and id(state) not in seen:
            seen.add(id(state))
            out.append(state)
    return out


def _resharded(state, root) -> tuple[bool, int]:
    """(all-gathers again in backward, rows of ``[W, S]`` kept from forward)."""
    group = state.group
    raf = group.reshard_after_forward if state.context is not None else None
    if raf is None:
        arg = state.reshard_after_forward_arg
        raf = (state is not root) if arg is None else arg
    world = group.info.shard_size
    if raf is True or raf == world:
        return True, 0
    if raf is False or raf == 1 or world == 1:
        return False, world
    return True, world // int(raf)


def group_memory(module: nn.Module) -> dict[str, Any]:
    """Per-group byte counts of ``module`` (sharded with fsdp-rs) on this rank,
    in forward order: the arrays ``peak_memory`` takes, plus ``fqns`` (the
    modules of each group) and ``reshard_after_forward``."""
    root = state_of(module)
    states = _states(module)
    name_of = _fqns(module)
    columns: dict[str, list] = {
        k: []
        for k in (
            "sharded_bytes",
            "all_gather_bytes",
            "unsharded_bytes",
            "reduce_scatter_input_bytes",
            "reduce_scatter_output_bytes",
            "gradient_bytes",
            "unsharded_gradient_bytes",
            "accumulated_gradient_bytes",
            "post_forward_bytes",
            "reshard_after_forward",
            "fqns",
        )
    }
    for state in states:
        group, plan = state.group, state.group.plan
        trained = any(group.requires_grad)
        grads = group.grad_layout.plan if trained else None
        resharded, rows = _resharded(state, root)
        row_bytes = plan.row_numel * plan.param_elem_size
        columns["sharded_bytes"].append(plan.sharded_bytes)
        columns["all_gather_bytes"].append(plan.all_gather_bytes)
        columns["unsharded_bytes"].append(plan.unsharded_bytes)
        # Gradients exist for the trained parameters only (grad_layout's plan).
        for name, value in (
            ("reduce_scatter_input_bytes", "reduce_scatter_input_bytes"),
            ("reduce_scatter_output_bytes", "reduce_scatter_output_bytes"),
            ("gradient_bytes", "sharded_bytes"),
            ("unsharded_gradient_bytes", "unsharded_bytes"),
        ):
            columns[name].append(getattr(grads, value) if grads is not None else 0)
        # Kept between micro-steps in the reduce dtype ([Note: Reduction memory]).
        accumulated = grads.unsharded_numel * grads.reduce_elem_size if trained else 0
        columns["accumulated_gradient_bytes"].append(accumulated)
        columns["post_forward_bytes"].append(rows * row_bytes if resharded else 0)
        columns["reshard_after_forward"].append(resharded)
        columns["fqns"].append(tuple(name_of.get(id(m), "") for m in state.modules))
    return columns


def predict_memory(
    module: nn.Module,
    *,
    activations: Mapping[str, Activations | int] | None = None,
    resident_bytes: int = 0,
    accumulate: bool = False,
    prefetch: int = BACKWARD_PREFETCH,
) -> dict[str, int]:
    """Predicted bytes of one training step of ``module`` on this rank: keys
    ``persistent`` (sharded parameters plus ``resident_bytes``), ``forward`` and
    ``backward`` (the most held on top of that in each pass) and ``peak``.

    ``activations``: per fully_shard module, keyed by module name, what its
    forward leaves for backward (``saved_activation_bytes`` counts it; an int
    is saved bytes alone). A name that is not a fully_shard module raises
    ValueError; the activations of a fully_shard module without parameters of
    its own count as live for the whole step. ``resident_bytes``: whatever else
    stays live through the step (optimizer states, inputs). ``accumulate``: the
    step accumulates gradients over micro-steps with
    ``set_requires_gradient_sync(False)``. ``prefetch``: all-gathers in flight
    ahead of backward (FSDP2's default, 1, unless
    ``set_modules_to_backward_prefetch`` changed it).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if state_of(module) is None:
        raise ValueError(
            f"{type(module).__name__} is not sharded with fsdp_rs.fully_shard: call "
            "fully_shard on it (and on its blocks) first; a model on the meta device will do"
        )
    columns = group_memory(module)
    fqns = columns.pop("fqns")
    raf = columns.pop("reshard_after_forward")
    saved, outputs = [0] * len(fqns), [0] * len(fqns)
    extra = 0
    index = {name: g for g, names in enumerate(fqns) for name in names}
    sharded_modules = {name for name, m in module.named_modules() if state_of(m) is not None}
    for name, value in (activations or {}).items():
        block = Activations(value, 0) if isinstance(value, int) else value
        if not isinstance(block, Activations) or min(block) < 0:
            raise ValueError(
                f"activations[{name!r}] must be an int >= 0 or an Activations of them, "
                f"got {value!r}"
            )
        if name in index:
            saved[index[name]] += block.saved
            outputs[index[name]] += block.output
        elif name in sharded_modules:
            extra += block.saved
        else:
            raise ValueError(
                f"activations names {name!r}, which is not a fully_shard module of "
                f"{type(module).__name__}: key it by the names of the modules fully_shard "
                "was called on (saved_activation_bytes does)"
            )
    arrays = {k: np.asarray(v, dtype=np.int64) for k, v in columns.items()}
    return peak_memory(
        arrays.pop("sharded_bytes"),
        arrays.pop("all_gather_bytes"),
        arrays.pop("unsharded_bytes"),
        arrays.pop("reduce_scatter_input_bytes"),
        arrays.pop("reduce_scatter_output_bytes"),
        prefetch=prefetch,
        reshard_after_forward=np.asarray(raf, dtype=bool),
        activation_bytes=np.asarray(saved, dtype=np.int64),
        output_bytes=np.asarray(outputs, dtype=np.int64),
        resident_bytes=resident_bytes + extra,
        accumulate=accumulate,
        side_streams=_side_streams(module),
        **arrays,
    )


def _side_streams(module: nn.Module) -> bool:
    """Whether the step runs its collectives on side streams, which keep an
    all-gather output until the next group's copy-out ([Note: Cross-stream
    lifetimes]): on an accelerator, as FSDP2 does on every device."""
    for state in _states(module):
        if state.context is not None:
            return state.context.streams.enabled
        return device_module(state.group.device) is not None
    return False


class Activations(NamedTuple):
    """What one block's forward leaves for backward: ``saved``, the bytes
    autograd saves until the block's backward; ``output``, the bytes of its
    outputs that require grad (the gradient flowing into its backward)."""

    saved: int
    output: int


def _is_grad_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def saved_activation_bytes(
    module: nn.Module, blocks: Sequence[nn.Module], *args: Any, **kwargs: Any
) -> dict[str, int]:
    """Bytes autograd saves for backward during ``module(*args, **kwargs)``, per
    block: each saved storage counts once, for the innermost block running when
    it is first saved (it lives until that block's backward, the last to use
    it). Parameters, buffers and the inputs do not count. Run it on a copy of
    the model on the ``meta`` device (with meta inputs, cast to the compute
    dtype of a mixed-precision policy) so that nothing is allocated. Keys: the
    blocks' names in ``module``."""
    name_of = _fqns(module)
    missing = [type(b).__name__ for b in blocks if id(b) not in name_of]
    if missing:
        raise ValueError(f"blocks must be submodules of module; not: {', '.join(missing)}")
    known = {_storage_key(t) for t in (*module.parameters(), *module.buffers())}
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            known.add(_storage_key(x))
    out = {name_of[id(b)]: Activations(0, 0) for b in blocks}
    active: list[str] = []
    counted: set[int] = set(known)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in counted and active:
            counted.add(key)
            name = active[-1]
            out[name] = out[name]._replace(saved=out[name].saved + t.untyped_storage().nbytes())
        return t

    def enter(name: str):
        def hook(*unused: Any) -> None:
            active.append(name)

        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        name = active.pop()
        sizes = [t.nbytes for t in torch.utils._pytree.tree_leaves(output) if _is_grad_tensor(t)]
        out[name] = out[name]._replace(output=out[name].output + sum(sizes))

    with contextlib.ExitStack() as stack:
        for b in blocks:
            name = name_of[id(b)]
            stack.callback(b.register_forward_pre_hook(enter(name)).remove)
            stack.callback(b.register_forward_hook(leave).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        module(*args, **kwargs)
    return out
