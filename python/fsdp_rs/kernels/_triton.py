"""Optional Triton import shared by the kernel files.

Every kernel file defines its ``@jit`` kernel at import time, next to its torch
reference. Where Triton is missing (a CPU-only install on a platform without
Triton wheels) the decorator keeps the file importable, so the references and
the CPU ops still work, and launching a kernel raises a RuntimeError that says
what to install.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without Triton
    triton = None
    tl = None

from fsdp_rs.kernels._checks import is_none
from fsdp_rs.kernels._dtypes import bits, bits_dtype, words

__all__ = [
    "TL_DTYPES",
    "cdiv",
    "f32_reciprocal",
    "jit",
    "kernel_dtype",
    "kernel_view",
    "launch_setting",
    "loop_bound",
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


SMALL_TILES = (2048, 4)
"""(BLOCK, num_warps) of the tiled copies when tiles are short."""
LONG_TILE = 16384
"""The mean tile length (in the kernel's words) from which a launch takes its
kernel's setting for long tiles."""


def launch_setting(row_numel: int, num_tiles: int, long_tiles: tuple[int, int]) -> tuple[int, int]:
    """(BLOCK, num_warps) of a tiled copy launch.

    [Note: Launch settings]
    A program copies one tile of the planner's tile table (at most 64Ki
    elements of one param), ``BLOCK`` elements per loop step. On an H200
    (tools/sweep_copy_kernels.py, bench copy's groups at scale 1/4, W = 8) the
    best setting depended on the tiles' length, not on the kernel alone: groups
    of large params (full 64Ki tiles) ran up to 10% faster with larger steps or
    more warps (and a Shard(1) copy-out 40% faster), while groups of small
    params (tiles of 512 to 2048 elements) ran 2 to 4 times slower with them
    than with 2048 x 4, the masked lanes of each step doing no copying. The
    host knows the mean tile length without reading a table (the row's length
    over the number of tiles), so each launch picks: ``long_tiles`` from a mean
    of ``LONG_TILE`` words, else ``SMALL_TILES``. Any setting copies the same
    bytes; only the speed differs."""
    return long_tiles if row_numel >= LONG_TILE * num_tiles else SMALL_TILES


def jit(fn: Any) -> Any:
    """``triton.jit`` when Triton is importable, else a stub that raises on launch."""
    if triton is not None:
        return triton.jit(fn)

    class _Missing:  # pragma: no cover - exercised only without Triton
        def __getitem__(self, grid: Any) -> Any:
            require_triton()

    return _Missing()


def pointer_table(
    tensors: Sequence[torch.Tensor | None],
    device: torch.device,
    words: int = 1,
    present: list[torch.Tensor] | None = None,
    numel: np.ndarray | None = None,
    at: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's address and ``numel * words`` (0 and 0 for None) as two
    contiguous int64 columns on ``device``, in one upload; see [Note: Pointer
    tables] in reduce_scatter_copy_in.py. The attributes are read by C-level
    ``map``s into NumPy, not a Python loop: about 0.1 us per tensor.
    ``present``: ``tensors`` without the Nones, ``numel`` their numels and
    ``at`` where they sit in ``tensors`` (a mask or a full slice), where the
    caller has them."""
    count = len(tensors)
    table = np.zeros((2, count), np.int64)
    if present is None:
        present = list(itertools.filterfalse(is_none, tensors))
    if at is None and len(present) == count:
        at = slice(None)
    elif at is None:
        at = ~np.fromiter(map(is_none, tensors), bool, count)
    table[0, at] = np.fromiter(map(torch.Tensor.data_ptr, present), np.int64, len(present))
    if numel is None:
        numel = np.fromiter(map(torch.Tensor.numel, present), np.int64, len(present))
    table[1, at] = numel
    if words != 1:
        table[1] *= words
    uploaded = torch.from_numpy(table).to(device, non_blocking=True)
    return uploaded[0], uploaded[1]


def f32_reciprocal(divide_factor: float) -> float:
    """``1 / divide_factor`` rounded to float32, what CUDA kernels multiply by
    ([Note: Division by a scalar] in post_reduce.py)."""
    return float(np.float32(1.0) / np.float32(divide_factor))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a kernel reads or writes for ``t``, and the int64 words per element
    (``WORDS``) it scales its element offsets by: a float tensor as it is, any
    other as its same-width integer view, a 16-byte dtype as two int64 words
    per element ([Note: Raw copies] in ``_dtypes.py``)."""
    return bits(t, words_too=True), words(t.dtype)


TL_DTYPES: dict[torch.dtype, Any] = (
    {}
    if tl is None
    else {
        torch.float32: tl.float32,
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float64: tl.float64,
        torch.int8: tl.int8,
        torch.int16: tl.int16,
        torch.int32: tl.int32,
        torch.int64: tl.int64,
    }
)
"""The Triton element type of each dtype a kernel sees (``kernel_view``'s)."""


def kernel_dtype(dtype: torch.dtype) -> Any:
    """The Triton element type a kernel sees for a ``dtype`` tensor (that of
    its ``kernel_view``)."""
    return TL_DTYPES[bits_dtype(dtype, words_too=True)]


def _loop_bound_interpreted(x: Any) -> Any:
    handle = getattr(x, "handle", None)
    if handle is None:
        return x
    return int(np.asarray(handle.data).reshape(-1)[0])


# [Note: Loop bounds in the interpreter]
# ``loop_bound(x)`` is what a kernel's ``range`` loop takes for a scalar bound
# ``x``. Compiled, it is the identity (inlined: the kernel's IR is the same as
# with ``x`` itself). Triton's interpreter holds a scalar as a shape-(1,) NumPy
# array, which Triton before 3.7 converts for ``range`` with ``int()``; NumPy
# 2.4 refuses that for arrays of ndim > 0 (deprecated since NumPy 1.25).
# Interpreted, ``loop_bound`` therefore returns the Python int itself.
if triton is None:  # pragma: no cover - exercised only without Triton
    loop_bound = _loop_bound_interpreted
else:

    @triton.jit
    def loop_bound(x):
        return x

    if not isinstance(loop_bound, triton.runtime.JITFunction):  # TRITON_INTERPRET=1
        loop_bound = _loop_bound_interpreted
