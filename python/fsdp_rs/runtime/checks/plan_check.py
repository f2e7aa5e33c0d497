"""Cross-rank plan check: before a root's first collective, the ranks of its
mesh compare what they planned, and a difference becomes one clear error on
every rank instead of a collective that aborts or hangs.

[Note: Cross-rank plan check]
Ranks that shard different models (a layer width configured differently on
one rank, parameters registered in another order, another dtype,
``requires_grad``, ``reshard_after_forward``, mixed-precision or offload
policy, ignored parameters, or ``fully_shard`` applied to different modules)
issue collectives of different sizes or in a different number: gloo aborts
the process (``op.preamble.length <= op.nbytes``), NCCL hangs or reads
garbage. The root's lazy init, before its first all-gather, therefore
fingerprints every state under it, in lazy-init order (pre-order over the
modules): the fqns of its modules, then per parameter group its mesh (shape,
dim names, device type), resolved ``reshard_after_forward``, dtypes
(original, all-gather, reduce, output; ``cast_forward_inputs``), offload, the
parameters' fqns, first dims and ``requires_grad`` in order, and the plan's own
rank-independent digest (padded sizes, strides, offsets: [Note: Plan
fingerprints] in ``rust/planner/src/fingerprint.rs``). One 8-byte all-gather
over the root's mesh compares the 64-bit digests: over each mesh dim with more
than one rank (shard, then replicate), so every rank of an HSDP mesh sees every
other rank's digest. Nothing is checked per step.

When the digests differ, every rank takes the same error path: an
``all_gather_object`` of each state's module fqns and digest finds the first
state that differs, a second one of that state's details (settings and
per-parameter shape, dtype and ``requires_grad``) builds the message, and
every rank raises the same ``RuntimeError``, built from gathered data only. The
lazy init is undone first, so a forward retried after catching the error
checks (and fails) again rather than issuing the mismatched collectives.

What is not caught: a module wrapped after the first forward becomes a root of
its own at its first forward and is checked there, among the ranks that run
it; a rank that wraps it while the others do not would need a collective per
step to be caught (the others have no point at which to join a check). An
explicit ``module.unshard()`` before the first forward all-gathers before any
lazy init. The check's collective runs on the root's mesh, so meshes whose
process groups differ between ranks still hang there.

Off (on every rank, or the ranks disagree on the collective):
``FSDP_RS_CHECK_PLANS=0``, which turns off the per-backward check of the
trainable sets too ([Note: One trainable set on every rank]). With torch's
fake process group, and on a mesh of one rank, nothing is checked. Cost: one
8-byte all-gather per root and mesh dim, and hashing, once: 1.4-1.6 us per
parameter in all at 1e4 and 1e5 parameters (gloo, W = 2, a 2-core VM; README).
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_rs.runtime.comm.collectives import all_gather
from fsdp_rs.runtime.comm.mesh import MeshInfo
from fsdp_rs.runtime.group.params import state_of
from fsdp_rs.runtime.variants.bundle import GroupBundle

__all__ = [
    "ENV_VAR",
    "PlanMismatchError",
    "check_plans",
    "enabled",
    "gather_objects",
    "mesh_dims",
    "per_rank",
]

ENV_VAR = "FSDP_RS_CHECK_PLANS"
_OFF = frozenset({"0", "false", "no", "off"})
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SKIPPED_BACKENDS = frozenset({"fake"})  # collectives that return nothing real


class PlanMismatchError(RuntimeError):
    """The ranks of a root's mesh planned different fully_shard groups."""


def enabled() -> bool:
    """Whether ``FSDP_RS_CHECK_PLANS`` leaves the check on (the default)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def check_plans(root, states: Sequence[Any]) -> None:
    """Compare the plans of ``root``'s ``states`` (its lazy-init order) across
    the ranks of its mesh; see [Note: Cross-rank plan check]. Called once by
    each root's lazy init, after ``reshard_after_forward`` is resolved."""
    if not enabled():
        return
    if not any(groups_of(s) for s in states):
        return  # no parameters: no collective to protect
    # The mesh given to the root's fully_shard (the root state comes first), on
    # every rank the same process groups whatever meshes the states below use.
    info = states[0].mesh_info
    dims = mesh_dims(info)
    if not dims:
        return
    names = _module_names(root, states)
    digests = _Digests()
    per_state = [digests.state(state, names[i]) for i, state in enumerate(states)]
    total = hashlib.blake2b(b"".join(per_state), digest_size=8).digest()
    value = int.from_bytes(total, "little", signed=True)
    if len(set(_gather_values(value, dims, info.device))) == 1:
        return
    _undo_lazy_init(states)
    raise PlanMismatchError(_mismatch_message(states, names, per_state, dims))


