"""CPU, CUDA and fake impls of the five group copies.

CPU impls are the plain-torch references (also the test oracle); CUDA impls are
the Triton kernels, one launch each; fake impls run the same O(1) argument checks
and return nothing, as the ops only mutate their outputs.
"""

from __future__ import annotations

import functools

import torch

from fsdp_rs.kernels import all_gather_copy_in as copy_in
from fsdp_rs.kernels import all_gather_copy_out as copy_out
from fsdp_rs.kernels import post_reduce as post
from fsdp_rs.kernels import reduce_scatter_copy_in as rs_copy_in
from fsdp_rs.kernels import reduce_scatter_copy_in_flat as rs_copy_in_flat
from fsdp_rs.ops._library import LIB, NAMESPACE

__all__ = ["EagerOps"]

_IMPLS = {
    "all_gather_copy_in": (
        copy_in.torch_all_gather_copy_in,
        copy_in.triton_all_gather_copy_in,
        copy_in.check_all_gather_copy_in,
    ),
    "all_gather_copy_out": (
        copy_out.torch_all_gather_copy_out,
        copy_out.triton_all_gather_copy_out,
        copy_out.check_all_gather_copy_out,
    ),
    "reduce_scatter_copy_in": (
        rs_copy_in.torch_reduce_scatter_copy_in,
        rs_copy_in.triton_reduce_scatter_copy_in,
        rs_copy_in.check_reduce_scatter_copy_in,
    ),
    "reduce_scatter_copy_in_flat": (
        rs_copy_in_flat.torch_reduce_scatter_copy_in_flat,
        rs_copy_in_flat.triton_reduce_scatter_copy_in_flat,
        rs_copy_in_flat.check_reduce_scatter_copy_in_flat,
    ),
    "post_reduce": (
        post.torch_post_reduce,
        post.triton_post_reduce,
        post.check_post_reduce,
    ),
}


def _fake(check):
    def fake(*args, **kwargs) -> None:
        check(*args, **kwargs)

    return fake


for _name, (_cpu, _cuda, _check) in _IMPLS.items():
    LIB.impl(_name, _cpu, "CPU")
    LIB.impl(_name, _cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake(_check), lib=LIB)


class EagerOps:
    """The copy ops for buffers on one device: in eager mode the device's impl
    called directly, under tracing (``torch.compiler.is_compiling()``) the
    ``torch.ops.fsdp_rs`` op.

    [Note: Eager op calls]
    The torch.library ops are what tracing sees and what users call. Outside
    tracing, a call through the dispatcher boxes its arguments (about ten,
    one a tensor list) and unboxes them into the Python impl: 5 to 15 us per
    call, and the runtime makes six per group per training step. The runtime
    therefore calls the impl the dispatcher would pick (CPU: the torch
    reference, CUDA: the Triton launcher) itself, trusted ([Note: Trusted
    calls]). Devices without an impl go through the dispatcher, which raises
    its usual error.

    [Note: Trusted calls]
    The ops check every argument (a user's call, the fake impls under
    tracing). The runtime's calls pass tables ``GroupTables.from_plan``
    checked once, when the group was planned, and buffers the runtime
    allocated from the same plan: re-checking them cost about 17 table checks
    per group per step (a fifth of the step's host time on a model of small
    groups). So the runtime calls each impl with ``checked=False``, which
    keeps only the checks of what a step can change: the dtypes the call casts,
    divides or accumulates between, and the gradients autograd left (their
    dtype, device and size). Everything else is the same function."""

    def __init__(self, device: torch.device) -> None:
        column = {"cpu": 0, "cuda": 1}.get(torch.device(device).type)
        self._impls = {
            name: getattr(torch.ops.fsdp_rs, name)
            if column is None
            else functools.partial(impls[column], checked=False)
            for name, impls in _IMPLS.items()
        }

    def __getattr__(self, name: str):
        if torch.compiler.is_compiling():
            return getattr(torch.ops.fsdp_rs, name)
        try:
            return self._impls[name]
        except KeyError:
            raise AttributeError(name) from None
