"""collect_params: which parameters a group manages and every slot registering
them. A registry of fresh, unshared, unowned parameters is taken whole (C-level
passes); any other registry goes one registration at a time. Both must give
the same result, which these tests pin down."""

from __future__ import annotations

import re

import torch
from torch import nn

from fsdp_rs.runtime.group import params as params_mod
from fsdp_rs.runtime.group.params import collect_params

OWNER = "_test_owner"


def _model() -> tuple[nn.Module, nn.Parameter]:
    """Registries of every kind: plain, a None entry, a parameter registered
    twice in one registry and once more elsewhere, an ignored one, and a
    subtree already managed by another group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_parameter("bias", None)
    tied = model[0].weight.new_zeros(4, 3)
    model[1].tied = model[1].again = nn.Parameter(tied)  # twice in one registry
    model[2].tied = model[1].tied  # and once in another
    model.extra = nn.ParameterList([nn.Parameter(torch.ones(2)) for _ in range(3)])
    ignored = model.extra[1]
    managed = nn.Linear(2, 2)
    managed._fsdp_rs_state = object()  # another group's subtree: skipped
    model.inner = managed
    return model, ignored


def _as_tuple(found) -> tuple:
    return (
        [id(p) for p in found.params],
        found.fqns,
        [id(d) for d in found.slot_dicts],
        found.slot_names,
        found.slot_index,
    )


def test_whole_registry_path_equals_per_registration_path(monkeypatch):
    model, ignored = _model()
    fast = collect_params([model], [ignored], OWNER)
    monkeypatch.setattr(params_mod._Collected, "add_all", lambda *args: False)
    slow = collect_params([model], [ignored], OWNER)
    assert _as_tuple(fast) == _as_tuple(slow)
    assert fast.fqns == [
        "0.weight", "0.bias", "1.weight", "1.tied", "2.weight", "2.bias", "extra.0", "extra.2",
    ]  # fmt: skip
    tied = fast.fqns.index("1.tied")
    registered = [
        (name, i) for name, i in zip(fast.slot_names, fast.slot_index, strict=True) if i == tied
    ]
    assert registered == [("tied", tied), ("again", tied), ("tied", tied)]
    assert fast.params[tied] is model[1].tied


def test_several_roots_and_owned_parameters():
    a, b = nn.Linear(2, 3), nn.Linear(3, 2)
    found = collect_params([a, b], (), OWNER)
    assert found.fqns == ["[0].weight", "[0].bias", "[1].weight", "[1].bias"]
    setattr(b.bias, OWNER, "the fully_shard group of Other")
    # Recorded, not raised: FSDP2 raises at the first forward (the root's lazy init).
    found = collect_params([a, b], (), OWNER)
    assert found.fqns == ["[0].weight", "[0].bias", "[1].weight"]
    (conflict,) = found.conflicts
    assert re.search(r"\[1\]\.bias .* shared with .*the fully_shard group of Other", conflict)


def test_first_slots_and_slot_modules():
    """Each parameter's first slot and each slot's module: what the eager swap
    reads back (``registered``), the extensions' owner modules and the traced
    hooks' slots are made from."""
    model, ignored = _model()
    found = collect_params([model], [ignored], OWNER)
    first = found.first_slots()
    assert first == [found.slot_index.index(i) for i in range(found.num_params)]
    modules = found.slot_modules([model])
    assert all(m._parameters is d for m, d in zip(modules, found.slot_dicts, strict=True))
    tied = found.fqns.index("1.tied")
    assert modules[first[tied]] is model[1]
    assert all(r is p for r, p in zip(found.registered(), found.params, strict=True))
    outside = found.slot_modules([model[0]])
    assert outside[:2] == [model[0], model[0]] and set(outside[2:]) == {None}
