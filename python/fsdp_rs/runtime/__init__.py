"""The ``fully_shard`` runtime, one subpackage per responsibility:

- ``api``: what users call (``fully_shard``, ``FSDPModule``, ``auto_shard``, policies);
- ``group``: one param group: its buffers and parameters, unshard, reduction;
- ``variants``: groups that differ from the plain one (extensions, ``Shard(d)``,
  N-D meshes, spmd_types, one group per dtype);
- ``step``: the hooks that drive a training step, the root, lazy init, finalize;
- ``comm``: meshes, collectives, streams;
- ``checks``: what the ranks must agree on (plans, trainable sets, optimizers);
- ``compile``: ``torch.compile`` (eager hooks Dynamo skips, traced hooks);
- ``memory``: a step's peak memory, predicted before it runs.

Each subpackage's docstring names its files. ``docs/step.md`` walks one training
step through them.
"""

from fsdp_rs.runtime.api.auto_shard import auto_shard, auto_shard_groups
from fsdp_rs.runtime.api.fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp_rs.runtime.api.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp_rs.runtime.memory.activation_profile import (
    ActivationProfile,
    Activations,
    activation_profile,
)
from fsdp_rs.runtime.memory.memory_plan import predict_memory
from fsdp_rs.runtime.step.finalize import GradientReductionHandle

__all__ = [
    "ActivationProfile",
    "Activations",
    "CPUOffloadPolicy",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "activation_profile",
    "auto_shard",
    "auto_shard_groups",
    "fully_shard",
    "predict_memory",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
