"""``spmd_types`` parameters (torch >= 2.15 with the ``spmd_types`` package,
torchtitan's default ``spmd_backend``): plain parameters annotated with a type
per mesh axis, ``fully_shard(..., mesh=full_mesh, dp_mesh_dims=...)``, run with
fsdp-rs and with torch FSDP2 side by side in one spawned gloo process.

The model computes on local tensors as spmd_types code does: activations
invariant (``I``) on ``tp``, Megatron TP by hand (``convert(I -> R)`` before the
column-parallel ``w1``, whose backward all-reduces the input gradient;
``all_reduce(P -> I)`` after the row-parallel ``w2``), and a ``scale`` annotated
``R`` on ``tp``, whose gradient is ``Partial`` there and is reduced by FSDP's
gradient path (the one place its placements differ from the parameter's).

Each scenario returns per library (``"rs"``, ``"torch"``) JSON observations
that ``test_spmd_types.py`` compares bit for bit; scenarios return
``{"skipped": ...}`` where spmd_types or ``DataParallelMeshDims`` is missing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from scenario_common import LIBS, eager_and_compiled, train_adamw
from spawned import run_named

try:
    import spmd_types as spmd
except ImportError:  # torch < 2.15 legs: no spmd_types
    spmd = None

AVAILABLE = (
    spmd is not None
    and hasattr(torch_fsdp, "DataParallelMeshDims")
    and getattr(dist, "_is_spmd_types_available", lambda: False)()
)
DIM, HIDDEN, BATCH, STEPS = 16, 32, 4, 3
_FP32 = {"op_dtype": torch.float32}  # gradient reductions of bf16 activations


@functools.cache
def _mesh(world_size: int, tp: int, cp: bool = False) -> DeviceMesh:
    """(dp, tp), or a 1-D dp mesh for ``tp == 1`` (a size-1 dim has no
    spmd_types axis, so a parameter cannot be typed on it); with ``cp``, (dp,
    cp), both data parallel (torchtitan's FSDP over dp_shard x cp)."""
    if cp:
        return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "cp"))
    if tp == 1:
        return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def _dp_names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(n for n in mesh.mesh_dim_names if n != "tp")


def _dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index over the DP dims (flattened) and their size."""
    index, size = 0, 1
    for name in _dp_names(mesh):
        index = index * mesh[name].size() + mesh[name].get_local_rank()
        size *= mesh[name].size()
    return index, size


class Block(nn.Module):
    """``x + all_reduce(w2(relu(w1(convert(x) * scale))))`` with ``w1`` split on
    its output dim and ``w2`` on its input dim over ``tp``."""

    def __init__(self, full: nn.Module, mesh: DeviceMesh, frozen_f64: bool = False) -> None:
        super().__init__()
        has_tp = "tp" in mesh.mesh_dim_names
        tp, rank = (mesh["tp"].size(), mesh["tp"].get_local_rank()) if has_tp else (1, 0)
        self.tp = mesh.get_group("tp") if has_tp else None
        self.w1 = nn.Linear(DIM, HIDDEN // tp)
        self.w2 = nn.Linear(HIDDEN // tp, DIM)
        self.scale = nn.Parameter(torch.empty(DIM))
        params = [
            (self.w1.weight, spmd.S(0)),
            (self.w1.bias, spmd.S(0)),
            (self.w2.weight, spmd.S(1)),
            (self.w2.bias, spmd.I),
            (self.scale, spmd.R),
        ]
        self.offset = None
        if frozen_f64:  # a second dtype: the state drives a bundle of two groups
            self.offset = nn.Parameter(torch.zeros(DIM, dtype=torch.float64), requires_grad=False)
            params.append((self.offset, spmd.I))
        with torch.no_grad():
            self.w1.weight.copy_(full.w1.weight.chunk(tp, 0)[rank])
            self.w1.bias.copy_(full.w1.bias.chunk(tp, 0)[rank])
            self.w2.weight.copy_(full.w2.weight.chunk(tp, 1)[rank])
            self.w2.bias.copy_(full.w2.bias)
            self.scale.copy_(full.scale)
        with spmd.set_current_mesh(mesh):
            for param, kind in params:
                types = dict.fromkeys(_dp_names(mesh), spmd.R)
                spmd.assert_type(param, {**types, "tp": kind} if has_tp else types)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.tp is not None:  # its backward all-reduces the input gradient
            h = spmd.convert(x, self.tp, src=spmd.I, dst=spmd.R, backward_options=_FP32)
        h = F.linear(torch.relu(self.w1(h * self.scale)), self.w2.weight)
        if self.tp is not None:
            h = spmd.all_reduce(h, self.tp, src=spmd.P, dst=spmd.I, backward_options=_FP32)
        out = x + h + self.w2.bias
        return out if self.offset is None else out + self.offset.float()  # adds zeros


class _Full(nn.Module):
    """A block's full weights; as a module, ``Block``'s math on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.scale = nn.Parameter(torch.rand(DIM) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x * self.scale)))


