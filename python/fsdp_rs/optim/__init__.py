"""Optimizer-side operations over fsdp-rs's sharded gradients, per parameter
group rather than per parameter: ``FlatOptimizer`` and ``clip_grad_norm_``.

This room sits above ``fsdp_rs.runtime`` and reads the groups' gradient buffers
through ``fsdp_rs.runtime.group.grad_buffers`` only.
"""

from fsdp_rs.optim.clip import clip_grad_norm_
from fsdp_rs.optim.flat import ELEMENTWISE, FlatOptimizer

__all__ = ["ELEMENTWISE", "FlatOptimizer", "clip_grad_norm_"]
