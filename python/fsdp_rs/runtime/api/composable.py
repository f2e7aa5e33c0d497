"""fsdp-rs modules in torch's registry of composable APIs.

[Note: fsdp-rs in torch's composable registry]
torch's composable APIs (``fully_shard``, ``replicate``, ``checkpoint``) mark
each module they are applied to in two dicts of the module's ``__dict__``
(``torch.distributed._composable.contract``): the registry (API name ->
marker) and the states (API function -> state object, ``fully_shard.state(m)``).
torch's code reads them to compose the APIs:

- both ``replicate``s (``_composable.replicate``, DDP-based, and
  ``_composable.replicate_with_fsdp``) skip the subtree of a module whose
  registry holds "fully_shard" (FSDP2's HSDP by composition: ``fully_shard``
  per block, then ``replicate`` on the root), and refuse to be applied to such
  a module itself;
- the contract refuses a second application of one API to a module;
- pipelining's stage (torch < 2.15) reads ``fully_shard.state(m)`` of a
  module that is a ``torch.distributed.fsdp.FSDPModule``: after the last
  micro-batch's backward, it post-backwards each group of
  ``state._state_ctx.all_states`` and calls the root's
  ``state._root_post_backward_final_callback()``.

``fully_shard`` of fsdp-rs therefore registers its modules as torch's does,
under the name "fully_shard" (one marker per call, shared by the modules of a
list), so that ``replicate`` leaves their parameters to fsdp-rs: unmarked,
DDP's ``replicate`` took them and replaced the sharded DTensors with local
Parameters. Under torch's ``fully_shard`` function it stores a state that is
no ``FSDPState`` and raises on any use, naming fsdp-rs and what to do ([Note:
An FSDPModule to torch]): code that reads FSDP2's private state of the module
fails there instead of on a None, and no FSDP2 method runs on fsdp-rs state.
The pipeline stages' two reads are answered: no FSDP2 states, and a final
callback that reduces what the stage's backwards without sync accumulated and
ends the iteration, as ``finalize_backward`` does (``finish_pipelined_backward``
in ``runtime/step/finalize.py``), so torch's schedules train fsdp-rs stages on every
supported torch;
``fsdp_rs.fully_shard.state`` is torch's, for code that calls it on the
function the switch put in torch's place.
torch's ``_get_module_fsdp_state`` (its own module-to-state map) keeps
returning None for fsdp-rs modules. The contract's duplicate check then
refuses torch's ``fully_shard`` on an fsdp-rs module, and fsdp-rs's
``fully_shard`` refuses a module torch's ``fully_shard`` or ``replicate`` was
applied to (torch's ``fully_shard`` silently leaves a replicated module's
parameters out; fsdp-rs would shard them under DDP). A replicated submodule's
subtree is left out of an fsdp-rs call as torch's leaves it out
(``params.collect_params``): ``replicate`` per block, then ``fully_shard`` on
the root, trains as under FSDP2. All of it happens once
per module at ``fully_shard``; nothing runs per step."""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import Any, NoReturn

from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed._composable_state import _State
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _torch_fully_shard

from fsdp_rs.runtime.api.errors import FSDPUsageError
from fsdp_rs.runtime.group.params import REPLICATE, composable_registry, state_of
from fsdp_rs.runtime.step.finalize import finish_pipelined_backward

__all__ = [
    "FsdpRsState",
    "check_composable",
    "fsdp2_state",
    "fsdp2_state_error",
    "register_fully_shard",
]

_NAME = "fully_shard"


def fsdp2_state_error(name: str) -> FSDPUsageError:
    return FSDPUsageError(
        f"{name} was sharded by fsdp-rs's fully_shard, which keeps no torch FSDP2 state "
        "(FSDPModule._get_fsdp_state(), fully_shard.state(module)): code that reads FSDP2's "
        "private objects does not work on it. Use the FSDPModule methods (unshard, reshard, "
        "set_requires_gradient_sync, ...), or shard this model with "
        "torch.distributed.fsdp.fully_shard for that code"
    )


class _NoFSDP2States:
    """``_state_ctx`` of an ``FsdpRsState``: no FSDP2 states to post-backward
    (``finish_pipelined_backward`` reduces fsdp-rs's groups)."""

    all_states: tuple = ()


_NO_FSDP2_STATES = _NoFSDP2States()


class FsdpRsState(_State):
    """What ``torch.distributed.fsdp.fully_shard.state(m)`` returns for an
    fsdp-rs module: no FSDP2 state; any attribute torch reads raises, but for
    the two that torch < 2.15's pipeline stages read ([Note: fsdp-rs in torch's
    composable registry])."""

    def __init__(self, name: str, module: nn.Module) -> None:
        object.__setattr__(self, "_fsdp_rs_module_name", name)
        object.__setattr__(self, "_fsdp_rs_module", weakref.ref(module))

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle and friends probe these
            raise AttributeError(attr)
        if attr == "_state_ctx":
            return _NO_FSDP2_STATES
        if attr == "_root_post_backward_final_callback":
            module = self._fsdp_rs_module()
            state = None if module is None else state_of(module)
            if state is not None:
                return functools.partial(finish_pipelined_backward, state)
        raise fsdp2_state_error(self._fsdp_rs_module_name)

    def __setattr__(self, attr: str, value: Any) -> NoReturn:
        raise fsdp2_state_error(self._fsdp_rs_module_name)


def _state_key() -> Any:
    """The key of torch's ``fully_shard`` in a module's dict of states: the
    function the contract decorated (``fully_shard.state`` looks it up)."""
    key = getattr(_torch_fully_shard, "__wrapped__", None)
    probe = nn.Module()
    if key is not None:
        probe.__dict__[STATE_KEY] = {key: probe}
        if _torch_fully_shard.state(probe) is probe:
            return key
    return None  # a torch whose contract differs: leave its states alone


_STATE_KEY = _state_key()


def fsdp2_state(module: nn.Module) -> Any:
    """``fully_shard.state(module)`` of fsdp-rs's ``fully_shard``, as torch's:
    code calling it on the function the switch put in place of torch's gets
    what torch's gives (an ``FsdpRsState`` for an fsdp-rs module)."""
    return _torch_fully_shard.state(module)


def check_composable(module: nn.Module, name: str) -> None:
    """Refuse a module torch's ``fully_shard`` or ``replicate`` was applied to."""
    registry = composable_registry(module)
    if not registry:
        return
    if _NAME in registry:
        raise FSDPUsageError(
            f"fully_shard: {name} was already passed to torch's fully_shard "
            "(torch.distributed.fsdp.fully_shard); shard a module with one library. Each "
            "distinct composable distributed API can only be applied to a module once."
        )
    if REPLICATE in registry:
        raise FSDPUsageError(
            f"fully_shard: {name} was already passed to torch's replicate, which manages its "
            "parameters; apply fully_shard to its submodules first, then replicate to the "
            "root (FSDP2's HSDP by composition), or pass a 2-D mesh to fully_shard for HSDP"
        )


def register_fully_shard(modules: list[nn.Module], name: str) -> None:
    """Mark ``modules`` (one ``fully_shard`` call) in torch's registry as torch's
    contract marks them."""
    item = RegistryItem()
    state = FsdpRsState(name, modules[0])
    for m in modules:
        d = m.__dict__
        d.setdefault(REGISTRY_KEY, OrderedDict())[_NAME] = item
        if _STATE_KEY is not None:
            d.setdefault(STATE_KEY, OrderedDict())[_STATE_KEY] = state
