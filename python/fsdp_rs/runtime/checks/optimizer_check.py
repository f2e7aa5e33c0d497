"""An optimizer built before ``fully_shard``, caught at its first step.

[Note: Optimizers built before fully_shard]
``fully_shard`` registers new (sharded DTensor) parameters in the modules; the
original ``nn.Parameter`` objects stay behind, marked with the group that
replaced them (``_fsdp_rs_owner``, which ``collect_params`` also reads) and
their name in it (``_fsdp_rs_fqn``). An optimizer built before ``fully_shard``
(``opt = AdamW(model.parameters()); fully_shard(model)``) holds those
originals: they never get a gradient again, so every ``opt.step()`` changes
nothing, silently, under FSDP2 as under fsdp-rs before this check.

``fully_shard`` therefore registers ``check_optimizer`` as a torch optimizer
step pre-hook for every optimizer (``register_optimizer_step_pre_hook``, the
one global registry torch offers for this): at an optimizer's first step it
looks for a marked parameter in its ``param_groups`` and raises, naming it; an
optimizer that passes is marked itself (``_fsdp_rs_checked`` in its
``__dict__``), so every later step costs one dict lookup, whatever the number
of parameters. One that fails is not marked and raises at every step, on every
rank alike (the ranks build the same model and optimizer). The registration is
idempotent (the hook is looked up in torch's registry first) and does nothing
for an optimizer that holds no replaced parameter, fsdp-rs's or not. No state
of fsdp-rs is kept anywhere: the marks live on the replaced parameters and on
the optimizers, so ranks run as threads and a second model in the process see
only their own. An optimizer whose first step came before ``fully_shard``
replaced its parameters is not checked again (check once, at no cost per step).
``fsdp_rs.optim.FlatOptimizer`` is a torch optimizer and is checked the same
way.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

__all__ = ["FQN_ATTR", "OWNER_ATTR", "register_optimizer_check"]

# Set by fully_shard on each original parameter it replaced.
OWNER_ATTR = "_fsdp_rs_owner"  # the group that replaced it (a description)
FQN_ATTR = "_fsdp_rs_fqn"  # its name under the group's module
_CHECKED = "_fsdp_rs_checked"  # set on an optimizer whose parameters passed


def register_optimizer_check() -> None:
    """Register ``check_optimizer`` for every optimizer, once per process."""
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    if hooks is None or _check_optimizer in hooks.values():
        return  # registered (or a torch without the registry: no check)
    torch_optimizer.register_optimizer_step_pre_hook(_check_optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step pre-hook: see [Note: Optimizers built before fully_shard]."""
    state = vars(optimizer)
    if state.get(_CHECKED):
        return
    for g, group in enumerate(optimizer.param_groups):
        params = group["params"]
        replaced = list(map(hasattr, params, repeat(OWNER_ATTR)))
        if any(replaced):
            i = replaced.index(True)
            p = params[i]
            raise RuntimeError(
                f"fsdp_rs: {type(optimizer).__name__} was built before fully_shard: its "
                f"param_groups[{g}]['params'][{i}] is parameter "
                f"{getattr(p, FQN_ATTR, '?')} (shape {tuple(p.shape)}) of "
                f"{getattr(p, OWNER_ATTR)}, which fully_shard replaced with a sharded "
                "parameter, so this step would change nothing in the model "
                f"({sum(map(sum, _replaced_per_group(optimizer)))} of its parameters were "
                "replaced); build the optimizer after fully_shard, from model.parameters()"
            )
    state[_CHECKED] = True


def _replaced_per_group(optimizer: torch.optim.Optimizer) -> list[list[bool]]:
    return [list(map(hasattr, g["params"], repeat(OWNER_ATTR))) for g in optimizer.param_groups]


# Run eager under torch.compile: the first call reads every parameter, which
# Dynamo would otherwise trace one attribute read at a time.
_check_optimizer = torch.compiler.disable(check_optimizer, recursive=True)
