"""Argument checks shared by the kernel launchers, the torch references and the
fake impls. Each raises TypeError (wrong dtype or type) or ValueError (wrong
shape, device or layout) naming the argument and the fix; none reads tensor data,
so the checks are cheap and never synchronize a device.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import numpy as np
import torch

from fsdp_rs.kernels._dtypes import COMPLEX_DTYPES, FLOAT_DTYPES, FLOAT_NAMES, is_copyable

__all__ = [
    "check_arithmetic",
    "check_buffer",
    "check_chunk_numel",
    "check_divide_factor",
    "check_layout_tables",
    "check_same_device",
    "check_table",
    "check_tile_table",
    "chunk_runs",
    "device_of",
    "dtype_of",
    "is_none",
]

# C-level callables for ``map`` over tensor lists: checks whose Python cost
# does not grow with the number of tensors ([Note: Pointer tables]).
dtype_of = operator.attrgetter("dtype")
device_of = operator.attrgetter("device")
is_none = functools.partial(operator.is_, None)  # `None in tensors` would call Tensor.__eq__


def check_buffer(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    """``t`` is a contiguous ``ndim``-D tensor of a dtype a copy can move as raw
    bits ([Note: Raw copies] in ``_dtypes.py``): any but the quantized ones."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not is_copyable(t.dtype):
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}, which is not plain memory; supported are "
            "every dtype but the quantized ones"
        )
    if t.dim() != ndim:
        layout = "[world_size, row_numel]" if ndim == 2 else "one flat buffer"
        raise ValueError(
            f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}; pass the group "
            f"buffer as {layout}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass the group buffer, not a strided view of it"
        )


def check_arithmetic(
    op: str,
    src: tuple[str, torch.dtype],
    dst: tuple[str, torch.dtype],
    raw: str,
    divide: bool = False,
    accumulate: bool = False,
) -> None:
    """A copy from dtype ``src`` into ``dst`` (each with its argument's name)
    that casts (the dtypes differ), divides or accumulates needs float dtypes
    on both sides, or one complex dtype on both if it does not cast ([Note:
    Complex gradients]); one that does none of these moves raw bits of any
    dtype ([Note: Raw copies]). ``raw`` says what to pass for a raw copy."""
    cast = src[1] != dst[1]
    if not (cast or divide or accumulate):
        return
    for name, dtype in (src, dst):
        if dtype not in FLOAT_DTYPES and (cast or dtype not in COMPLEX_DTYPES):
            steps = [f"casts {src[1]} to {dst[1]}"] if cast else []
            steps += ["divides by divide_factor"] * divide + ["accumulates"] * accumulate
            raise TypeError(
                f"{op}: {name} has dtype {dtype}, but this call {' and '.join(steps)}, which "
                f"is supported for {FLOAT_NAMES} (complex64 and complex128 too without a "
                f"cast); any other dtype is copied only bit for bit ({raw})"
            )


