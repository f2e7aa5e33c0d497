"""Reduce-scatter copy-in: unsharded gradients -> the reduce-scatter input ``[W, S]``.

Rank ``r``'s row receives, for each param ``p`` at ``row_offsets[p]``, the
gradient's chunk ``r`` (its rows ``[r*c, (r+1)*c)``, flattened: ``n`` elements,
the padding rows past ``d0`` as zeros), then zeros over the alignment gap up to
the next param. Params without a gradient (``None``) contribute zeros. The cast
to the reduce dtype and an optional pre-division (FSDP2 pre-divides fp16
gradients to avoid overflow) are fused in. The tiles of the planner's tile table
cover every row exactly, so no separate zero-fill pass is needed. Without a
cast or a division the copy moves raw bits, any dtype ([Note: Raw copies] in
``_dtypes.py``). With ``chunk_numel``, a param's rank-``r`` elements are read
by the map of [Note: Chunked copies] (``all_gather_copy_out.py``): the
gradient of a param sharded on a dim ``d > 0``, passed viewed as the planned
``(W, pre * L)``.

[Note: Pointer tables]
Autograd hands over one gradient tensor per param, each its own allocation, so
the kernel reads them through a table of (address, numel) int64 pairs built per
call: attribute reads by C-level ``map``s (about 0.1 us per param on the host,
against about 1.5 us for a Python loop) and one 16 B/param host-to-device
copy, the scheme torch's own ``_chunk_cat`` CUDA kernel uses. The alternatives cost
more bandwidth: concatenating first adds a full read and write of every
gradient, and pre-placing gradients in a group buffer makes autograd accumulate
into zeroed memory (a memset plus a read-modify-write; the runtime does it only where
the buffer fits in memory FSDP2 would hold anyway: [Note: Reduction memory]
in ``runtime/group/gradients.py``). The numel column bounds
every read, so a wrong-sized gradient can never make the kernel read outside
it; the host checks each size before the launch ([Note: Gradient sizes]).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fsdp_rs.kernels._checks import (
    check_arithmetic,
    check_buffer,
    check_chunk_numel,
    check_divide_factor,
    check_same_device,
    check_table,
    check_tile_table,
    chunk_runs,
    device_of,
    dtype_of,
    host_table,
    is_none,
    param_numel,
)
from fsdp_rs.kernels._cpu_index import flattened, gap_columns, reduce_scatter_flat_index
from fsdp_rs.kernels._cpu_tiles import copy_in_tiled
from fsdp_rs.kernels._dtypes import FLOAT_DTYPES, bits, is_copyable
from fsdp_rs.kernels._triton import (
    f32_reciprocal,
    jit,
    kernel_dtype,
    kernel_view,
    launch_setting,
    loop_bound,
    pointer_table,
    require_triton,
    tl,
)

__all__ = [
    "check_reduce_scatter_copy_in",
    "torch_reduce_scatter_copy_in",
    "triton_reduce_scatter_copy_in",
]

OP = "reduce_scatter_copy_in"
# Long tiles' (BLOCK, num_warps) ([Note: Launch settings] in _triton.py): on an
# H200, 16384 x 8 against 2048 x 4 took cases a and b from 0.258 / 0.100 ms to
# 0.238 / 0.094 (4096 x 4 took 0.113 on b), and case c from 1.28 ms to 1.55.
LONG_TILES = (16384, 8)


def check_reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor | None],
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    divide_factor: float = 1.0,
    chunk_numel: torch.Tensor | None = None,
    *,
    tables: bool = True,
) -> None:
    """O(1) checks; the per-gradient ones happen where the gradients are read
    (the dtype of the first gradient is checked here). With ``tables=False`` (a
    trusted call, [Note: Trusted calls]) only the arithmetic's dtypes, what a
    step can change."""
    if not tables:
        _check_arithmetic(grads, reduce_scatter_input, divide_factor)
        return
    check_buffer(OP, "reduce_scatter_input", reduce_scatter_input, 2)
    num_params = row_offsets.numel() if isinstance(row_offsets, torch.Tensor) else -1
    check_table(OP, "row_offsets", row_offsets, torch.int64, num_params)
    check_table(OP, "padded_numel", padded_numel, torch.int64, num_params)
    check_tile_table(OP, tile_param, tile_start, tile_len)
    check_chunk_numel(OP, chunk_numel, num_params, row_offsets)
    check_same_device(
        OP,
        [
            ("reduce_scatter_input", reduce_scatter_input),
            ("row_offsets", row_offsets),
            ("tile_param", tile_param),
        ],
    )
    if len(grads) != num_params:
        raise ValueError(
            f"{OP}: got {len(grads)} gradients for a plan of {num_params} params; pass one "
            "entry per param in plan order (None for a param without a gradient)"
        )
    check_divide_factor(OP, divide_factor)
    _check_arithmetic(grads, reduce_scatter_input, divide_factor)


def _check_arithmetic(
    grads: Sequence[torch.Tensor | None], reduce_scatter_input: torch.Tensor, divide_factor: float
) -> None:
    check_arithmetic(
        OP,
        ("each gradient", _grad_dtype(grads) or reduce_scatter_input.dtype),
        ("reduce_scatter_input", reduce_scatter_input.dtype),
        raw="gradients of reduce_scatter_input's dtype, divide_factor=1.0",
        divide=divide_factor != 1.0,
    )


def _check_grad(i: int, g: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if g.dtype != dtype:
        raise TypeError(
            f"{OP}: gradient {i} has dtype {g.dtype} but earlier ones have {dtype}; "
            "all gradients of a group share the param dtype"
        )
    if g.device != device:
        raise ValueError(
            f"{OP}: gradient {i} is on {g.device} but reduce_scatter_input is on {device}"
        )


def _grad_dtype(grads: Sequence[torch.Tensor | None]) -> torch.dtype | None:
    for g in grads:
        if g is not None:
            if not is_copyable(g.dtype):
                raise TypeError(
                    f"{OP}: gradients have dtype {g.dtype}, which is not plain memory; "
                    "supported are every dtype but the quantized ones"
                )
            return g.dtype
    return None


def _check_grads(
    grads: Sequence[torch.Tensor | None],
    padded_numel: torch.Tensor,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> np.ndarray:
    """Every gradient has ``dtype``, is on ``device`` and the size the plan
    expects (``_check_sizes``). Vectorized (C-level ``map``s and NumPy); on a
    failure the per-gradient loop finds the first offender and names it.
    Returns each gradient's numel, ``W * n`` (its zero stand-in's) for a
    missing one."""
    present = list(itertools.filterfalse(is_none, grads))
    if present and not (
        set(map(dtype_of, present)) == {dtype} and set(map(device_of, present)) == {device}
    ):
        for i, g in enumerate(grads):
            if g is not None:
                _check_grad(i, g, dtype, device)
    numel = np.fromiter(map(torch.Tensor.numel, present), np.int64, len(present))
    padded = host_table(padded_numel)
    mask = _present_mask(grads, present)
    _check_sizes(grads, present, numel, mask, padded_numel, world_size)
    numels = padded * world_size
    numels[mask] = numel
    return numels


def _present_mask(grads: Sequence[torch.Tensor | None], present: list) -> Any:
    """Where ``present`` (``grads`` without the Nones) sits in ``grads``."""
    if len(present) == len(grads):
        return slice(None)
    return np.fromiter(map(is_none, grads), bool, len(grads)) ^ True


def _check_sizes(
    grads: Sequence[torch.Tensor | None],
    present: list[torch.Tensor],
    numel: np.ndarray,
    mask: Any,
    padded_numel: torch.Tensor,
    world_size: int,
) -> None:
    """[Note: Gradient sizes] Each gradient has its param's size: the kernel
    reads a short gradient's missing tail as zeros and cuts a long one, so a
    wrong size would go through silently. ``GroupTables`` keeps the params'
    numels on its ``padded_numel`` (``param_numel``): one NumPy comparison of
    the numels the pointer table reads anyway. Tables made otherwise carry
    only the padded chunks: each gradient's ``ceil(d0 / W)`` rows times its
    inner size must be its chunk (three more attribute reads per gradient)."""
    exact = param_numel(padded_numel)
    if exact is not None:
        if np.array_equal(numel, exact[mask]):
            return
        for i, (g, n) in enumerate(zip(grads, exact.tolist(), strict=True)):
            if g is not None and g.numel() != n:
                raise ValueError(
                    f"{OP}: gradient {i} has shape {tuple(g.shape)} ({g.numel()} elements) "
                    f"but the plan's param has {n}; pass the gradient of the unsharded "
                    "param the plan was made for"
                )
    padded = host_table(padded_numel)
    count = len(present)
    if count and (np.fromiter(map(torch.Tensor.dim, present), np.int64, count) > 0).all():
        d0 = np.fromiter(map(_FIRST, map(_SHAPE, present)), np.int64, count)
        chunk = -(-d0 // world_size) * (numel // np.maximum(d0, 1))
        if np.array_equal(chunk, padded[mask]):
            return
    elif not count:
        return
    for i, (g, n) in enumerate(zip(grads, padded.tolist(), strict=True)):
        if g is None:
            continue
        d0 = g.shape[0] if g.dim() else 1
        inner = g.numel() // d0 if d0 else 0
        if g.dim() == 0 or -(-d0 // world_size) * inner != n:
            raise ValueError(
                f"{OP}: gradient {i} has shape {tuple(g.shape)}, whose padded chunk is not "
                f"the plan's {n} elements for world size {world_size}; pass the gradient "
                "of the unsharded param the plan was made for"
            )


_SHAPE = operator.attrgetter("shape")
_FIRST = operator.itemgetter(0)


def _kernel_grads(
    grads: Sequence[torch.Tensor | None], dtype: torch.dtype, device: torch.device
) -> tuple[Sequence[torch.Tensor | None], list[torch.Tensor]]:
    """``grads`` as the kernel reads them, and those of them that are not None
    (for ``pointer_table``): each checked for ``dtype`` and ``device`` and
    contiguous (a strided one copied). C-level ``map``s over the list; the
    per-gradient loop runs only to name an offender or copy a strided
    gradient."""
    present = list(itertools.filterfalse(is_none, grads))
    # On CUDA, get_device (an int: -1 for CPU and meta tensors) costs half of
    # building each torch.device; elsewhere (the interpreter) devices compare whole.
    index = device.index if device.type == "cuda" else -1
    same_type = device.type == "cuda" or set(map(device_of, present)) <= {device}
    if not (
        set(map(dtype_of, present)) <= {dtype}
        and set(map(torch.Tensor.get_device, present)) <= {index}
        and same_type
    ):
        for i, g in enumerate(grads):
            if g is not None:
                _check_grad(i, g, dtype, device)
    if all(map(torch.Tensor.is_contiguous, present)):
        return grads, present
    grads = [None if g is None else g.contiguous() for g in grads]
    return grads, list(itertools.filterfalse(is_none, grads))


def torch_reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor | None],
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    divide_factor: float = 1.0,
    chunk_numel: torch.Tensor | None = None,
    *,
    checked: bool = True,
) -> None:
    """Reference: the gradients flattened and concatenated (zeros of ``W * n``
    elements standing in for a missing one), then one gather by a cached index
    ([Note: Cached CPU indices]) writes every row, padding and gaps included;
    with ``chunk_numel``, one strided copy per gradient. Then ``div_``."""
    check_reduce_scatter_copy_in(
        grads, reduce_scatter_input, row_offsets, padded_numel,
        tile_param, tile_start, tile_len, divide_factor, chunk_numel, tables=checked,
    )  # fmt: skip
    world_size, row_numel = reduce_scatter_input.shape
    dtype = _grad_dtype(grads) or reduce_scatter_input.dtype
    numels = _check_grads(grads, padded_numel, world_size, dtype, reduce_scatter_input.device)
    divided = reduce_scatter_input  # in its own dtype: [Note: Complex gradients]
    index = None
    if chunk_numel is None:
        index = reduce_scatter_flat_index(
            row_offsets, padded_numel, numels, world_size, row_numel, trusted=not checked
        )
    if dtype == reduce_scatter_input.dtype and dtype not in FLOAT_DTYPES:
        # raw bits: the same copies of integer views ([Note: Raw copies])
        grads = [None if g is None else bits(g) for g in grads]
        reduce_scatter_input = bits(reduce_scatter_input)
        dtype = reduce_scatter_input.dtype
    if chunk_numel is not None:
        runs = chunk_runs(padded_numel.tolist(), chunk_numel, OP)
        _copy_per_param(grads, reduce_scatter_input, row_offsets, padded_numel, runs)
    elif index is None:  # over the index budget: [Note: Tiled indices]
        copy_in_tiled(
            grads, reduce_scatter_input, row_offsets, padded_numel, numels, dtype, _copy_one,
            trusted=not checked,
        )  # fmt: skip
    else:
        _gather(grads, reduce_scatter_input, index, numels, dtype)
    if divide_factor != 1.0:
        divided.div_(divide_factor)


def _gather(grads, reduce_scatter_input, index, numels, dtype) -> None:
    """The gradients flattened and concatenated (zeros standing in for a missing
    one, one more zero at the end), gathered by ``index``."""
    flat = flattened(grads, numels, reduce_scatter_input, dtype)
    if flat.dtype == reduce_scatter_input.dtype:
        torch.index_select(flat, 0, index, out=reduce_scatter_input.view(-1))
    else:
        reduce_scatter_input.view(-1).copy_(flat.index_select(0, index))


def _copy_per_param(grads, reduce_scatter_input, row_offsets, padded_numel, runs=None) -> None:
    """[Note: Cached CPU indices] without an index: each gradient's ``W`` chunks
    of ``n`` elements into its columns (zeros past its end, and for a missing
    one), and zeros into the gap columns. With ``runs`` (the host
    ``chunk_numel``), each gradient's ``(pre, W, L)`` into its ``(W, pre, L)``."""
    world_size, row_numel = reduce_scatter_input.shape
    rows, padded = row_offsets.tolist(), padded_numel.tolist()
    for p, (g, r, n) in enumerate(zip(grads, rows, padded, strict=True)):
        dst = reduce_scatter_input[:, r : r + n]
        if g is None:
            dst.zero_()
            continue
        if runs is not None and n:
            pre, run = n // runs[p], runs[p]
            flat = g.reshape(-1).view(pre, world_size, run)
            dst.view(world_size, pre, run).copy_(flat.transpose(0, 1))
            continue
        _copy_one(g, dst, n)
    for start, end in gap_columns(rows, padded, row_numel):
        reduce_scatter_input[:, start:end].zero_()


