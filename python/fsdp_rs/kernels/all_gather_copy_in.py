"""All-gather copy-in: the group's sharded buffer -> this rank's all-gather row.

The sharded buffer (original dtype) and every all-gather row (param dtype) share
one element layout ([Note: Row layout] in ``rust/planner/src/group.rs``), so the
copy-in is one flat copy of ``row_numel`` elements, with the cast to the param
dtype fused in for mixed precision (round to nearest even on CUDA, like torch).
"""

from __future__ import annotations

import torch

from fsdp_rs.kernels._checks import check_arithmetic, check_buffer, check_same_device
from fsdp_rs.kernels._dtypes import bits
from fsdp_rs.kernels._triton import cdiv, jit, kernel_view, require_triton, tl

__all__ = ["check_all_gather_copy_in", "torch_all_gather_copy_in", "triton_all_gather_copy_in"]

OP = "all_gather_copy_in"
BLOCK = 4096


def _check_cast(sharded: torch.Tensor, all_gather_output: torch.Tensor) -> None:
    check_arithmetic(
        OP,
        ("sharded", sharded.dtype),
        ("all_gather_output", all_gather_output.dtype),
        raw="allocate all_gather_output in the sharded buffer's dtype",
    )


def check_all_gather_copy_in(
    sharded: torch.Tensor, all_gather_output: torch.Tensor, rank: int, *, tables: bool = True
) -> None:
    """The arguments; with ``tables=False`` (a trusted call, [Note: Trusted
    calls]) only the cast's dtypes, what a step can change."""
    if not tables:
        _check_cast(sharded, all_gather_output)
        return
    check_buffer(OP, "sharded", sharded, 1)
    check_buffer(OP, "all_gather_output", all_gather_output, 2)
    _check_cast(sharded, all_gather_output)
    check_same_device(OP, [("sharded", sharded), ("all_gather_output", all_gather_output)])
    world_size, row_numel = all_gather_output.shape
    if row_numel != sharded.numel():
        raise ValueError(
            f"{OP}: all_gather_output rows hold {row_numel} elements but the sharded buffer has "
            f"{sharded.numel()}; allocate all_gather_output as [world_size, plan.row_numel]"
        )
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{OP}: rank {rank} is out of range for all_gather_output of {world_size} rows"
        )


def torch_all_gather_copy_in(
    sharded: torch.Tensor, all_gather_output: torch.Tensor, rank: int, *, checked: bool = True
) -> None:
    """Reference: ``all_gather_output[rank] = sharded.to(param dtype)``."""
    check_all_gather_copy_in(sharded, all_gather_output, rank, tables=checked)
    if sharded.dtype == all_gather_output.dtype:  # raw bits, any dtype
        sharded, all_gather_output = bits(sharded), bits(all_gather_output)
    all_gather_output[rank].copy_(sharded)


@jit
def _copy_in_kernel(src, dst, numel, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=mask)


def triton_all_gather_copy_in(
    sharded: torch.Tensor, all_gather_output: torch.Tensor, rank: int, *, checked: bool = True
) -> None:
    """One launch: a flat (casting) copy into row ``rank``."""
    require_triton()
    check_all_gather_copy_in(sharded, all_gather_output, rank, tables=checked)
    if sharded.numel() == 0:
        return
    # Casts are between float dtypes, which kernel_view keeps as they are.
    (sharded, _), (all_gather_output, _) = map(kernel_view, (sharded, all_gather_output))
    numel = sharded.numel()  # in int64 words for a 16-byte dtype
    _copy_in_kernel[(cdiv(numel, BLOCK),)](
        sharded, all_gather_output[rank], numel, BLOCK=BLOCK, num_warps=8
    )
