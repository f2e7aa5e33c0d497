"""Post-reduce: reduce-scatter output -> the group's sharded gradient buffer.

The reduce-scatter output (reduce dtype) and the sharded gradient buffer
(original dtype) share the row layout, so this is one flat pass: divide by the
gradient divide factor in the reduce dtype, cast to the original dtype, then
assign or accumulate. Rounding follows torch step by step: the division result
is rounded to the reduce dtype, the cast to the original dtype, and an
accumulation adds in float32 and rounds once, as ``grad += new`` does. A call
that neither casts, divides nor accumulates moves raw bits, any dtype ([Note:
Raw copies] in ``_dtypes.py``).

[Note: Division by a scalar]
torch divides a tensor by a Python scalar differently per device: CPU kernels
divide, CUDA kernels multiply by the float32 reciprocal. The CPU op (the torch
reference) and the CUDA kernel each follow their device's torch, so fsdp-rs
gradients equal FSDP2's bit for bit on both. Division by a power of two is
exact either way.
"""

from __future__ import annotations

import torch

from fsdp_rs.kernels._checks import (
    check_arithmetic,
    check_buffer,
    check_divide_factor,
    check_same_device,
)
from fsdp_rs.kernels._dtypes import bits
from fsdp_rs.kernels._triton import cdiv, f32_reciprocal, jit, kernel_view, require_triton, tl

__all__ = ["check_post_reduce", "torch_post_reduce", "triton_post_reduce"]

OP = "post_reduce"
BLOCK = 4096


def check_post_reduce(
    reduce_scatter_output: torch.Tensor,
    sharded_grad: torch.Tensor,
    divide_factor: float = 1.0,
    accumulate: bool = False,
    *,
    tables: bool = True,
) -> None:
    """The arguments; with ``tables=False`` (a trusted call, [Note: Trusted
    calls]) only the arithmetic's dtypes, what a step can change."""
    if not tables:
        _check_arithmetic(reduce_scatter_output, sharded_grad, divide_factor, accumulate)
        return
    check_buffer(OP, "reduce_scatter_output", reduce_scatter_output, 1)
    check_buffer(OP, "sharded_grad", sharded_grad, 1)
    check_same_device(
        OP, [("reduce_scatter_output", reduce_scatter_output), ("sharded_grad", sharded_grad)]
    )
    if reduce_scatter_output.numel() != sharded_grad.numel():
        raise ValueError(
            f"{OP}: reduce_scatter_output has {reduce_scatter_output.numel()} elements but "
            f"sharded_grad has {sharded_grad.numel()}; both must hold plan.row_numel elements"
        )
    check_divide_factor(OP, divide_factor)
    _check_arithmetic(reduce_scatter_output, sharded_grad, divide_factor, accumulate)


def _check_arithmetic(
    reduce_scatter_output: torch.Tensor,
    sharded_grad: torch.Tensor,
    divide_factor: float,
    accumulate: bool,
) -> None:
    check_arithmetic(
        OP,
        ("reduce_scatter_output", reduce_scatter_output.dtype),
        ("sharded_grad", sharded_grad.dtype),
        raw="the same dtype on both sides, divide_factor=1.0, accumulate=False",
        divide=divide_factor != 1.0,
        accumulate=bool(accumulate),
    )


def torch_post_reduce(
    reduce_scatter_output: torch.Tensor,
    sharded_grad: torch.Tensor,
    divide_factor: float = 1.0,
    accumulate: bool = False,
    *,
    checked: bool = True,
) -> None:
    """Reference: ``grad (+)= (output / divide_factor).to(orig dtype)``."""
    check_post_reduce(
        reduce_scatter_output, sharded_grad, divide_factor, accumulate, tables=checked
    )
    if reduce_scatter_output.dtype == sharded_grad.dtype and not (
        reduce_scatter_output.is_complex() and (divide_factor != 1.0 or accumulate)
    ):  # raw bits, unless complex arithmetic ([Note: Complex gradients])
        reduce_scatter_output, sharded_grad = bits(reduce_scatter_output), bits(sharded_grad)
    reduced = reduce_scatter_output
    if divide_factor != 1.0:
        reduced = reduced / divide_factor
    if accumulate:
        sharded_grad += reduced.to(sharded_grad.dtype)
    else:
        sharded_grad.copy_(reduced)


@jit
def _post_reduce_kernel(
    src,
    dst,
    numel,
    inv_factor,
    HAS_DIV: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(src + offs, mask=mask)
    if HAS_DIV:
        x = (x.to(tl.float32) * inv_factor).to(src.dtype.element_ty)
    y = x.to(dst.dtype.element_ty)
    if ACCUMULATE:
        old = tl.load(dst + offs, mask=mask)
        y = (old.to(tl.float32) + y.to(tl.float32)).to(dst.dtype.element_ty)
    tl.store(dst + offs, y, mask=mask)


def triton_post_reduce(
    reduce_scatter_output: torch.Tensor,
    sharded_grad: torch.Tensor,
    divide_factor: float = 1.0,
    accumulate: bool = False,
    *,
    checked: bool = True,
) -> None:
    """One launch over the row; see [Note: Division by a scalar]."""
    require_triton()
    check_post_reduce(
        reduce_scatter_output, sharded_grad, divide_factor, accumulate, tables=checked
    )
    if sharded_grad.numel() == 0:
        return
    if sharded_grad.is_complex() and (divide_factor != 1.0 or accumulate):
        # torch's complex arithmetic, as FSDP2's ([Note: Complex gradients])
        torch_post_reduce(reduce_scatter_output, sharded_grad, divide_factor, accumulate,
                          checked=False)  # fmt: skip
        return
    # Arithmetic is between float dtypes, which kernel_view keeps as they are.
    (reduce_scatter_output, _), (sharded_grad, _) = map(
        kernel_view, (reduce_scatter_output, sharded_grad)
    )
    numel = sharded_grad.numel()  # in int64 words for a 16-byte dtype
    inv = f32_reciprocal(divide_factor)
    _post_reduce_kernel[(cdiv(numel, BLOCK),)](
        reduce_scatter_output,
        sharded_grad,
        numel,
        inv,
        HAS_DIV=divide_factor != 1.0,
        ACCUMULATE=bool(accumulate),
        BLOCK=BLOCK,
        num_warps=8,
        enable_fp_fusion=False,  # multiply, then add: two roundings, as torch
    )