# ------------------------------------------------------------------ what is hashed


def groups_of(state) -> tuple:
    """The parameter groups of ``state``: none, one, or a bundle's."""
    group = state.group
    if group is None:
        return ()
    return group.groups if isinstance(group, GroupBundle) else (group,)


def mesh_dims(info: MeshInfo) -> list[dist.ProcessGroup]:
    """The mesh dims the check runs over: shard, then replicate, each with more
    than one rank; none on a fake process group."""
    dims = [(info.shard_group, info.shard_size), (info.replicate_group, info.replicate_size)]
    groups = [pg for pg, size in dims if pg is not None and size > 1]
    if any(dist.get_backend(pg) in _SKIPPED_BACKENDS for pg in groups):
        return []
    return groups


def _module_names(root, states: Sequence[Any]) -> list[list[str]]:
    """Each state's modules' fqns under ``root`` (``[i].`` before them where the
    root state holds several modules)."""
    roots = root.modules
    fqn_of: dict[int, str] = {}
    for i, module in enumerate(roots):
        prefix = f"[{i}]" if len(roots) > 1 else ""
        for name, sub in module.named_modules():
            if state_of(sub) is not None:
                joined = f"{prefix}.{name}" if prefix and name else prefix or name
                fqn_of.setdefault(id(sub), joined)
    return [[fqn_of.get(id(m), f"<{type(m).__name__}>") for m in s.modules] for s in states]


def _mesh_text(info: MeshInfo) -> str:
    mesh = info.mesh
    names = f", dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    return f"{mesh.device_type} mesh of shape {tuple(mesh.shape)}{names}"


def _dtypes_text(group) -> str:
    grads = ""
    if group.grad_dtype != group.orig_dtype:  # [Note: Gradient dtype policy]
        grads = f", gradients {group.grad_dtype}"
    return (
        f"{group.orig_dtype} (all-gather {group.param_dtype}, reduce {group.reduce_dtype}{grads})"
    )


def _offload_text(group) -> str:
    if not group.offload_to_cpu:
        return "none"
    return f"CPUOffloadPolicy(pin_memory={group.pin_memory})"


def _mp_text(state) -> str:
    mp = state.mp_policy
    return (
        f"param_dtype={mp.param_dtype}, reduce_dtype={mp.reduce_dtype}, "
        f"output_dtype={mp.output_dtype}, cast_forward_inputs={mp.cast_forward_inputs}"
    )


def _settings(state) -> list[tuple[str, str]]:
    """A state's settings that every rank must share, in the order reported."""
    groups = groups_of(state)
    if not groups:
        return []
    # the policy, then the dtypes: where ranks split a module into different
    # groups (one per dtype or gradient dtype) they say why, before the settings
    # listed once per group
    settings = [
        ("mp_policy", _mp_text(state)),
        ("dtypes", " | ".join(map(_dtypes_text, groups))),
        ("mesh", " | ".join(_mesh_text(g.info) for g in groups)),
        ("reshard_after_forward", repr(groups[0].reshard_after_forward)),
        ("offload_policy", _offload_text(groups[0])),
    ]
    on_dims = [g for g in groups if g.dims is not None]
    if on_dims:  # planned as (W, numel / W): the plan alone misses dim and shape
        settings.append(("shard_placement_fn", " | ".join(map(_dims_text, on_dims))))
    return settings


def _kind(group) -> str:
    """The group's class and gather strategy: a rank whose shards gained
    all-gather extensions after ``fully_shard`` has another."""
    return f"{type(group).__name__}({type(group.gather).__name__})"


def _dims_text(group) -> str:
    """[Note: Sharding on another dim] each parameter's shard dim and full shape."""
    pairs = zip(group.managed.fqns, group.dims, group.sharding.full_shapes, strict=True)
    return ", ".join(f"{fqn}: Shard({d}) of {tuple(shape)}" for fqn, d, shape in pairs)


