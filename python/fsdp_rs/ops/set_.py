"""``fsdp_rs::set_``: point a tensor (the unsharded ``nn.Parameter``) at new data.

[Note: set_ is not functionalized]
Under torch.compile the unsharded parameter object is created once and, after
each all-gather, re-pointed at the freshly allocated all-gather output. If
functionalization rewrote this ``set_``, AOTAutograd would have to reason about
two aliased, mutated graph inputs, which it does not support. So the op gets its
own Functionalize kernel that unwraps both tensors and applies ``aten.set_`` to
the inner tensors directly: the graph keeps the ``set_`` as a mutation in place
(AOTAutograd accepts an in-graph ``set_`` into a graph input, and Inductor lowers
it), and ``has_side_effect`` keeps dead-code elimination from dropping the op
in graphs that hold it unlowered (its result is unused by construction). This is
sound because the parameter is never read between its allocation and the
``set_`` that fills it.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from fsdp_rs.ops._library import LIB, NAMESPACE

__all__: list[str] = []

_FUNCTIONALIZE = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)


def _check(tensor: torch.Tensor, data: torch.Tensor) -> None:
    if tensor.dtype != data.dtype or tensor.device != data.device:
        raise ValueError(
            f"fsdp_rs::set_: tensor is {tensor.dtype} on {tensor.device} but data is "
            f"{data.dtype} on {data.device}; set_ re-points a parameter at data of its own "
            "dtype and device"
        )


def _set(tensor: torch.Tensor, data: torch.Tensor) -> None:
    _check(tensor, data)
    with torch.no_grad():
        tensor.set_(data)


def _set_functionalize(tensor: torch.Tensor, data: torch.Tensor) -> None:
    inner = torch._from_functional_tensor(tensor)
    torch._sync(data)
    inner_data = torch._from_functional_tensor(data)
    _check(inner, inner_data)
    with torch._C._ExcludeDispatchKeyGuard(_FUNCTIONALIZE), torch.no_grad():
        # Recorded as aten.set_ on the graph input: the one in-graph mutation
        # AOTAutograd accepts besides copy_, and one Inductor lowers.
        torch.ops.aten.set_.source_Tensor(inner, inner_data)


for _key in ("CPU", "CUDA", "Meta"):
    LIB.impl("set_", _set, _key)
LIB.impl("set_", _set_functionalize, "Functionalize")
has_side_effect(getattr(torch.ops, NAMESPACE).set_.default)
