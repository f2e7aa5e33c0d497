"""Reduce-scatter copy-in from a flat gradient buffer -> the reduce-scatter input ``[W, S]``.

The same rows as ``reduce_scatter_copy_in`` (rank ``r``'s row holds chunk ``r``
of every param's gradient at ``row_offsets[p]``, zeros over the alignment
gaps; cast to the reduce dtype, optional pre-division fused in), read from one
tensor laid out like the unsharded buffer: param ``p``'s ``W * n`` elements
(its gradient, then zeros for the padding rows) at ``unsharded_offsets[p]``.
This is the inverse of the all-gather copy-out into the group buffer, and what
the runtime passes when autograd accumulated the gradients into views of such
a buffer ([Note: Pre-placed gradients] in ``runtime/group/gradients.py``): one
tensor argument, nothing per param. Without a cast or a division the copy moves
raw bits, any dtype ([Note: Raw copies] in ``_dtypes.py``).
"""

from __future__ import annotations

import torch

from fsdp_rs.kernels._checks import (
    check_arithmetic,
    check_buffer,
    check_divide_factor,
    check_layout_tables,
    check_same_device,
    unsharded_extent,
)
from fsdp_rs.kernels._cpu_index import reduce_scatter_buffer_index
from fsdp_rs.kernels._cpu_tiles import copy_in_flat_tiled
from fsdp_rs.kernels._dtypes import bits
from fsdp_rs.kernels._triton import (
    f32_reciprocal,
    jit,
    kernel_view,
    launch_setting,
    loop_bound,
    require_triton,
    tl,
)

__all__ = [
    "check_reduce_scatter_copy_in_flat",
    "torch_reduce_scatter_copy_in_flat",
    "triton_reduce_scatter_copy_in_flat",
]

OP = "reduce_scatter_copy_in_flat"
# Long tiles' (BLOCK, num_warps) ([Note: Launch settings] in _triton.py): on an
# H200, 8192 x 8 against 2048 x 4 took cases a and b from 0.256 / 0.099 ms to
# 0.236 / 0.094, and cases c and d from 0.047 / 0.043 ms to 0.200 / 0.122.
LONG_TILES = (8192, 8)


def check_reduce_scatter_copy_in_flat(
    grad_buffer: torch.Tensor,
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    divide_factor: float = 1.0,
    *,
    tables: bool = True,
) -> None:
    """O(1) checks (the buffer's size against the tables is checked where the
    tables are read: the CPU index build; the kernel clamps every read). With
    ``tables=False`` (a trusted call, [Note: Trusted calls]) only the
    arithmetic's dtypes, what a step can change."""
    if not tables:
        _check_arithmetic(grad_buffer, reduce_scatter_input, divide_factor)
        return
    check_buffer(OP, "grad_buffer", grad_buffer, 1)
    check_buffer(OP, "reduce_scatter_input", reduce_scatter_input, 2)
    check_layout_tables(
        OP, row_offsets, unsharded_offsets, padded_numel, tile_param, tile_start, tile_len
    )
    check_same_device(
        OP,
        [
            ("reduce_scatter_input", reduce_scatter_input),
            ("grad_buffer", grad_buffer),
            ("row_offsets", row_offsets),
            ("tile_param", tile_param),
        ],
    )
    check_divide_factor(OP, divide_factor)
    _check_arithmetic(grad_buffer, reduce_scatter_input, divide_factor)


def _check_arithmetic(
    grad_buffer: torch.Tensor, reduce_scatter_input: torch.Tensor, divide_factor: float
) -> None:
    check_arithmetic(
        OP,
        ("grad_buffer", grad_buffer.dtype),
        ("reduce_scatter_input", reduce_scatter_input.dtype),
        raw="grad_buffer of reduce_scatter_input's dtype, divide_factor=1.0",
        divide=divide_factor != 1.0,
    )