def _batch(dp: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 * dp + step))


def _reference(dp_size: int, steps: int) -> dict:
    """The same training unsharded on one rank, over all DP ranks' batches."""
    model = nn.Module()
    model.blocks = nn.ModuleList(_fulls())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        x = torch.cat([_batch(dp, step) for dp in range(dp_size)])
        for block in model.blocks:
            x = block(x)
        loss = x.pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "params": {n: _values(p) for n, p in model.named_parameters()}}


def _fulls(blocks: int = 2) -> list[_Full]:
    torch.manual_seed(0)
    return [_Full() for _ in range(blocks)]


class Net(nn.Module):
    def __init__(self, mesh: DeviceMesh, frozen_f64: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(full, mesh, frozen_f64) for full in _fulls())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _shard(lib: str, model: Net, mesh: DeviceMesh, **kwargs) -> Net:
    names = _dp_names(mesh)
    dims = torch_fsdp.DataParallelMeshDims(shard=names[0] if len(names) == 1 else names)
    for block in model.blocks:
        LIBS[lib](block, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    LIBS[lib](model, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    return model


def _values(t: torch.Tensor) -> list[float]:
    return t.detach().double().flatten().tolist()


def _observe(model: nn.Module, grads: bool = False) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if grads and not p.requires_grad:
            continue
        t = p.grad if grads else p
        out[name] = None if t is None else {
            "type": type(t).__name__,
            "placements": str(getattr(t, "placements", None)),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "local_shape": list(t.to_local().shape) if isinstance(t, DTensor) else None,
            "full": _values(t.full_tensor() if isinstance(t, DTensor) else t),
        }  # fmt: skip
    return out


def training(
    world_size: int,
    rank: int,
    tp: int = 1,
    cp: bool = False,
    steps: int = 3,
    typecheck: bool = False,
    frozen_f64: bool = False,
    **kwargs,
) -> dict:
    """Sharded parameters, then ``steps`` AdamW steps: losses, the unsharded
    parameters' types in forward (plain), the last step's sharded gradients and
    the trained parameters. With ``typecheck``, forward and backward run under
    spmd_types' strict type checking, the batch typed V on dp, I on tp."""
    if not AVAILABLE:
        return {"skipped": "no spmd_types"}
    checked = contextlib.nullcontext
    if typecheck:
        from spmd_types.checker import typecheck as checked
    if kwargs.pop("bf16", False):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    mesh = _mesh(world_size, tp, cp)
    dp, dp_size = _dp_rank_size(mesh)
    dp_groups = [mesh.get_group(n) for n in _dp_names(mesh)]
    out = {}
    for lib in LIBS:
        model = _shard(lib, Net(mesh, frozen_f64), mesh, **kwargs)
        sharded = _observe(model)
        seen: list[str] = []
        typed: list[dict] = []  # each parameter's types as the block computes

        def observe(module, args, seen=seen, typed=typed, block=model.blocks[0]):
            seen.append(type(module.weight).__name__)
            typed.append({n: _types(p) for n, p in block.named_parameters()})

        model.blocks[0].w1.register_forward_pre_hook(observe)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        losses, grads = [], {}
        for step in range(steps):
            x = _batch(dp, step)
            with checked(), spmd.set_current_mesh(mesh):
                if typecheck:
                    types = dict.fromkeys(_dp_names(mesh), spmd.V)
                    spmd.assert_type(x, {**types, "tp": spmd.I} if tp > 1 else types)
                loss = model(x).float().pow(2).mean()
                for group in dp_groups if typecheck else ():
                    # the DP ranks' losses are summands of one: V -> P on the DP dims
                    loss = spmd.reinterpret(loss, group, src=spmd.V, dst=spmd.P)
                loss.backward()
            total = loss.detach().clone()  # the mean over DP ranks, as the reference's
            for group in dp_groups:
                dist.all_reduce(total, group=group)
            losses.append(total.item() / dp_size)
            if step == steps - 1:
                grads = _observe(model, grads=True)
            optim.step()
            optim.zero_grad()
        out[lib] = {
            "sharded": sharded,
            "losses": losses,
            "unsharded_types": seen,
            "compute_types": typed,
            "grads": grads,
            "params": _observe(model),
        }
    out["reference"] = _reference(dp_size, steps)
    return out


def fullgraph(world_size: int, rank: int, tp: int = 1, cp: bool = False, **kwargs) -> dict:
    """fsdp-rs trained eager and compiled whole with ``fullgraph=True``
    (``scenario_common.eager_and_compiled``), type checking off: losses, the
    last step's sharded gradients and the trained parameters."""
    if not AVAILABLE:
        return {"skipped": "no spmd_types"}
    if kwargs.pop("bf16", False):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    mesh = _mesh(world_size, tp, cp)
    dp, _ = _dp_rank_size(mesh)

    def train(model: nn.Module, run: nn.Module, after_first) -> dict:
        def step_loss(step: int) -> float:
            if step == 1 and after_first is not None:
                after_first()
            with spmd.set_current_mesh(mesh):
                loss = run(_batch(dp, step)).float().pow(2).mean()
                loss.backward()
            return loss.item()

        observe = functools.partial(_observe, model, grads=True)
        losses, grads = train_adamw(model, step_loss, STEPS, observe)
        return {"losses": losses, "grads": grads, "params": _observe(model)}

    return eager_and_compiled(lambda: _shard("rs", Net(mesh), mesh, **kwargs), train)


def _types(t: torch.Tensor) -> str:
    """A tensor's spmd_types local type, in a form JSON keeps."""
    return str(sorted((str(k), str(v)) for k, v in spmd.get_local_type(t).items()))


def _error(fn: Callable) -> str | None:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def errors(world_size: int, rank: int) -> dict:
    """Misuse each library refuses at ``fully_shard`` (the message, or None):
    an annotated parameter without ``dp_mesh_dims``; one typed ``I`` on the DP
    dim; one with no type on ``tp`` (a non-DP dim of the mesh)."""
    if not AVAILABLE:
        return {"skipped": "no spmd_types"}
    mesh = _mesh(world_size, 2 if world_size >= 4 else 1)
    has_tp = "tp" in mesh.mesh_dim_names
    dims = torch_fsdp.DataParallelMeshDims(shard="dp")

    def linear(types: dict) -> nn.Linear:
        module = nn.Linear(DIM, DIM)
        with spmd.set_current_mesh(mesh):
            for p in module.parameters():
                spmd.assert_type(p, types)
        return module

    cases = {
        "no_dp_mesh_dims": lambda lib: LIBS[lib](linear({"dp": spmd.R}), mesh=mesh["dp"]),
        "invariant_on_dp": lambda lib: LIBS[lib](
            linear({"dp": spmd.I}), mesh=mesh, dp_mesh_dims=dims
        ),
    }
    if has_tp:
        cases["untyped_tp"] = lambda lib: LIBS[lib](
            linear({"dp": spmd.R}), mesh=mesh, dp_mesh_dims=dims
        )
    return {lib: {c: _error(functools.partial(fn, lib)) for c, fn in cases.items()} for lib in LIBS}


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "dp": (training, {}),
    "dp_keep": (training, {"reshard_after_forward": False}),
    "dp_bf16": (training, {"bf16": True}),
    "dp_tp": (training, {"tp": 2, "min_world": 4}),
    "dp_tp_bf16": (training, {"tp": 2, "bf16": True, "min_world": 4}),
    "dp_typechecked": (training, {"typecheck": True}),
    "dp_tp_typechecked": (training, {"tp": 2, "typecheck": True, "min_world": 4}),
    "dp_typechecked_two_dtypes": (training, {"typecheck": True, "frozen_f64": True}),
    "dp_tp_typechecked_two_dtypes": (
        training,
        {"tp": 2, "typecheck": True, "frozen_f64": True, "min_world": 4},
    ),
    "dp_cp": (training, {"cp": True, "min_world": 4}),
    "dp_cp_typechecked": (training, {"cp": True, "typecheck": True, "min_world": 4}),
    "errors": (errors, {}),
    "fullgraph": (fullgraph, {}),
    "fullgraph_bf16": (fullgraph, {"bf16": True}),
    "fullgraph_tp": (fullgraph, {"tp": 2, "min_world": 4}),
    "fullgraph_cp": (fullgraph, {"cp": True, "min_world": 4}),
    "fullgraph_tp_bf16": (fullgraph, {"tp": 2, "bf16": True, "min_world": 4}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)


__all__ = ["AVAILABLE", "SCENARIOS", "run"]
