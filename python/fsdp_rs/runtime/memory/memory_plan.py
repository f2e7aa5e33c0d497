"""Predicted peak memory of a training step, before running it.

``predict_memory`` reads the group plans of a module sharded with fsdp-rs (on
any device, ``meta`` included: nothing is allocated) and runs the planner's
memory model ([Note: Memory model] in ``rust/planner/src/memory.rs``) over them;
``activation_profile`` (``activation_profile.py``) measures what the forward
and the loss leave for backward, the input the planner cannot know from the
parameters. Together they tell a user whether a step fits before it runs;
``python -m fsdp_rs.bench memory`` prints the prediction next to the measured
peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from torch import nn

from fsdp_rs.planning import peak_memory
from fsdp_rs.runtime.comm import streams
from fsdp_rs.runtime.group.params import state_of
from fsdp_rs.runtime.memory.activation_profile import ActivationProfile, Activations

__all__ = ["group_memory", "predict_memory"]

BACKWARD_PREFETCH = 1  # FSDP2's default: one group's all-gather ahead in backward


def _fqns(module: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in module.named_modules()}


def _states(module) -> list:
    """The fsdp-rs states under ``module`` (an ``FSDPModule``) with a parameter
    group, in module order (the order their groups first run forward in a
    sequential model)."""
    return [state for state in module._states(recurse=True) if state.group is not None]


def _resharded(state, root) -> tuple[bool, int]:
    """(all-gathers again in backward, rows of ``[W, S]`` kept from forward):
    the group's setting once lazy init made it, else what lazy init will make."""
    group = state.group
    if state.context is not None:
        raf = group.reshard_after_forward
    else:
        raf = state.default_reshard_after_forward(root)
    world = group.info.shard_size
    if raf is True or raf == world:
        return True, 0
    if raf is False or raf == 1 or world == 1:
        return False, world
    return True, world // int(raf)


def _group_bytes(group, resharded: bool, rows: int) -> dict[str, int]:
    """One group's byte counts on its compute device, from its plan and, for
    the gradients, the plan of its trained parameters (``grad_layout``). With
    CPU offload the sharded parameters and gradients live on the host: none of
    their bytes are on an accelerator."""
    plan = group.plan
    grads = group.grad_layout.plan if any(group.requires_grad) else None
    on_device = group.shard_device == group.device
    out = {
        "sharded_bytes": plan.sharded_bytes if on_device else 0,
        "all_gather_bytes": plan.all_gather_bytes,
        "unsharded_bytes": plan.unsharded_bytes,
        "reduce_scatter_input_bytes": 0,
        "reduce_scatter_output_bytes": 0,
        "gradient_bytes": 0,
        "unsharded_gradient_bytes": 0,
        # kept between micro-steps in the reduce dtype ([Note: Reduction memory])
        "accumulated_gradient_bytes": 0,
        "post_forward_bytes": rows * plan.row_numel * plan.param_elem_size if resharded else 0,
        "kept_unsharded_bytes": 0,
    }
    if group.keep_unsharded_storage:  # live through the step, never freed by reshard
        out["kept_unsharded_bytes"], out["unsharded_bytes"] = plan.unsharded_bytes, 0
    if grads is not None:
        out["reduce_scatter_input_bytes"] = grads.reduce_scatter_input_bytes
        out["reduce_scatter_output_bytes"] = grads.reduce_scatter_output_bytes
        # the sharded and the accumulated gradients in their own dtypes (the
        # original and the reduce dtype unless [Note: Gradient dtype policy])
        sharded_grad_bytes = grads.row_numel * group.grad_dtype.itemsize
        out["gradient_bytes"] = sharded_grad_bytes if on_device else 0
        # in the compute dtype, also where autograd casts them to a narrower
        # grad_dtype: it computes each in the compute dtype first
        out["unsharded_gradient_bytes"] = grads.unsharded_bytes
        out["accumulated_gradient_bytes"] = grads.unsharded_numel * group.accumulate_dtype.itemsize
    return out


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
            "reduce_scatter_kept_bytes",
            "gradient_bytes",
            "unsharded_gradient_bytes",
            "accumulated_gradient_bytes",
            "post_forward_bytes",
            "kept_unsharded_bytes",
            "reshard_after_forward",
            "fqns",
        )
    }
    for state in states:
        resharded, rows = _resharded(state, root)
        # A module with parameters of several dtypes has one group per dtype
        # ([Note: One group per dtype]): one entry, their sum.
        members = getattr(state.group, "groups", (state.group,))
        bytes_of = [_group_bytes(group, resharded, rows) for group in members]
        for name in bytes_of[0]:
            columns[name].append(sum(b[name] for b in bytes_of))
        # they reduce in turn, each releasing the input the one before kept
        inputs = [b["reduce_scatter_input_bytes"] for b in bytes_of]
        columns["reduce_scatter_kept_bytes"].append(next((i for i in reversed(inputs) if i), 0))
        columns["reshard_after_forward"].append(resharded)
        columns["fqns"].append(tuple(name_of.get(id(m), "") for m in state.modules))
    return columns