def torch_reduce_scatter_copy_in_flat(
    grad_buffer: torch.Tensor,
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    divide_factor: float = 1.0,
    *,
    checked: bool = True,
) -> None:
    """Reference: one gather by a cached index ([Note: Cached CPU indices]), a
    zero fill of the gap elements, then ``div_``; per parameter where the index
    is over the cache's budget."""
    check_reduce_scatter_copy_in_flat(
        grad_buffer, reduce_scatter_input, row_offsets, unsharded_offsets, padded_numel,
        tile_param, tile_start, tile_len, divide_factor, tables=checked,
    )  # fmt: skip
    world_size, row_numel = reduce_scatter_input.shape
    divided = reduce_scatter_input  # in its own dtype: [Note: Complex gradients]
    if grad_buffer.dtype == reduce_scatter_input.dtype:  # raw bits ([Note: Raw copies])
        grad_buffer, reduce_scatter_input = bits(grad_buffer), bits(reduce_scatter_input)
    index = reduce_scatter_buffer_index(
        row_offsets, unsharded_offsets, padded_numel, world_size, row_numel, trusted=not checked
    )
    if checked:
        if index is None:  # the tables' extent, read only here: [Note: Trusted calls]
            needed = unsharded_extent(unsharded_offsets, padded_numel, world_size)
        else:
            needed = index[2]
        if grad_buffer.numel() < needed:
            raise ValueError(
                f"{OP}: grad_buffer has {grad_buffer.numel()} elements but the tables place "
                f"gradients up to element {needed}; pass a buffer of plan.unsharded_numel "
                "elements"
            )
    if index is None:  # over the index budget: [Note: Tiled indices]
        copy_in_flat_tiled(
            grad_buffer, reduce_scatter_input, row_offsets, unsharded_offsets, padded_numel,
            trusted=not checked,
        )  # fmt: skip
    else:
        src, gaps, _ = index
        flat = reduce_scatter_input.view(-1)
        if grad_buffer.dtype == flat.dtype:
            torch.index_select(grad_buffer, 0, src, out=flat)
        else:
            flat.copy_(grad_buffer.index_select(0, src))
        if gaps is not None:
            flat.index_fill_(0, gaps, 0)
    if divide_factor != 1.0:
        divided.div_(divide_factor)


@jit
def _rs_copy_in_flat_kernel(
    src,
    dst,
    row_offsets,
    unsharded_offsets,
    padded_numel,
    tile_param,
    tile_start,
    tile_len,
    row_numel,
    src_numel,
    inv_factor,
    HAS_DIV: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Offsets and counts in words: the tables' elements times WORDS ([Note: Raw
    # copies]); row_numel and src_numel come in words.
    tile = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    p = tl.load(tile_param + tile)
    start = tl.load(tile_start + tile) * WORDS
    n = tl.load(padded_numel + p) * WORDS
    row_offset = tl.load(row_offsets + p) * WORDS
    # Clamped so no write leaves the row whatever the tables hold.
    tile_len_words = tl.load(tile_len + tile).to(tl.int64) * WORDS
    length = tl.minimum(tile_len_words, row_numel - row_offset - start)
    src_offset = tl.load(unsharded_offsets + p) * WORDS + rank * n + start
    # Elements read from the buffer; the rest of the tile (the alignment gap) is
    # zeros. Clamped to the buffer too.
    valid = tl.minimum(n - start, src_numel - src_offset)
    src_base = src + src_offset
    dst_base = dst + rank * row_numel + row_offset + start
    for i in range(0, loop_bound(length), BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(src_base + offs, mask=offs < valid, other=0.0)
        y = x.to(dst.dtype.element_ty)
        if HAS_DIV:
            y = (y.to(tl.float32) * inv_factor).to(dst.dtype.element_ty)
        tl.store(dst_base + offs, y, mask=offs < length)


def triton_reduce_scatter_copy_in_flat(
    grad_buffer: torch.Tensor,
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    divide_factor: float = 1.0,
    *,
    checked: bool = True,
) -> None:
    """One launch, grid (tiles, world size), whatever the number of params."""
    require_triton()
    check_reduce_scatter_copy_in_flat(
        grad_buffer, reduce_scatter_input, row_offsets, unsharded_offsets, padded_numel,
        tile_param, tile_start, tile_len, divide_factor, tables=checked,
    )  # fmt: skip
    num_tiles = tile_param.numel()
    if num_tiles == 0 or reduce_scatter_input.shape[0] == 0:
        return
    # Casts and divisions are between float dtypes, which kernel_view keeps; a
    # complex one is copied raw, then divided by torch ([Note: Complex gradients]).
    complex_div = reduce_scatter_input.is_complex() and divide_factor != 1.0
    divided = reduce_scatter_input
    reduce_scatter_input, words = kernel_view(reduce_scatter_input)
    grad_buffer, _ = kernel_view(grad_buffer)
    world_size, row_numel = reduce_scatter_input.shape  # row_numel in words
    inv = f32_reciprocal(divide_factor)
    block, warps = launch_setting(row_numel, num_tiles, LONG_TILES)
    _rs_copy_in_flat_kernel[(num_tiles, world_size)](
        grad_buffer,
        reduce_scatter_input,
        row_offsets,
        unsharded_offsets,
        padded_numel,
        tile_param,
        tile_start,
        tile_len,
        row_numel,
        grad_buffer.numel(),
        inv,
        HAS_DIV=divide_factor != 1.0 and not complex_div,
        WORDS=words,
        BLOCK=block,
        num_warps=warps,
    )
    if complex_div:
        divided.div_(divide_factor)