class _Digests:
    """Per-state digests; plan digests are shared by the groups of one layout
    ([Note: Shared group layouts]) and computed once per check."""

    def __init__(self) -> None:
        self._plans: dict[int, bytes] = {}

    def _plan(self, plan) -> bytes:
        digest = self._plans.get(id(plan))
        if digest is None:
            digest = self._plans[id(plan)] = plan.fingerprint().to_bytes(8, "little")
        return digest

    def state(self, state, names: list[str]) -> bytes:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((names, _settings(state))).encode())
        for group in groups_of(state):
            h.update(self._plan(group.plan))
            h.update(_kind(group).encode())  # [Note: All-gather extensions]
            h.update(group.layout.first_dims)
            h.update("\0".join(group.managed.fqns).encode())
            h.update(bytes(map(_REQUIRES_GRAD, group.sharded_params)))
            if group.nd is not None:  # [Note: DTensor parameters]
                h.update(repr([None if d is None else d.placements for d in group.nd]).encode())
        return h.digest()


# ------------------------------------------------------------------ collectives


def _gather_values(value: int, dims: Sequence[dist.ProcessGroup], device: torch.device) -> list:
    """Every mesh rank's ``value``: all-gathered over each dim in turn."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    for pg in dims:
        out = t.new_empty(t.numel() * pg.size())
        all_gather(out, t, group=pg)
        t = out
    return t.tolist()


def gather_objects(obj: Any, dims: Sequence[dist.ProcessGroup]) -> list:
    """Every mesh rank's ``(global rank, obj)``, ordered by rank."""
    items = [(dist.get_rank(), obj)]
    for pg in dims:
        parts: list = [None] * pg.size()
        dist.all_gather_object(parts, items, group=pg)
        items = [item for part in parts for item in part]
    return sorted(items, key=operator.itemgetter(0))


# ------------------------------------------------------------------ the error


def _undo_lazy_init(states: Iterable[Any]) -> None:
    """Back to before lazy init: the next forward checks again."""
    for state in states:
        state.context = None
        state.is_root = False


def param_fqn(names: list[str], fqn: str) -> str:
    """A group parameter's fqn under the root (``[i].`` names the i-th module of
    a group over several)."""
    base = names[0]
    if len(names) > 1 and fqn.startswith("["):
        index, _, fqn = fqn[1:].partition("].")
        base = names[int(index)]
    return f"{base}.{fqn}" if base else fqn


def _details(state, names: list[str]) -> dict:
    params = []
    for group in groups_of(state):
        rg = map(_REQUIRES_GRAD, group.sharded_params)
        for fqn, shape, req in zip(group.managed.fqns, group.shapes, rg, strict=True):
            params.append((param_fqn(names, fqn), tuple(shape), str(group.orig_dtype), req))
    return {
        "modules": names,
        "settings": _settings(state),
        "params": params,
        "plans": [(_kind(g), g.plan.fingerprint(), g.plan.row_numel) for g in groups_of(state)],
    }


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def per_rank(values: list[tuple[int, Any]]) -> str:
    """One line per distinct value, naming the ranks that hold it."""
    holders: dict[str, list[int]] = {}
    for rank, value in values:
        holders.setdefault(str(value), []).append(rank)
    return "".join(f"\n  {_ranks_text(ranks)}: {value}" for value, ranks in holders.items())


def _modules_text(names: list[str]) -> str:
    if names == [""]:
        return "the root fully_shard module"
    return "fully_shard module " + ", ".join(repr(n) for n in names)


def _param_text(item: tuple | None) -> str:
    if item is None:
        return "not in this group"
    _, shape, dtype, requires_grad = item
    return f"shape {shape}, dtype {dtype}, requires_grad={requires_grad}"


def _listed(params: list) -> str:
    """``parameters 'a', 'b', 'c', ...``: the first three of a group's."""
    more = ", ..." if len(params) > 3 else ""
    return "parameters " + ", ".join(repr(p[0]) for p in params[:3]) + more


