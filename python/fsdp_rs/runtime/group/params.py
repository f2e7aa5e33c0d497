"""Which parameters a group manages, where they are registered, and swapping
the registered objects between sharded and unsharded parameters.

[Note: Swapping registered parameters]
Outside forward and backward a module's registered parameters are the sharded
DTensors (what optimizers, ``state_dict`` and checkpointing see); inside, they
are plain unsharded ``nn.Parameter``s whose data lives in the group's unsharded
buffer. Both sets of objects are created once. A swap writes every registration
slot (``module._parameters[name]``; a shared parameter has several) with
``map`` over prebuilt lists, so the per-parameter work happens in C, with no
Python bytecode per parameter.
"""

from __future__ import annotations

import functools
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY

__all__ = [
    "REPLICATE",
    "ManagedParams",
    "alias_storage",
    "clear_grads",
    "collect_params",
    "composable_registry",
    "get_grads",
    "is_none",
    "own_accumulate_hooks",
    "own_grads",
    "own_requires_grad",
    "set_grads",
    "set_own_grads",
    "state_of",
]

_get_grad = operator.attrgetter("grad")
# For map(); `None in tensors` would call Tensor.__eq__.
is_none = functools.partial(operator.is_, None)


def get_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(map(_get_grad, params))


def clear_grads(params: Sequence[torch.Tensor]) -> None:
    deque(map(setattr, params, repeat("grad"), repeat(None)), maxlen=0)


def set_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    deque(map(setattr, params, repeat("grad"), grads), maxlen=0)


# [Note: Reading fsdp-rs's own DTensors]
# A tensor subclass's ``.grad`` (read or written), ``requires_grad`` and
# ``_post_accumulate_grad_hooks`` go through torch's ``__torch_function__``
# handling, even where the class disables it as DTensor does: about half the
# cost of each. The sharded parameters and their ``.grad`` views are DTensors
# fsdp-rs made itself, so the step's C-level passes over them run with that
# handling off (``DisableTorchFunctionSubclass``), with the same result; a
# user's torch-function mode still sees them. Parameters of other classes (an
# extension's unsharded ones) keep ``get_grads`` / ``set_grads``.
_OWN = torch._C.DisableTorchFunctionSubclass
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def own_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``get_grads`` of fsdp-rs's own DTensor parameters ([Note: Reading
    fsdp-rs's own DTensors])."""
    with _OWN():
        return get_grads(params)


def set_own_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``set_grads`` of fsdp-rs's own DTensor parameters ([Note: Reading
    fsdp-rs's own DTensors])."""
    with _OWN():
        set_grads(params, grads)


def own_requires_grad(params: Sequence[torch.Tensor]) -> list[bool]:
    """Each of fsdp-rs's own DTensor parameters' ``requires_grad``."""
    with _OWN():
        return list(map(_REQUIRES_GRAD, params))


def own_accumulate_hooks(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of fsdp-rs's own DTensor parameters has a post-accumulate-grad
    hook ([Note: Post-accumulate-grad hooks])."""
    with _OWN():
        return any(map(_ACCUMULATE_HOOKS, params))


def alias_storage(
    storage, like: torch.Tensor, offset: int, shape: torch.Size, stride: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over ``storage`` with a version counter of its own.

    [Note: Unsharded parameter versions]
    Autograd checks that tensors saved for backward were not written in place
    since. A view shares its base's version counter, so with views of the
    unsharded buffer, the copy-out that refills the buffer before backward would
    bump every parameter's version and fail that check. Aliasing the storage with
    ``set_`` gives each parameter an independent counter; the buffer tensor the
    copy-out writes keeps its own."""
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage, offset, shape, stride)


