"""``fsdp_rs::unshard_copy_out``: the functional copy-out the traced hooks use,
with the gradient reduction as its autograd formula ([Note: Traced hooks]).

Forward: a fresh unsharded buffer filled from the all-gather output by
``fsdp_rs::all_gather_copy_out``. Backward, for the group's sharded local
tensors (which the forward does not read: they are where the gradient goes):
``fsdp_rs::reduce_scatter_copy_in_flat`` (the pre-divide and the cast to the
reduce dtype), the functional reduce-scatter and its wait, then
``fsdp_rs::post_reduce`` (the post-divide and the cast to the parameters'
dtype) into a fresh sharded row, viewed per parameter. Both directions run the
eager runtime's ops with its arguments, so the traced path gives its results
bit for bit; under AOT autograd the backward's collective and copies land in
the backward graph.
"""

from __future__ import annotations

import torch

__all__ = ["unshard_copy_out"]


@torch.library.custom_op("fsdp_rs::unshard_copy_out", mutates_args=())
def unshard_copy_out(
    all_gather_output: torch.Tensor,
    sharded: list[torch.Tensor],
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    unsharded_numel: int,
    sharded_offsets: list[int],
    sharded_numels: list[int],
    group_name: str,
    reduce_op: str,
    pre_divide: float,
    post_divide: float,
    reduce_dtype: torch.dtype,
) -> torch.Tensor:
    """The unsharded buffer of a group, copied out of ``all_gather_output``
    (rows x row numel). ``sharded``: the group's sharded local tensors (views
    of its row at ``sharded_offsets``, of ``sharded_numels`` elements), which
    take the gradient; the rest configures the reduction (``group_name``: the
    shard process group, ``reduce_op``: ``"sum"`` or ``"avg"``).

    [Note: This rank's numels in the graph]
    ``sharded_numels`` is checked here, and it is also what keeps the graphs of
    two ranks apart: torch's compile caches key a graph by its code and its
    DTensor inputs' global metadata (pytorch/pytorch#188390), so ranks of one
    host whose shards differ (an uneven split) would share compiled code made for
    another shape; this rank's numels, constants in the graph's code, differ
    exactly when the shards do."""
    _check_numels(sharded, sharded_numels)
    out = all_gather_output.new_empty(unsharded_numel)
    torch.ops.fsdp_rs.all_gather_copy_out(
        all_gather_output,
        [out],
        row_offsets,
        unsharded_offsets,
        padded_numel,
        tile_param,
        tile_start,
        tile_len,
    )
    return out


def _check_numels(sharded: list[torch.Tensor], numels: list[int]) -> None:
    if [t.numel() for t in sharded] != list(numels):
        raise ValueError(
            f"fsdp_rs::unshard_copy_out: the sharded tensors have "
            f"{[t.numel() for t in sharded]} elements, the group's plan {list(numels)}; "
            "pass this rank's local tensors of the group, in its parameter order"
        )


@unshard_copy_out.register_fake
def _(all_gather_output, sharded, *rest) -> torch.Tensor:
    unsharded_numel, _, numels = rest[6:9]
    _check_numels(sharded, numels)
    return all_gather_output.new_empty(unsharded_numel)


def _setup_context(ctx, inputs, output) -> None:
    ag, sharded, *tables = inputs[:8]
    ctx.tables = tables
    ctx.rows, ctx.row_numel = ag.shape
    ctx.layouts = [(s.shape, s.stride(), s.dtype) for s in sharded]
    (
        _,
        ctx.offsets,
        _,
        ctx.group_name,
        ctx.reduce_op,
        ctx.pre,
        ctx.post,
        ctx.reduce_dtype,
    ) = inputs[8:]


def _backward(ctx, grad: torch.Tensor):
    rs_in = grad.new_empty((ctx.rows, ctx.row_numel), dtype=ctx.reduce_dtype)
    torch.ops.fsdp_rs.reduce_scatter_copy_in_flat(grad.contiguous(), rs_in, *ctx.tables, ctx.pre)
    if ctx.rows > 1:
        functional = torch.ops._c10d_functional
        output = functional.reduce_scatter_tensor(
            rs_in.view(-1), ctx.reduce_op, ctx.rows, ctx.group_name
        )
        output = functional.wait_tensor(output)
    else:
        output = rs_in[0]
    dtype = ctx.layouts[0][2] if ctx.layouts else ctx.reduce_dtype
    row = output.new_empty(ctx.row_numel, dtype=dtype)
    torch.ops.fsdp_rs.post_reduce(output, row, ctx.post, False)
    grads = [
        row.as_strided(shape, stride, offset)
        for (shape, stride, _), offset in zip(ctx.layouts, ctx.offsets, strict=True)
    ]
    return (None, grads, *([None] * 14))


unshard_copy_out.register_autograd(_backward, setup_context=_setup_context)
