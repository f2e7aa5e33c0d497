"""Several parameter groups that act as one, for a ``fully_shard`` call whose
parameters have more than one dtype.

[Note: One group per dtype]
A group's buffers hold one dtype each (the sharded buffer the original dtype,
the all-gather buffer the parameter dtype), and its copy kernels cast between
exactly two dtypes. A module whose parameters come in several dtypes (a bf16
model with fp32 norms or router weights, say) is therefore sharded as one
group per dtype, and its state drives them through a ``GroupBundle`` as it
would drive one group: the same transitions, hooks and flags, one all-gather
and one reduce-scatter per dtype. FSDP2 shards such a module as one group,
gathering bytes where dtypes differ, and requires the parameters that take
gradients to share one dtype (frozen ones may differ: a bf16 base with fp32
adapters); fsdp-rs matches it there and also trains several trainable dtypes.
Parameters that set another ``grad_dtype`` are split off the same way, one
group per sharded gradient dtype ([Note: Gradient dtype policy]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdp_rs.runtime.step.training_state import TrainingState

__all__ = ["GroupBundle"]


def _on_each(name: str):
    """A bundle method that calls the groups' method ``name`` in turn."""

    def method(self: GroupBundle, *args: Any, **kwargs: Any) -> None:
        for group in self.groups:
            getattr(group, name)(*args, **kwargs)

    method.__name__ = name
    return method


class GroupBundle:
    """The ``FSDPParamGroup`` interface the state and the API use, over several
    groups. Flags set on the bundle are set on every group; read, they are the
    first group's (all hold the same)."""

    def __init__(self, groups: Sequence[Any]) -> None:
        object.__setattr__(self, "groups", tuple(groups))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.groups[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        for group in self.groups:
            setattr(group, name, value)

    @property
    def unshard_pending(self) -> bool:
        return any(group.unshard_pending for group in self.groups)

    @property
    def finalize_pending(self) -> bool:  # [Note: Manual backward finalization]
        return any(group.finalize_pending for group in self.groups)

    @property
    def on_meta(self) -> bool:
        return any(group.on_meta for group in self.groups)

    unshard = _on_each("unshard")
    wait_for_unshard = _on_each("wait_for_unshard")
    prefetch = _on_each("prefetch")
    reshard = _on_each("reshard")
    prepare_gradients = _on_each("prepare_gradients")
    adopt_registered = _on_each("adopt_registered")
    discard_unshard_state = _on_each("discard_unshard_state")
    discard_gradient_state = _on_each("discard_gradient_state")
    restore_types = _on_each("restore_types")

    @property
    def annotations(self) -> list | None:
        """Whether any group has ``spmd_types`` parameters (a list), else None."""
        found = [
            a for group in self.groups if group.annotations is not None for a in group.annotations
        ]
        return found or None

    def post_backward(self) -> None:
        for group in self.groups:  # one training state: set on all ([Note: Training state])
            if group.training_state is not TrainingState.POST_BACKWARD:
                group.post_backward()
