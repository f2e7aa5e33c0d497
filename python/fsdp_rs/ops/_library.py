"""The ``fsdp_rs`` operator namespace and the schema of every op in it.

Never ``fsdp::``, which is torch's own FSDP2 namespace. Mutated arguments are
declared (``Tensor(a!)``, ``Tensor(a!)[]``) so torch.compile auto-functionalizes
the copies; ``set_`` is the exception, see [Note: set_ is not functionalized].
"""

from __future__ import annotations

import torch

__all__ = ["LIB", "NAMESPACE", "SCHEMAS"]

NAMESPACE = "fsdp_rs"

SCHEMAS = {
    "all_gather_copy_in": "(Tensor sharded, Tensor(a!) all_gather_output, int rank) -> ()",
    "all_gather_copy_out": (
        "(Tensor all_gather_output, Tensor(a!)[] out, Tensor row_offsets, "
        "Tensor unsharded_offsets, Tensor padded_numel, Tensor tile_param, "
        "Tensor tile_start, Tensor tile_len, Tensor? chunk_numel=None) -> ()"
    ),
    "reduce_scatter_copy_in": (
        "(Tensor?[] grads, Tensor(a!) reduce_scatter_input, Tensor row_offsets, "
        "Tensor padded_numel, Tensor tile_param, Tensor tile_start, Tensor tile_len, "
        "float divide_factor=1.0, Tensor? chunk_numel=None) -> ()"
    ),
    "reduce_scatter_copy_in_flat": (
        "(Tensor grad_buffer, Tensor(a!) reduce_scatter_input, Tensor row_offsets, "
        "Tensor unsharded_offsets, Tensor padded_numel, Tensor tile_param, Tensor tile_start, "
        "Tensor tile_len, float divide_factor=1.0) -> ()"
    ),
    "post_reduce": (
        "(Tensor reduce_scatter_output, Tensor(a!) sharded_grad, float divide_factor=1.0, "
        "bool accumulate=False) -> ()"
    ),
    "set_": "(Tensor(a!) tensor, Tensor data) -> ()",
}

LIB = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    LIB.define(_name + _schema)
