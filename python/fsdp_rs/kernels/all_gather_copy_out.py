"""All-gather copy-out: the all-gather buffer ``[W, S]`` -> unsharded parameters.

Param ``p`` owns ``padded_numel[p]`` (``n``) elements at ``row_offsets[p]`` in
every row; its unsharded tensor is the ``W`` chunks back to back (``W * n``
elements, rank-major). The destination is either the group's unsharded buffer
(``out`` has one tensor; param ``p`` starts at ``unsharded_offsets[p]``), the
eager layout where freeing and allocating is one storage resize, or one tensor
per param (``out`` has ``P`` tensors of ``W * n`` elements), the layout of
freshly allocated per-param all-gather outputs under torch.compile.

The kernel runs one program per (tile, rank) over the planner's tile table
([Note: Tile table] in ``rust/planner/src/group.rs``); a tile never crosses a
param, so one launch serves any number of params. Tiles over alignment gaps copy
nothing. Per-param destinations are reached through a table of int64 addresses.
The copy never casts, so it moves raw bits of any dtype ([Note: Raw copies] in
``_dtypes.py``).

[Note: Chunked copies]
A parameter FSDP shards on a dim ``d > 0`` ([Note: Sharding on another dim] in
``runtime/variants/shard_dim.py``) is planned as ``(W, pre * L)``: rank ``r``'s ``n =
pre * L`` elements are its local shard, ``pre`` runs of ``L`` (the shard's size
on ``d`` times the numel of the dims after it), and in the unsharded parameter
run ``a`` of rank ``r`` starts at ``(a * W + r) * L``, not at ``r * n + a * L``.
The optional table ``chunk_numel`` gives ``L`` per param (``n`` for a param
sharded on dim 0, which makes both formulas one); with it, element ``j`` of a
rank's segment goes to ``(j // L) * W * L + r * L + j % L``. The kernel reads
and writes each element once, as without it, in the same launch as the group's
other params; ``reduce_scatter_copy_in`` reads gradients by the same map.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fsdp_rs.kernels._checks import (
    check_buffer,
    check_chunk_numel,
    check_layout_tables,
    check_same_device,
    chunk_runs,
    device_of,
    dtype_of,
    host_table,
    unsharded_extent,
)
from fsdp_rs.kernels._cpu_index import copy_out_index
from fsdp_rs.kernels._cpu_tiles import copy_out_tiled
from fsdp_rs.kernels._dtypes import bits, is_copyable
from fsdp_rs.kernels._triton import (
    TL_DTYPES,
    jit,
    kernel_view,
    launch_setting,
    loop_bound,
    pointer_table,
    require_triton,
    tl,
)

__all__ = [
    "check_all_gather_copy_out",
    "torch_all_gather_copy_out",
    "triton_all_gather_copy_out",
]

OP = "all_gather_copy_out"
# Long tiles' (BLOCK, num_warps) ([Note: Launch settings] in _triton.py): on an
# H200, 4096 x 8 against 2048 x 4 took cases a, b and e (64Ki-element tiles)
# from 0.172 / 0.071 / 0.146 ms to 0.167 / 0.068 / 0.104, and cases c and d
# (tiles of 512 and 2048) from 0.040 / 0.035 ms to 0.079 / 0.057.
LONG_TILES = (4096, 8)


def check_all_gather_copy_out(
    all_gather_output: torch.Tensor,
    out: Sequence[torch.Tensor],
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    chunk_numel: torch.Tensor | None = None,
) -> None:
    """O(1) checks, plus one per output tensor when ``out`` holds one per param.

    With one param the two layouts coincide (its unsharded offset is 0), so a
    single ``out`` tensor always means the group buffer."""
    check_buffer(OP, "all_gather_output", all_gather_output, 2)
    num_params = check_layout_tables(
        OP, row_offsets, unsharded_offsets, padded_numel, tile_param, tile_start, tile_len
    )
    check_chunk_numel(OP, chunk_numel, num_params, row_offsets)
    if len(out) not in (1, num_params):
        raise ValueError(
            f"{OP}: out must hold the group's unsharded buffer (1 tensor) or one tensor per "
            f"param ({num_params}), got {len(out)}"
        )
    check_same_device(
        OP,
        [
            ("all_gather_output", all_gather_output),
            ("row_offsets", row_offsets),
            ("tile_param", tile_param),
        ],
    )
    if _plain_outputs(out, all_gather_output):
        return
    for i, t in enumerate(out):  # name the first offender
        check_buffer(OP, f"out[{i}]", t, 1)
        if t.dtype != all_gather_output.dtype or t.device != all_gather_output.device:
            raise ValueError(
                f"{OP}: out[{i}] is {t.dtype} on {t.device} but all_gather_output is "
                f"{all_gather_output.dtype} on {all_gather_output.device}; the copy-out does "
                "not cast: allocate unsharded tensors in the param dtype on the same device"
            )


def _check_buffer_size(
    buffer: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    world_size: int,
) -> None:
    """The group's unsharded buffer holds every param's ``W * n`` elements at
    its offset."""
    need = unsharded_extent(unsharded_offsets, padded_numel, world_size)
    if buffer.numel() < need:
        raise ValueError(
            f"{OP}: out[0] (the group's unsharded buffer) has {buffer.numel()} elements, "
            f"but the params span {need}; pass the buffer the plan was made for"
        )


def _check_output_sizes(
    out: Sequence[torch.Tensor], numel: np.ndarray, padded: np.ndarray, world_size: int
) -> None:
    """Per-param outputs (their ``numel``): each has ``W * padded_numel``
    elements; one NumPy comparison, the loop only to name the offender."""
    if np.array_equal(numel, padded * world_size):
        return
    for i, (t, n) in enumerate(zip(out, padded.tolist(), strict=True)):
        if t.numel() != world_size * n:
            raise ValueError(
                f"{OP}: out[{i}] has {t.numel()} elements, not world_size * padded_numel "
                f"({world_size} * {n})"
            )


def _plain_outputs(out: Sequence[torch.Tensor], all_gather_output: torch.Tensor) -> bool:
    """Every output a contiguous 1-D tensor of ``all_gather_output``'s dtype and
    device: C-level ``map``s, constant Python calls whatever the number of
    outputs ([Note: Host cost] in ``bench/copy.py``)."""
    if not set(map(type, out)) <= _TENSOR_TYPES:
        return False
    ok = set(map(dtype_of, out)) == {all_gather_output.dtype}
    ok = ok and set(map(device_of, out)) == {all_gather_output.device}
    ok = ok and set(map(torch.Tensor.dim, out)) == {1}
    return ok and all(map(torch.Tensor.is_contiguous, out)) and is_copyable(out[0].dtype)


_TENSOR_TYPES = {torch.Tensor, torch.nn.Parameter}


def torch_all_gather_copy_out(
    all_gather_output: torch.Tensor,
    out: Sequence[torch.Tensor],
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    chunk_numel: torch.Tensor | None = None,
    *,
    checked: bool = True,
) -> None:
    """Reference. Into the group buffer: one gather by a cached element index
    ([Note: Cached CPU indices]), no loop over params or ranks (the tile table
    is only checked). Per-param outputs by one strided copy each.
    With ``chunk_numel``, one strided copy per param ([Note: Chunked copies])."""
    if checked:  # [Note: Trusted calls]
        check_all_gather_copy_out(
            all_gather_output, out, row_offsets, unsharded_offsets, padded_numel,
            tile_param, tile_start, tile_len, chunk_numel,
        )  # fmt: skip
    world_size, row_numel = all_gather_output.shape
    all_gather_output, out = bits(all_gather_output), list(map(bits, out))
    if chunk_numel is not None:
        _copy_out_chunked(all_gather_output, out, row_offsets, unsharded_offsets, padded_numel,
                          chunk_numel)  # fmt: skip
        return
    if len(out) == 1:
        if checked:
            _check_buffer_size(out[0], unsharded_offsets, padded_numel, world_size)
        index = copy_out_index(
            row_offsets, unsharded_offsets, padded_numel, world_size, row_numel, out[0].numel(),
            trusted=not checked,
        )  # fmt: skip
        flat = all_gather_output.view(-1)
        if index is None:  # over the index budget: [Note: Tiled indices]
            tables = (row_offsets, unsharded_offsets, padded_numel)
            copy_out_tiled(all_gather_output, out[0], *tables, trusted=not checked)
        elif index[0] is None:
            torch.index_select(flat, 0, index[1], out=out[0])
        else:
            dst, src = index
            out[0].scatter_(0, dst, flat.index_select(0, src))
        return
    # One strided copy per param: no index, no temporary (the traced hooks'
    # per-parameter outputs are allocated inside the graph, so a temporary here
    # would add to the step's peak).
    numel = np.fromiter(map(torch.Tensor.numel, out), np.int64, len(out))
    padded = host_table(padded_numel)
    if checked:
        _check_output_sizes(out, numel, padded, world_size)
    for t, r, n in zip(out, row_offsets.tolist(), padded.tolist(), strict=True):
        t.view(world_size, n).copy_(all_gather_output[:, r : r + n])


def _copy_out_chunked(
    all_gather_output: torch.Tensor,
    out: list[torch.Tensor],
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    chunk_numel: torch.Tensor,
) -> None:
    """Each param's ``(W, pre, L)`` row block into its unsharded ``(pre, W, L)``."""
    world_size = all_gather_output.size(0)
    padded = padded_numel.tolist()
    runs = chunk_runs(padded, chunk_numel, OP)
    starts = unsharded_offsets.tolist() if len(out) == 1 else [0] * len(padded)
    for p, (r, n, run, u) in enumerate(
        zip(row_offsets.tolist(), padded, runs, starts, strict=True)
    ):
        if n == 0:
            continue
        dst = out[0] if len(out) == 1 else out[p]
        pre = n // run
        if u + world_size * n > dst.numel():
            raise ValueError(f"{OP}: param {p} ends past its output ({dst.numel()} elements)")
        view = dst.as_strided(
            (pre, world_size, run), (world_size * run, run, 1), dst.storage_offset() + u
        )
        block = all_gather_output[:, r : r + n].view(world_size, pre, run)
        view.copy_(block.transpose(0, 1))


