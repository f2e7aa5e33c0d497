"""Triton copy kernels (copy-in, copy-out, reduce-scatter copy-in, post-reduce).

Triton is imported lazily: importing ``fsdp_rs.kernels`` never requires it, so
CPU-only installs work. ``triton_available()`` says whether kernels can run.
"""

import functools
import importlib.util

__all__ = ["triton_available"]


@functools.cache
def triton_available() -> bool:
    """True when Triton is importable and torch sees a CUDA device."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()
