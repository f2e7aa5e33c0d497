"""Shared test set-up: Triton kernels run in the interpreter on CPU-only machines.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined,
so it is set here, before the tests import ``fsdp_rs.kernels``. With a CUDA
device the kernels compile and run for real.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