def _first_difference(details: list[tuple[int, dict | None]], index: int) -> str:
    """What differs first in the state at ``index``: its presence, modules, a
    parameter (by fqn), a setting, the parameters' order, then the plan."""
    present = [d for _, d in details if d is not None]
    if len(present) < len(details):
        params = present[0]["params"]
        param = params[0][0] if params else None
        named = f", parameter {param!r}" if param else ""

        def listing(d):
            if d is None:
                return f"no fully_shard module at position {index} under the root"
            return f"{_modules_text(d['modules'])} ({len(d['params'])} parameters)"

        where = f"the fully_shard module at position {index} under the root{named}"
        return where + ":" + per_rank([(r, listing(d)) for r, d in details])
    if any(d["modules"] != present[0]["modules"] for d in present):
        where = f"the fully_shard module at position {index} under the root"
        return where + ":" + per_rank([(r, _modules_text(d["modules"])) for r, d in details])
    group = _modules_text(present[0]["modules"])
    by_fqn = [{p[0]: p for p in d["params"]} for d in present]
    fqns = list(dict.fromkeys(p[0] for d in present for p in d["params"]))
    for fqn in fqns:
        values = [
            (r, _param_text(table.get(fqn))) for (r, _), table in zip(details, by_fqn, strict=True)
        ]
        if len({v for _, v in values}) > 1:
            return f"{group}, parameter {fqn!r}:" + per_rank(values)
    for key in dict.fromkeys(key for d in present for key, _ in d["settings"]):
        values = [(r, dict(d["settings"]).get(key)) for r, d in details]
        if len({str(v) for _, v in values}) > 1:
            return f"{group} ({_listed(present[0]['params'])}), {key}:" + per_rank(values)
    orders = [(r, [p[0] for p in d["params"]]) for r, d in details]
    for position in range(max(len(o) for _, o in orders)):
        at = [(r, o[position] if position < len(o) else None) for r, o in orders]
        if len({v for _, v in at}) > 1:
            first = at[0][1]
            return (
                f"{group}, parameter {first!r}: the parameters are registered in another "
                f"order; parameter {position} of the group is" + per_rank(at)
            )
    kinds = [(r, [plan[0] for plan in d["plans"]]) for r, d in details]
    if len({str(k) for _, k in kinds}) > 1:  # [Note: All-gather extensions]
        return (
            f"{group} ({_listed(present[0]['params'])}): all-gather extensions "
            "(fsdp_pre_all_gather) are set on the local "
            "shards of some ranks only; set them on every rank:" + per_rank(kinds)
        )
    plans = [(r, f"plan digests {d['plans']}") for r, d in details]
    return (
        f"{group}: the plans differ although the parameters agree (are all ranks "
        "running the same fsdp-rs build?):" + per_rank(plans)
    )


def _mismatch_message(
    states: Sequence[Any],
    names: list[list[str]],
    per_state: list[bytes],
    dims: Sequence[dist.ProcessGroup],
) -> str:
    overview = gather_objects((names, per_state), dims)
    longest = max(len(d) for _, (_, d) in overview)
    index = next(
        (
            i
            for i in range(longest)
            if len({(d[i] if i < len(d) else None) for _, (_, d) in overview}) > 1
        ),
        None,
    )
    if index is None:  # cannot happen: the digest is the states' digests hashed
        difference = "the digests, although no state differs (please report this)"
    else:
        mine = _details(states[index], names[index]) if index < len(states) else None
        difference = _first_difference(gather_objects(mine, dims), index)
    lines = [
        "fsdp_rs: the ranks planned different fully_shard groups, so their collectives "
        "would not match (gloo aborts, NCCL hangs or reads garbage). Checked at the root's "
        "first forward, before any collective; the first difference is in " + difference
    ]
    wrapped = [set(map(tuple, n)) for _, (n, _) in overview]
    everywhere = set.intersection(*wrapped)
    odd = next((m for _, (n, _) in overview for m in map(tuple, n) if m not in everywhere), None)
    if odd is not None:
        holders = [r for (r, _), w in zip(overview, wrapped, strict=True) if odd in w]
        lines.append(
            f"The ranks apply fully_shard to different modules: {_modules_text(list(odd))} "
            f"is one on {_ranks_text(holders)} only."
        )
    lines.append(
        "Build the same model on every rank and call fully_shard on the same modules, in "
        "the same order, with the same arguments (mesh, reshard_after_forward, mp_policy, "
        f"offload_policy, ignored_params). {ENV_VAR}=0 on every rank skips this check."
    )
    return "\n".join(lines)
