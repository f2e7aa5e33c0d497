"""Optional Triton import shared by the kernel files.

Every kernel file defines its ``@jit`` kernel at import time, next to its torch
reference. Where Triton is missing (a CPU-only install on a platform without
Triton wheels) the decorator keeps the file importable, so the references and
the CPU ops still work, and launching a kernel raises a RuntimeError that says
what to install.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without Triton
    triton = None
    tl = None

__all__ = [
    "TL_DTYPES",
    "cdiv",
    "f32_reciprocal",
    "jit",
    "pointer_table",
    "require_triton",
    "tl",
    "triton",
]


def require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            "fsdp_rs kernels need Triton, which is not installed: install the torch "
            "wheel with CUDA support (it brings Triton) or `pip install triton`"
        )


def jit(fn: Any) -> Any:
    """``triton.jit`` when Triton is importable, else a stub that raises on launch."""
    if triton is not None:
        return triton.jit(fn)

    class _Missing:  # pragma: no cover - exercised only without Triton
        def __getitem__(self, grid: Any) -> Any:
            require_triton()

    return _Missing()


def pointer_table(
    entries: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(address, numel) pairs as two contiguous int64 columns on ``device``, in one
    upload; see [Note: Pointer tables] in reduce_scatter_copy_in.py."""
    table = torch.tensor(entries, dtype=torch.int64).t().contiguous()
    table = table.to(device, non_blocking=True)
    return table[0], table[1]


def f32_reciprocal(divide_factor: float) -> float:
    """``1 / divide_factor`` rounded to float32, what CUDA kernels multiply by
    ([Note: Division by a scalar] in post_reduce.py)."""
    return float(np.float32(1.0) / np.float32(divide_factor))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


TL_DTYPES: dict[torch.dtype, Any] = (
    {}
    if tl is None
    else {
        torch.float32: tl.float32,
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float64: tl.float64,
    }
)