@jit
def _copy_out_kernel(
    src,
    dst,
    dst_ptrs,
    dst_numel,
    row_offsets,
    unsharded_offsets,
    padded_numel,
    tile_param,
    tile_start,
    tile_len,
    chunk_numel,
    row_numel,
    out_numel,
    PER_PARAM: tl.constexpr,
    CHUNKED: tl.constexpr,
    DTYPE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Offsets and counts below are in words of DTYPE: the tables' elements
    # times WORDS ([Note: Raw copies]); row_numel, out_numel and dst_numel come
    # in words.
    tile = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    p = tl.load(tile_param + tile)
    start = tl.load(tile_start + tile) * WORDS
    n = tl.load(padded_numel + p) * WORDS
    # Tiles over the alignment gap after a param's n elements copy nothing.
    count = tl.minimum(tl.load(tile_len + tile).to(tl.int64) * WORDS, n - start)
    # The clamps below keep every access inside the buffers whatever the tables
    # hold (the launcher cannot check table contents without a synchronization).
    row_offset = tl.load(row_offsets + p) * WORDS
    count = tl.minimum(count, row_numel - row_offset - start)
    src_base = src + rank * row_numel + row_offset + start
    if CHUNKED:  # [Note: Chunked copies]
        run = tl.maximum(tl.load(chunk_numel + p) * WORDS, 1)
        world = tl.num_programs(1).to(tl.int64)
        if PER_PARAM:
            param_base = tl.load(dst_ptrs + p).to(tl.pointer_type(DTYPE))
            limit = tl.load(dst_numel + p)
        else:
            param_offset = tl.load(unsharded_offsets + p) * WORDS
            param_base = dst + param_offset
            limit = out_numel - param_offset
        for i in range(0, loop_bound(count), BLOCK):
            offs = i + tl.arange(0, BLOCK)
            j = start + offs
            to = (j // run) * (world * run) + rank * run + j % run
            mask = (offs < count) & (to < limit)
            tl.store(param_base + to, tl.load(src_base + offs, mask=mask), mask=mask)
    else:
        if PER_PARAM:
            count = tl.minimum(count, tl.load(dst_numel + p) - rank * n - start)
            dst_base = tl.load(dst_ptrs + p).to(tl.pointer_type(DTYPE)) + rank * n + start
        else:
            dst_offset = tl.load(unsharded_offsets + p) * WORDS + rank * n + start
            count = tl.minimum(count, out_numel - dst_offset)
            dst_base = dst + dst_offset
        for i in range(0, loop_bound(count), BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < count
            tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)


def triton_all_gather_copy_out(
    all_gather_output: torch.Tensor,
    out: Sequence[torch.Tensor],
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    chunk_numel: torch.Tensor | None = None,
    *,
    checked: bool = True,
) -> None:
    """One launch, grid (tiles, world size), whatever the number of params."""
    require_triton()
    if checked:  # [Note: Trusted calls]
        check_all_gather_copy_out(
            all_gather_output, out, row_offsets, unsharded_offsets, padded_numel,
            tile_param, tile_start, tile_len, chunk_numel,
        )  # fmt: skip
    num_tiles = tile_param.numel()
    if num_tiles == 0 or all_gather_output.shape[0] == 0:
        return
    world_size = all_gather_output.shape[0]
    per_param = len(out) > 1
    # The kernel bounds its writes by each output's numel: an output too small
    # would silently miss elements. Checked on the tables' host copies.
    if per_param:
        numel = np.fromiter(map(torch.Tensor.numel, out), np.int64, len(out))
        if checked:
            _check_output_sizes(out, numel, host_table(padded_numel), world_size)
    elif checked:
        _check_buffer_size(out[0], unsharded_offsets, padded_numel, world_size)
    dtype = all_gather_output.dtype
    all_gather_output, words = kernel_view(all_gather_output)
    if all_gather_output.dtype != dtype:  # raw copies of a non-float dtype
        out = [kernel_view(t)[0] for t in out]
    row_numel = all_gather_output.shape[1]  # in words
    if per_param:
        dst_ptrs, dst_numel = pointer_table(out, all_gather_output.device, 1, out, numel * words)
    else:
        dst_ptrs = dst_numel = row_offsets  # unused
    block, warps = launch_setting(row_numel, num_tiles, LONG_TILES)
    _copy_out_kernel[(num_tiles, world_size)](
        all_gather_output,
        out[0],
        dst_ptrs,
        dst_numel,
        row_offsets,
        unsharded_offsets,
        padded_numel,
        tile_param,
        tile_start,
        tile_len,
        row_offsets if chunk_numel is None else chunk_numel,  # unused without
        row_numel,
        out[0].numel(),
        PER_PARAM=per_param,
        CHUNKED=chunk_numel is not None,
        DTYPE=TL_DTYPES[all_gather_output.dtype],
        WORDS=words,
        BLOCK=block,
        num_warps=warps,
    )