def predict_memory(
    module: nn.Module,
    *,
    activations: ActivationProfile | Mapping[str, Activations | int] | None = None,
    resident_bytes: int = 0,
    accumulate: bool = False,
    prefetch: int = BACKWARD_PREFETCH,
) -> dict[str, int]:
    """Predicted bytes of one training step of ``module`` on this rank's
    compute device (with CPU offload, what lives on the host is left out): keys
    ``persistent`` (sharded parameters plus ``resident_bytes``), ``forward`` and
    ``backward`` (the most held on top of that in each pass) and ``peak``.

    ``activations``: an ``activation_profile`` of the model, or its ``blocks``
    alone: per fully_shard module, keyed by module name, what its forward
    leaves for backward and the most its backward holds (an int is saved
    bytes alone; without ``backward`` bytes the model adds up the saved
    bytes, the gradients and those flowing in and out). A name that is not a
    fully_shard module raises ValueError; the activations of a fully_shard
    module without parameters of its own count as live for the whole step.

    ``resident_bytes``: whatever else stays live through the step (optimizer
    states, inputs). ``accumulate``: the step accumulates gradients over
    micro-steps with ``set_requires_gradient_sync(False)``. ``prefetch``:
    all-gathers in flight ahead of backward (FSDP2's default, 1, unless
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
    kept = sum(columns.pop("kept_unsharded_bytes"))  # set_keep_unsharded_storage
    saved, outputs = [0] * len(fqns), [0] * len(fqns)
    # per group, each module's measured backward above its own saved bytes
    # (None: one was not measured)
    above: list[list[int] | None] = [[] for _ in fqns]
    extra = loss = 0
    if isinstance(activations, ActivationProfile):
        activations, loss = activations.blocks, activations.loss
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
            g = index[name]
            saved[g] += block.saved
            outputs[g] += block.output
            if block.backward and above[g] is not None:
                above[g].append(block.backward - block.saved)
            else:
                above[g] = None
        elif name in sharded_modules:
            extra += block.saved
        else:
            raise ValueError(
                f"activations names {name!r}, which is not a fully_shard module of "
                f"{type(module).__name__}: key it by the names of the modules fully_shard "
                "was called on (activation_profile does)"
            )
    # A group of several modules: while one runs its backward, the others'
    # saved bytes are still live (or already freed: counted, to be safe).
    backward = [saved[g] + max(a) if a else 0 for g, a in enumerate(above)]
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
        backward_bytes=np.asarray(backward, dtype=np.int64),
        resident_bytes=resident_bytes + extra + kept,
        loss_bytes=loss,
        accumulate=accumulate,
        side_streams=_side_streams(module),
        **arrays,
    )


def _side_streams(module: nn.Module) -> bool:
    """Whether the step runs its collectives on side streams, which keep
    tensors used across streams alive longer ([Note: Cross-stream lifetimes]):
    on an accelerator (the device module looked up where ``CommStreams`` looks
    it up, so that tests/stream_sim.py's simulated device counts too)."""
    for state in _states(module):
        if state.context is not None:
            return state.context.streams.enabled
        return streams.device_module(state.group.device) is not None
    return False
