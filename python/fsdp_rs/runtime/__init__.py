"""The ``fully_shard`` runtime: param groups, their state machine, hooks and API.

Files by responsibility, as in torch FSDP2: ``policies`` (the policy classes),
``mesh`` (process groups of a device mesh), ``params`` (sharded and unsharded
parameter views of the group buffers), ``collectives`` (gradient divide
factors), ``param_group`` (one planner call, buffers and parameters), ``unshard``
(the SHARDED / UNSHARDED / SHARDED_POST_FORWARD transitions),
``finalize`` (who ends a backward iteration: the end of backward, or the
caller's ``finalize_backward``),
``gradients`` (gradient buffers and the post-backward reduction),
``streams`` (side streams, events and cross-stream lifetimes on accelerators),
``bundle`` (one group per dtype, driven as one),
``state`` (module hooks, root and lazy init), ``plan_check`` (the ranks agree
on what they planned, at lazy init), ``compile`` (what Dynamo must not trace),
``containers`` (tensors in module inputs and outputs), ``comms`` and
``comm_api`` (custom collectives and the methods that set them), ``api``
(``fully_shard`` and ``FSDPModule``), ``auto_shard`` (``fully_shard`` over a
whole model in groups the planner chooses), ``memory_plan`` (a step's peak memory,
predicted from the plans before it runs) and ``activation_profile`` (what the
forward leaves for backward, measured on a copy that holds no memory).
"""

from fsdp_rs.runtime.activation_profile import ActivationProfile, Activations, activation_profile
from fsdp_rs.runtime.api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from fsdp_rs.runtime.auto_shard import auto_shard, auto_shard_groups
from fsdp_rs.runtime.comm_api import share_comm_ctx
from fsdp_rs.runtime.finalize import GradientReductionHandle
from fsdp_rs.runtime.memory_plan import predict_memory
from fsdp_rs.runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

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