class ManagedParams:
    """The group's parameters (unique, in registration order) and every slot
    that registers one of them: ``slot_dicts[k][slot_names[k]]`` holds
    parameter ``slot_index[k]``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        fqns: list[str],
        slot_dicts: list[dict],
        slot_names: list[str],
        slot_index: list[int],
    ) -> None:
        self.params: list[nn.Parameter] | None = params
        self.num_params = len(params)
        self.fqns = fqns
        self.slot_dicts = slot_dicts
        self.slot_names = slot_names
        self.slot_index = slot_index
        # No shared parameters: slot k holds parameter k.
        self._one_slot_each = slot_index == list(range(len(slot_index)))
        self._first_slots: list[int] | None = None

    def first_slots(self) -> list[int]:
        """The first slot of each parameter (``k`` with ``slot_index[k] == i``,
        the lowest, for parameter ``i``), where its registered object is read;
        made at the first call."""
        if self._first_slots is None:
            first: dict[int, int] = {}
            for k, i in enumerate(self.slot_index):
                first.setdefault(i, k)
            self._first_slots = [first[i] for i in range(self.num_params)]
        return self._first_slots

    def slot_modules(self, modules: Iterable[nn.Module]) -> list[nn.Module | None]:
        """The module of each slot (whose ``_parameters`` is ``slot_dicts[k]``),
        found among ``modules`` and their submodules (None: not there)."""
        owner: dict[int, nn.Module] = {}
        for root in modules:
            for m in root.modules():
                owner.setdefault(id(m._parameters), m)
        return [owner.get(id(d)) for d in self.slot_dicts]

    def registered(self) -> list[torch.Tensor]:
        """The objects registered now, one per parameter (first slot of each)."""
        dicts, names = self.slot_dicts, self.slot_names
        return [dicts[k][names[k]] for k in self.first_slots()]

    def forget_originals(self) -> None:
        """Drop the references to the original (unsharded) parameters once the
        sharded ones replaced them, so that their memory can be freed."""
        self.params = None

    def split(self, keys: Sequence) -> list[ManagedParams]:
        """One ``ManagedParams`` per distinct key (in order of first appearance),
        holding the parameters with that key (``keys[i]`` is parameter ``i``'s)
        and their slots."""
        order = list(dict.fromkeys(keys))
        parts = []
        for key in order:
            members = [i for i, k in enumerate(keys) if k == key]
            local = {i: j for j, i in enumerate(members)}
            slots = [k for k, i in enumerate(self.slot_index) if i in local]
            parts.append(
                ManagedParams(
                    [self.params[i] for i in members],
                    [self.fqns[i] for i in members],
                    [self.slot_dicts[k] for k in slots],
                    [self.slot_names[k] for k in slots],
                    [local[self.slot_index[k]] for k in slots],
                )
            )
        return parts

    def swap(self, objects: Sequence[torch.Tensor]) -> None:
        """Register ``objects[i]`` in every slot of parameter ``i``; see
        [Note: Swapping registered parameters]."""
        if not self._one_slot_each:
            objects = list(map(objects.__getitem__, self.slot_index))
        deque(map(operator.setitem, self.slot_dicts, self.slot_names, objects), maxlen=0)


STATE_ATTR = "_fsdp_rs_state"


REPLICATE = "replicate"  # torch's replicate, in its composable registry


def state_of(module: nn.Module):
    """The fsdp-rs state ``fully_shard`` gave ``module`` itself, or None. Read
    from the instance dict: a wrapper's ``__getattr__`` (``CheckpointWrapper``
    forwards to the module it wraps) must not lend it the wrapped one's."""
    return vars(module).get(STATE_ATTR)


def composable_registry(module: nn.Module) -> dict | None:
    """torch's registry of the composable APIs applied to ``module`` itself
    (API name -> marker), read from the instance dict as ``state_of`` reads."""
    return vars(module).get(REGISTRY_KEY)


def _is_managed_elsewhere(module: nn.Module) -> bool:
    """Sharded by an earlier ``fully_shard``, or replicated by torch's
    ``replicate``, whose subtree torch's ``fully_shard`` leaves out too ([Note:
    fsdp-rs in torch's composable registry] in ``runtime/api/composable.py``)."""
    if state_of(module) is not None:
        return True
    registry = composable_registry(module)
    return registry is not None and REPLICATE in registry


