"""fsdp-rs under ``torch.compile``: which of its functions Dynamo must not trace.

[Note: Eager hooks under torch.compile]
``torch.compile(model)``, ``torch.compile(block)`` and ``module.compile()``
make Dynamo trace ``nn.Module._call_impl``, and with it the forward pre- and
post-hooks that ``fully_shard`` registered. Those hooks drive the state machine
(all-gathers, the planner's zero-copy NumPy tables, storage resizes, swaps of
registered parameters, autograd hooks on the inputs and outputs): Python side
effects that must run once per call, in eager, not be traced. They are
therefore wrapped in ``torch.compiler.disable(recursive=True)`` when they are
registered, the mechanism torch documents for code Dynamo must skip and the one
torch FSDP2 uses for its own hooks (``_dynamo_disable`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``). Where Dynamo meets a
hook in a frame it traces, it breaks the graph there and runs the hook as it is,
where FSDP2's hooks break it too; what lies between the hooks (the modules'
forwards, activation checkpointing inside them) is compiled. The break message
carries ``_REASON``, which is also the error of ``fullgraph=True``; a model
whose root called ``set_fullgraph_compile()`` has its hooks traced instead
([Note: Traced hooks], ``runtime/compile/traced.py``).

The backward hooks (tensor and node hooks, the ``_PostBackward`` function and
the end-of-backward callback) are registered by these eager hooks on eager
tensors and run by the autograd engine outside Dynamo, compiled graph or not;
compiled autograd, which would trace them, is not covered yet.

The unsharded parameters are ``nn.Parameter`` objects made once per group (again
only when it adopts new parameters) and swapped into the modules at each
unshard ([Note: Swapping registered parameters]), so the compiled graphs see the
same objects at every step and their guards hold: no recompiles after the first
step. The wrapper costs about 0.5 us per hook call in eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["eager_hook"]

_F = TypeVar("_F", bound=Callable)
# What Dynamo reports at each hook, and in the error of torch.compile(fullgraph=True).
_REASON = (
    "fsdp-rs runs its forward hooks (unshard, reshard) eager under torch.compile; "
    "for fullgraph=True over a fully_shard module call model.set_fullgraph_compile() "
    "on the root first ([Note: Traced hooks]), or compile without fullgraph"
)


def eager_hook(hook: _F) -> _F:
    """``hook`` as Dynamo skips it; see [Note: Eager hooks under torch.compile]."""
    return torch.compiler.disable(hook, recursive=True, reason=_REASON)