def check_same_device(op: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    first_name, first = tensors[0]
    for name, t in tensors[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; "
                "move the plan tables to the buffers' device once per group "
                "(fsdp_rs.ops.GroupTables.from_plan(plan, device))"
            )


def check_table(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, numel: int) -> None:
    """``t`` is a contiguous 1-D ``dtype`` table of ``numel`` entries."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(
            f"{op}: table {name} has dtype {t.dtype}, expected {dtype} as the planner makes it"
        )
    if t.dim() != 1 or t.numel() != numel or not t.is_contiguous():
        raise ValueError(
            f"{op}: table {name} must be a contiguous 1-D tensor of {numel} entries, got shape "
            f"{tuple(t.shape)}; pass the tables of the plan these buffers were sized from"
        )


def check_tile_table(
    op: str, tile_param: torch.Tensor, tile_start: torch.Tensor, tile_len: torch.Tensor
) -> int:
    """The three tile-table columns agree; returns the number of tiles."""
    num_tiles = tile_param.numel() if isinstance(tile_param, torch.Tensor) else -1
    check_table(op, "tile_param", tile_param, torch.int32, num_tiles)
    check_table(op, "tile_start", tile_start, torch.int64, num_tiles)
    check_table(op, "tile_len", tile_len, torch.int32, num_tiles)
    return num_tiles


def check_divide_factor(op: str, divide_factor: float) -> None:
    if not (divide_factor > 0 and math.isfinite(divide_factor)):
        raise ValueError(
            f"{op}: divide_factor must be a finite number > 0, got {divide_factor}; "
            "pass 1.0 for no division"
        )


def check_layout_tables(
    op: str,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
) -> int:
    """The tables that map the row layout to the unsharded-buffer layout agree
    on the number of params, which is returned."""
    num_params = row_offsets.numel() if isinstance(row_offsets, torch.Tensor) else -1
    for name, table in (
        ("row_offsets", row_offsets),
        ("unsharded_offsets", unsharded_offsets),
        ("padded_numel", padded_numel),
    ):
        check_table(op, name, table, torch.int64, num_params)
    check_tile_table(op, tile_param, tile_start, tile_len)
    return num_params


def check_chunk_numel(
    op: str, chunk_numel: torch.Tensor | None, num_params: int, like: torch.Tensor
) -> None:
    """The optional per-param run table of parameters sharded on a dim > 0
    ([Note: Chunked copies] in ``all_gather_copy_out.py``): int64, one entry per
    param, on the buffers' device."""
    if chunk_numel is None:
        return
    check_table(op, "chunk_numel", chunk_numel, torch.int64, num_params)
    check_same_device(op, [("chunk_numel", chunk_numel), ("row_offsets", like)])


def chunk_runs(padded: list[int], chunk_numel: torch.Tensor, op: str) -> list[int]:
    """The host copy of ``chunk_numel`` (the references' loop bounds), each a
    positive divisor of its param's padded shard numel (0 for an empty one)."""
    runs = chunk_numel.tolist()
    for p, (n, run) in enumerate(zip(padded, runs, strict=True)):
        if (run <= 0 and n > 0) or (run > 0 and n % run):
            raise ValueError(
                f"{op}: chunk_numel[{p}] = {run} does not divide param {p}'s shard of {n} "
                "elements; pass (shard size on the sharded dim) * (numel of the dims after it)"
            )
    return runs


_HOST = "_fsdp_rs_host"
_PARAM_NUMEL = "_fsdp_rs_param_numel"


def keep_param_numel(padded_numel: torch.Tensor, numel: np.ndarray) -> None:
    """Keep the params' numels (host) on a plan's ``padded_numel`` table, for
    the size checks of the ops that read per-param tensors ([Note: Gradient
    sizes] in reduce_scatter_copy_in.py)."""
    setattr(padded_numel, _PARAM_NUMEL, numel)


def param_numel(padded_numel: torch.Tensor) -> np.ndarray | None:
    """What ``keep_param_numel`` kept on the table, or None."""
    return getattr(padded_numel, _PARAM_NUMEL, None)


def keep_host(table: torch.Tensor, values: np.ndarray) -> None:
    """Keep ``values`` (what ``table`` was uploaded from) on ``table`` for
    ``host_table``."""
    setattr(table, _HOST, (table._version, values))


def host_table(table: torch.Tensor) -> np.ndarray:
    """A device table's values on the host, for checks that must not wait for
    the device: ``GroupTables`` keeps them on the tables it uploads; another
    table is read back once (one synchronization) and the copy kept on it,
    until the table is written (its version moves)."""
    kept = getattr(table, _HOST, None)
    if kept is None or kept[0] != table._version:
        keep_host(table, table.cpu().numpy())
        kept = getattr(table, _HOST)
    return kept[1]


_EXTENT = "_fsdp_rs_extent"


def unsharded_extent(
    unsharded_offsets: torch.Tensor, padded_numel: torch.Tensor, world_size: int
) -> int:
    """How many elements of the group buffer the params span (``max(u + W *
    n)``), from the tables' host copies; kept on ``padded_numel`` until either
    table is written or another world size asks."""
    key = (world_size, id(unsharded_offsets), unsharded_offsets._version, padded_numel._version)
    kept = getattr(padded_numel, _EXTENT, None)
    if kept is None or kept[0] != key:
        u, n = host_table(unsharded_offsets), host_table(padded_numel)
        kept = (key, int((u + world_size * n).max()) if len(n) else 0)
        setattr(padded_numel, _EXTENT, kept)
    return kept[1]