def collect_params(
    roots: Sequence[nn.Module], ignored: Iterable[nn.Parameter], owner_attr: str
) -> ManagedParams:
    """Parameters registered under ``roots``, skipping the subtrees of modules
    already passed to ``fully_shard`` and the ``ignored`` parameters.

    A parameter's ``owner_attr`` attribute describes the group already owning
    it; a parameter shared with another group is an error (both groups would
    shard and reduce it), reported in ``conflicts`` and raised by the root's
    lazy init, where FSDP2 raises it."""
    found = _Collected(ignored, owner_attr)
    seen_modules: set[int] = set()
    for root_index, root in enumerate(roots):
        stack = [(root, "" if len(roots) == 1 else f"[{root_index}].")]
        while stack:
            module, prefix = stack.pop()
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            registry = module._parameters
            if registry and not found.add_all(registry, prefix):
                for name, param in registry.items():
                    found.add(registry, name, param, prefix)
            for child_name, child in reversed(list(module._modules.items())):
                if child is not None and not _is_managed_elsewhere(child):
                    stack.append((child, f"{prefix}{child_name}."))
    managed = ManagedParams(
        found.params, found.fqns, found.slot_dicts, found.slot_names, found.slot_index
    )
    managed.conflicts = found.conflicts
    return managed


class _Collected:
    """The lists ``collect_params`` builds, filled one registration at a time
    (``add``) or, for a module's whole registry of fresh, unshared, unowned
    parameters (the usual case), with C-level passes (``add_all``)."""

    def __init__(self, ignored: Iterable[nn.Parameter], owner_attr: str) -> None:
        self.ignored_ids = {id(p) for p in ignored}
        self.owner_attr = owner_attr
        self.params: list[nn.Parameter] = []
        self.fqns: list[str] = []  # relative to the group's module; for messages
        self.slot_dicts: list[dict] = []
        self.slot_names: list[str] = []
        self.slot_index: list[int] = []
        self.index: dict[int, int] = {}  # id(param) -> its position in params
        self.conflicts: list[str] = []  # parameters another group owns

    def add_all(self, registry: dict, prefix: str) -> bool:
        """Add every registration of ``registry`` if none is None, ignored,
        already seen or owned by another group; else add nothing: False."""
        names, params = list(registry), list(registry.values())
        ids = list(map(id, params))
        if (
            any(map(is_none, params))
            or not self.ignored_ids.isdisjoint(ids)
            or not self.index.keys().isdisjoint(ids)
            or len(set(ids)) != len(ids)
            or not all(map(is_none, map(getattr, params, repeat(self.owner_attr), repeat(None))))
        ):
            return False
        start, stop = len(self.params), len(self.params) + len(params)
        self.index.update(zip(ids, range(start, stop), strict=True))
        self.params += params
        self.fqns += map(prefix.__add__, names)
        self.slot_dicts += repeat(registry, len(params))
        self.slot_names += names
        self.slot_index += range(start, stop)
        return True

    def add(self, registry: dict, name: str, param: nn.Parameter | None, prefix: str) -> None:
        if param is None or (key := id(param)) in self.ignored_ids:
            return
        i = self.index.get(key)
        if i is None:
            owner = getattr(param, self.owner_attr, None)
            if owner is not None:
                self.conflicts.append(
                    f"fully_shard: parameter {prefix}{name} (shape {tuple(param.shape)}) is "
                    f"shared with a parameter already managed by another fully_shard group "
                    f"({owner}); a parameter can belong to one group only: shard the modules "
                    "that share it together (fully_shard([module_a, module_b]) or their "
                    "common parent)"
                )
                return
            i = self.index[key] = len(self.params)
            self.params.append(param)
            self.fqns.append(prefix + name)
        self.slot_dicts.append(registry)
        self.slot_names.append(name)
        self.slot_index.append(i)