def _copy_one(g: torch.Tensor | None, dst: torch.Tensor, n: int) -> None:
    """One gradient's ``W`` chunks of ``n`` elements into its ``[W, n]``
    columns ``dst``: zeros past its end, and for a missing one."""
    if g is None:
        dst.zero_()
        return
    world_size = dst.shape[0]
    flat = g.reshape(-1)
    full, rest = divmod(flat.numel(), n) if n else (world_size, 0)
    dst[:full].copy_(flat[: full * n].view(full, n))
    if full < world_size:
        dst[full, :rest].copy_(flat[full * n :])
        dst[full, rest:].zero_()
        dst[full + 1 :].zero_()


@jit
def _rs_copy_in_kernel(
    grad_ptrs,
    grad_numel,
    dst,
    row_offsets,
    padded_numel,
    tile_param,
    tile_start,
    tile_len,
    chunk_numel,
    row_numel,
    inv_factor,
    GRAD_DTYPE: tl.constexpr,
    HAS_DIV: tl.constexpr,
    CHUNKED: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Offsets and counts in words: the tables' elements times WORDS ([Note: Raw
    # copies]); row_numel and grad_numel come in words.
    tile = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    p = tl.load(tile_param + tile)
    start = tl.load(tile_start + tile) * WORDS
    n = tl.load(padded_numel + p) * WORDS
    row_offset = tl.load(row_offsets + p) * WORDS
    # Clamped so no write leaves the row whatever the tables hold.
    tile_len_words = tl.load(tile_len + tile).to(tl.int64) * WORDS
    length = tl.minimum(tile_len_words, row_numel - row_offset - start)
    # Elements that come from the gradient; the rest of the tile is zeros:
    # padding rows past d0, the alignment gap, or a missing gradient (numel 0).
    numel = tl.load(grad_numel + p)
    valid = tl.minimum(n, numel - rank * n) - start
    grad = tl.load(grad_ptrs + p).to(tl.pointer_type(GRAD_DTYPE))
    src = grad + rank * n + start
    dst_base = dst + rank * row_numel + row_offset + start
    run = 1
    world = 1
    if CHUNKED:  # [Note: Chunked copies]
        run = tl.maximum(tl.load(chunk_numel + p) * WORDS, 1)
        world = tl.num_programs(1).to(tl.int64)
    for i in range(0, loop_bound(length), BLOCK):
        offs = i + tl.arange(0, BLOCK)
        if CHUNKED:
            j = start + offs
            frm = (j // run) * (world * run) + rank * run + j % run
            x = tl.load(grad + frm, mask=(j < n) & (frm < numel), other=0.0)
        else:
            x = tl.load(src + offs, mask=offs < valid, other=0.0)
        y = x.to(dst.dtype.element_ty)
        if HAS_DIV:
            y = (y.to(tl.float32) * inv_factor).to(dst.dtype.element_ty)
        tl.store(dst_base + offs, y, mask=offs < length)


def triton_reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor | None],
    reduce_scatter_input: torch.Tensor,
    row_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    divide_factor: float = 1.0,
    chunk_numel: torch.Tensor | None = None,
    *,
    checked: bool = True,
) -> None:
    """One launch, grid (tiles, world size); see [Note: Pointer tables]."""
    require_triton()
    check_reduce_scatter_copy_in(
        grads, reduce_scatter_input, row_offsets, padded_numel,
        tile_param, tile_start, tile_len, divide_factor, chunk_numel, tables=checked,
    )  # fmt: skip
    num_tiles = tile_param.numel()
    if num_tiles == 0:
        return
    device = reduce_scatter_input.device
    dtype = _grad_dtype(grads) or reduce_scatter_input.dtype
    # Casts and divisions are between float dtypes, which kernel_view keeps; a
    # complex one is copied raw, then divided by torch ([Note: Complex gradients]).
    complex_div = reduce_scatter_input.is_complex() and divide_factor != 1.0
    divided = reduce_scatter_input
    reduce_scatter_input, words = kernel_view(reduce_scatter_input)
    world_size, row_numel = reduce_scatter_input.shape  # row_numel in words
    grads, present = _kernel_grads(grads, dtype, device)
    numel = np.fromiter(map(torch.Tensor.numel, present), np.int64, len(present))
    mask = _present_mask(grads, present)
    _check_sizes(grads, present, numel, mask, padded_numel, world_size)  # on the host
    grad_ptrs, grad_numel = pointer_table(grads, device, words, present, numel, mask)
    inv = f32_reciprocal(divide_factor)
    block, warps = launch_setting(row_numel, num_tiles, LONG_TILES)
    _rs_copy_in_kernel[(num_tiles, world_size)](
        grad_ptrs,
        grad_numel,
        reduce_scatter_input,
        row_offsets,
        padded_numel,
        tile_param,
        tile_start,
        tile_len,
        row_offsets if chunk_numel is None else chunk_numel,  # unused without
        row_numel,
        inv,
        GRAD_DTYPE=kernel_dtype(dtype),
        HAS_DIV=divide_factor != 1.0 and not complex_div,
        CHUNKED=chunk_numel is not None,
        WORDS=words,
        BLOCK=block,
        num_warps=warps,
    )
    del grads  # contiguous copies (if any) lived until the launch was queued
    if complex_div:
        divided.div_(divide_factor)
