"""``torch.ops.fsdp_rs``: the group copies and ``set_`` as torch.library ops.

Importing this package registers, in the ``fsdp_rs`` namespace:

- ``all_gather_copy_in(sharded, all_gather_output!, rank)``
- ``all_gather_copy_out(all_gather_output, out![], row_offsets, unsharded_offsets,
  padded_numel, tile_param, tile_start, tile_len, chunk_numel?=None)``
- ``reduce_scatter_copy_in(grads?[], reduce_scatter_input!, row_offsets,
  padded_numel, tile_param, tile_start, tile_len, divide_factor=1.0,
  chunk_numel?=None)``
- ``reduce_scatter_copy_in_flat(grad_buffer, reduce_scatter_input!, row_offsets,
  unsharded_offsets, padded_numel, tile_param, tile_start, tile_len,
  divide_factor=1.0)``
- ``post_reduce(reduce_scatter_output, sharded_grad!, divide_factor=1.0,
  accumulate=False)``
- ``set_(tensor!, data)``
- ``unshard_copy_out(...)``: functional, with the gradient reduction as its
  autograd formula (the traced hooks' op, [Note: Traced hooks])

Each copy has a CPU impl (plain torch), a CUDA impl (one Triton launch) and a
fake impl. ``GroupTables.from_plan`` gives the table arguments for a plan.
"""

from fsdp_rs.ops import set_, traced
from fsdp_rs.ops._library import NAMESPACE, SCHEMAS
from fsdp_rs.ops.copies import EagerOps
from fsdp_rs.ops.tables import GroupTables

del set_, traced

__all__ = ["NAMESPACE", "SCHEMAS", "EagerOps", "GroupTables"]
