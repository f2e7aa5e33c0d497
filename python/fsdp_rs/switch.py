"""One switch for programs that call torch's FSDP2 themselves (accelerate's
FSDP2 plugin, torchtitan, Lightning's ModelParallelStrategy, the HF
``Trainer``): ``fsdp_rs.patch_fsdp2()`` in code, or ``FSDP_RS=1`` in the
environment with no code changed.

[Note: The switch]
Clients read FSDP2's names from ``torch.distributed.fsdp`` (some from its
``_fully_shard`` package or the old ``torch.distributed._composable.fsdp``
path), often with ``from ... import fully_shard`` at their own import. The
switch puts fsdp-rs's names in those three places, so every call made after
it goes to fsdp-rs; torch's own modules (``_fully_shard._fully_shard``) keep
theirs. It is idempotent. It cannot reach what came before it, so it raises,
naming what it found, where it comes too late: a module already sharded by
torch's FSDP2, or a module outside torch holding torch's ``fully_shard``
(imported before the switch; its calls would go to FSDP2 silently).

``FSDP_RS=1`` needs no code: the wheel installs ``fsdp_rs_switch.pth``, which
Python runs at start-up; where the variable is set (``torchrun`` and
``accelerate launch`` pass it to every rank) it registers an import hook
(``_fsdp_rs_switch``, beside this package) that switches as soon as
``torch.distributed.fsdp`` is first imported, before any client can read its
names. Without the variable it imports nothing.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["patch_fsdp2", "patched"]

# The names FSDP2 exports that fsdp-rs implements; the policy classes
# (MixedPrecisionPolicy, CPUOffloadPolicy, ...) stay torch's, which fsdp-rs takes.
NAMES = (
    "fully_shard",
    "FSDPModule",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "GradientReductionHandle",
    "share_comm_ctx",
)
# Where clients import them from. The first two get every name (a client may
# ask for one torch's version lacks); the old path only those it has.
PUBLIC = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard")
OLD = ("torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")
_TRIGGER = "torch.distributed.fsdp"


def _ours() -> dict[str, Any]:
    import fsdp_rs

    return {name: getattr(fsdp_rs, name) for name in NAMES}


def patched() -> bool:
    """Whether ``torch.distributed.fsdp.fully_shard`` is fsdp-rs's now."""
    module = sys.modules.get(_TRIGGER)
    if module is None:
        return False
    import fsdp_rs

    return vars(module).get("fully_shard") is fsdp_rs.fully_shard


def patch_fsdp2() -> None:
    """Make FSDP2's public names (``fully_shard``, ``FSDPModule``, ...) in
    ``torch.distributed.fsdp``, its ``_fully_shard`` package and the old
    ``torch.distributed._composable.fsdp`` path fsdp-rs's ([Note: The
    switch]). Call it before anything imports ``fully_shard`` from there or
    shards a model; raises RuntimeError where it comes too late."""
    if patched():
        return
    modules = {name: importlib.import_module(name) for name in PUBLIC}
    for name in OLD:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:  # a torch without the old path
            pass
    _check_not_too_late(vars(modules[_TRIGGER])["fully_shard"])
    ours = _ours()
    for module_name, module in modules.items():
        for name, value in ours.items():
            if module_name in PUBLIC or name in vars(module):
                setattr(module, name, value)


def _check_not_too_late(torch_fully_shard: Any) -> None:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    sharded = [
        type(module).__name__
        for module, ref in list(_module_state_mapping.items())
        if isinstance(ref() if callable(ref) else ref, FSDPState)
    ]
    if sharded:
        raise RuntimeError(
            f"fsdp_rs.patch_fsdp2() came too late: torch's FSDP2 already sharded "
            f"{', '.join(sorted(set(sharded)))}. Switch before anything calls fully_shard: "
            "call fsdp_rs.patch_fsdp2() first thing in the program, or run it with FSDP_RS=1 "
            "in the environment"
        )
    holders = sorted(
        name
        for name, module in list(sys.modules.items())
        if module is not None
        and not name.startswith(("torch.", "fsdp_rs."))
        and vars(module).get("fully_shard") is torch_fully_shard
    )
    if holders:
        raise RuntimeError(
            f"fsdp_rs.patch_fsdp2() came too late: {', '.join(holders)} imported torch's "
            "fully_shard before the switch, and would call torch's FSDP2. Switch before "
            "importing them: call fsdp_rs.patch_fsdp2() first thing in the program, or run "
            "it with FSDP_RS=1 in the environment"
        )
