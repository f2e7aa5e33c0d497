"""All-gather extensions ([Note: All-gather extensions]) trained with fsdp-rs
and with torch FSDP2 side by side in one spawned gloo process: a tensor
subclass holding two copies of the weight (the pre-all-gather of FSDP2's old
one-argument signature and of its five-argument one), a weight all-gathered
in bfloat16 (quantized communication, padding its own uneven shard, next to
plain biases), and methods set on the plain local shards after meta-device
init. Each returns, per library, the losses, every local shard and sharded
gradient (compared bit for bit by ``test_extensions.py``) and what the hooks
saw."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.two_tensor import TwoTensor

from scenario_common import BATCH, DIM, HIDDEN, LIBS, _inputs, _mesh, eager_and_compiled
from spawned import run_named

STEPS = 3


# ----------------------------------------------------------------- tensors


@torch.no_grad()  # FSDP2 calls it in grad mode
def _pair_post(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:
        if a.dtype == param_dtype:  # the outputs are the unsharded tensor's own data
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        else:
            out.a.copy_(a[: out.size(0)])
            out.b.copy_(b[: out.size(0)])
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


class PairV1(TwoTensor):
    """Two copies of a weight, all-gathered as two inputs (one-argument
    pre-all-gather)."""

    def fsdp_pre_all_gather(self, mesh):
        return (self.a, self.b), None

    fsdp_post_all_gather = _pair_post


class PairV2(TwoTensor):
    """The same with the five-argument pre-all-gather; records what it got."""

    seen: ClassVar[list] = []

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        PairV2.seen.append((mesh.ndim, tuple(outer_size), type(module).__name__))
        return (self.a, self.b), None

    fsdp_post_all_gather = _pair_post


class PairKept(PairV2):
    """``PairV2`` rebuilt as itself from its inner tensors (``TwoTensor``'s
    ``__tensor_unflatten__`` makes a ``TwoTensor``), so torch.compile keeps
    its extension ([Note: Extensions under trace])."""

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return PairKept(inner["a"], inner["b"], outer_size, outer_stride)


class Bf16Gathered(torch.Tensor):
    """fp32 data all-gathered in bfloat16, padded by its pre-all-gather."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype,
            device=data.device,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Bf16Gathered({self._data})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Bf16Gathered(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = functools.partial(pytree.tree_map_only, cls, lambda t: t._data)
        out = func(*unwrap(args), **unwrap(kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = self._data.new_zeros((rows, *self._data.shape[1:]), dtype=torch.bfloat16)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    @torch.no_grad()  # FSDP2 calls it in grad mode
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])
            return None
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)


# ------------------------------------------------------------------ models


class Mlp(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, HIDDEN, bias=bias)
        self.lin2 = nn.Linear(HIDDEN, DIM, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


class MlpNet(nn.Module):
    def __init__(self, bias: bool = False, out: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp(bias) for _ in range(2))
        self.head = nn.Linear(DIM, out, bias=False)  # out=5: uneven, empty at W=4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(wrap: Callable | None, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = MlpNet(**kwargs)
    if wrap is not None:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight = nn.Parameter(wrap(m.weight.detach()))
    return model


def _values(t: torch.Tensor) -> list:
    """A tensor's values as floats, each component of a subclass."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, TwoTensor):
        return [_values(t.a), _values(t.b)]
    if isinstance(t, Bf16Gathered):
        t = t._data
    return t.detach().double().flatten().tolist()


def _observe(model: nn.Module) -> dict:
    return {
        "params": {n: _values(p) for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else _values(p.grad)
                  for n, p in model.named_parameters()},
    }  # fmt: skip


def _train(model: nn.Module, rank: int, accumulate: bool = False, after_first=None) -> list:
    """Losses of ``STEPS`` Adam steps; ``after_first()`` is called after the first."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if step == 1 and after_first is not None:
            after_first()
        if accumulate:
            model.set_requires_gradient_sync(False)
            model(_inputs(rank, step, 1)).sum().backward()
            model.set_requires_gradient_sync(True)
        loss = model(_inputs(rank, step)).sum()
        loss.backward()
        losses.append(_values(loss))
        if step < STEPS - 1:
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)
    return losses


def _shard(lib: str, model: nn.Module, mesh, **kwargs) -> nn.Module:
    for block in model.blocks:
        LIBS[lib](block, mesh=mesh, **kwargs)
    LIBS[lib](model, mesh=mesh, **kwargs)
    return model


# --------------------------------------------------------------- scenarios


def _subclass(kind: str, shard_kwargs: dict) -> tuple[Callable, dict]:
    """(how to wrap a weight, the model's kwargs) of subclass ``kind``; the
    ``mp`` and ``offload`` flags of ``shard_kwargs`` made policies in place."""
    if shard_kwargs.pop("mp", False):
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if shard_kwargs.pop("offload", False):
        shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return {
        "pair_v1": (lambda w: PairV1(w, w.clone()), {}),
        "pair_v2": (lambda w: PairV2(w, w.clone()), {}),
        "pair_kept": (lambda w: PairKept(w, w.clone()), {}),
        "bf16": (lambda w: Bf16Gathered(w.clone()), {"bias": True, "out": 5}),
    }[kind]


def subclass_training(
    world_size: int,
    rank: int,
    kind: str,
    accumulate: bool = False,
    freeze: bool = False,
    inference: bool = False,
    **shard_kwargs,
) -> dict:
    """Training with parameters of an extension subclass, against FSDP2;
    ``freeze``: an extension weight and a bias frozen after the first step
    ([Note: Trainable set changes]); ``inference``: an evaluation forward first,
    fsdp-rs under ``torch.inference_mode()``, FSDP2 under ``torch.no_grad()``
    ([Note: Made outside inference mode])."""
    wrap, model_kwargs = _subclass(kind, shard_kwargs)
    out = {}
    for lib in LIBS:
        PairV2.seen.clear()
        model = _shard(lib, _model(wrap, **model_kwargs), _mesh(world_size, False), **shard_kwargs)
        local_types = sorted({type(p._local_tensor).__name__ for p in model.parameters()})

        evaluated = []
        if inference:
            with torch.inference_mode() if lib == "rs" else torch.no_grad():
                evaluated = _values(model(_inputs(rank, 99)).sum())

        def frozen(model=model) -> None:
            model.blocks[0].lin1.weight.requires_grad_(False)
            model.blocks[1].lin2.bias.requires_grad_(False)

        losses = _train(model, rank, accumulate, frozen if freeze else None)
        out[lib] = {
            "losses": losses,
            **_observe(model),
            "local_types": local_types,
            "seen": sorted(set(PairV2.seen)),
            "evaluated": evaluated,
        }
    return out


def fullgraph(
    world_size: int,
    rank: int,
    kind: str,
    hsdp: bool = False,
    frozen: bool = False,
    compiler: str = "aot_eager",
    **shard_kwargs,
) -> dict:
    """Training with parameters of an extension subclass, eager and compiled
    whole with ``fullgraph=True`` after ``set_fullgraph_compile()``
    (``scenario_common.eager_and_compiled``: with the ops of each graph it
    compiled listed); ``{"refused": message}`` where it refuses. ``hsdp``: a (2, W / 2) mesh;
    ``frozen``: the blocks' first weights frozen, beside trained ones;
    ``compiler``: "aot_eager" or "inductor" (whose graphs are not listed)."""
    wrap, model_kwargs = _subclass(kind, shard_kwargs)

    def build() -> nn.Module:
        model = _model(wrap, **model_kwargs)
        for block in model.blocks if frozen else ():
            block.lin1.weight.requires_grad_(False)
        return _shard("rs", model, _mesh(world_size, hsdp), **shard_kwargs)

    def train(model: nn.Module, run: nn.Module, after_first) -> dict:
        return {"losses": _train(run, rank, after_first=after_first), **_observe(model)}

    return eager_and_compiled(build, train, compiler)


def _bf16_methods(calls: dict) -> tuple[Callable, Callable]:
    """A bf16 all-gather as a pre/post pair of plain functions (to set on plain
    local shards), counting their calls and the meshes seen in ``calls``."""

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        calls["mesh"].add((mesh.ndim, mesh.size()))
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        calls["post"] += 1
        (gathered,) = outputs
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)

    return pre, post


def patched(world_size: int, rank: int, hsdp: bool = False) -> dict:
    """Meta-device init, ``to_empty``, values copied in, then bf16 all-gather
    methods set on each weight's plain local shard (as FSDP2's test does)."""
    reference = _model(None).state_dict()
    out = {}
    for lib in LIBS:
        calls = {"pre": 0, "post": 0, "mesh": set()}
        pre, post = _bf16_methods(calls)
        with torch.device("meta"):
            model = _model(None)
        mesh = _mesh(world_size, hsdp)
        _shard(lib, model, mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                coordinate = p.device_mesh.get_coordinate()[-1]
                chunks = reference[name].chunk(p.device_mesh.size(-1))
                p._local_tensor.copy_(chunks[coordinate])
                if name.endswith("weight"):
                    local = p._local_tensor
                    local.fsdp_pre_all_gather = pre.__get__(local)
                    local.fsdp_post_all_gather = post.__get__(local)
        losses = _train(model, rank)
        out[lib] = {
            "losses": losses,
            **_observe(model),
            "called": calls["pre"] > 0 and calls["post"] > 0,
            "mesh": sorted(calls["mesh"]),
        }
    return out


def one_sided(world_size: int, rank: int) -> dict:
    """A local shard with a pre-all-gather and no post-all-gather: refused at
    the first forward, on every rank, before any collective."""
    model = _shard("rs", _model(None), _mesh(world_size, False))
    local = model.head.weight._local_tensor
    local.fsdp_pre_all_gather = lambda mesh: ((local,), None)
    try:
        model(_inputs(rank, 0))
    except ValueError as e:
        return {"error_type": "ValueError", "message": str(e)}
    return {"error_type": None}


def patched_on_one_rank(world_size: int, rank: int) -> dict:
    """Methods set on rank 0's local shards only: every rank raises the plan
    check's error naming it, none waits in a mismatched all-gather."""
    model = _shard("rs", _model(None), _mesh(world_size, False))
    if rank == 0:
        pre, post = _bf16_methods({"pre": 0, "post": 0, "mesh": set()})
        local = model.head.weight._local_tensor
        local.fsdp_pre_all_gather = pre.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)
    try:
        model(_inputs(rank, 0))
    except RuntimeError as e:
        return {"error_type": type(e).__name__, "message": str(e)}
    return {"error_type": None}


def bad_arity(world_size: int, rank: int) -> dict:
    """A pre-all-gather of neither FSDP2 signature: a TypeError naming it."""

    class Odd(PairV1):
        def fsdp_pre_all_gather(self, mesh, outer_size):
            return (self.a, self.b), None

    model = _shard("rs", _model(lambda w: Odd(w, w.clone())), _mesh(world_size, False))
    try:
        model(_inputs(rank, 0))
    except TypeError as e:
        return {"error_type": "TypeError", "message": str(e)}
    return {"error_type": None}


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "pair_v1": (subclass_training, {"kind": "pair_v1"}),
    "pair_v1_keep": (subclass_training, {"kind": "pair_v1", "reshard_after_forward": False}),
    "pair_v2": (subclass_training, {"kind": "pair_v2"}),
    "pair_v2_bf16": (subclass_training, {"kind": "pair_v2", "mp": True}),
    "bf16": (subclass_training, {"kind": "bf16"}),
    "bf16_keep": (subclass_training, {"kind": "bf16", "reshard_after_forward": False}),
    "bf16_offload": (subclass_training, {"kind": "bf16", "offload": True}),
    "bf16_accumulate": (subclass_training, {"kind": "bf16", "accumulate": True}),
    "bf16_freeze": (subclass_training, {"kind": "bf16", "freeze": True}),
    "bf16_inference": (subclass_training, {"kind": "bf16", "inference": True}),
    "pair_v2_inference": (subclass_training, {"kind": "pair_v2", "inference": True}),
    "fullgraph_bf16": (fullgraph, {"kind": "bf16"}),
    "fullgraph_bf16_keep": (fullgraph, {"kind": "bf16", "reshard_after_forward": False}),
    "fullgraph_pair": (fullgraph, {"kind": "pair_kept"}),
    "fullgraph_pair_bf16": (fullgraph, {"kind": "pair_kept", "mp": True}),
    "fullgraph_pair_v1": (fullgraph, {"kind": "pair_v1"}),
    "fullgraph_bf16_offload": (fullgraph, {"kind": "bf16", "offload": True}),
    "fullgraph_bf16_frozen": (fullgraph, {"kind": "bf16", "frozen": True}),
    "fullgraph_bf16_hsdp": (fullgraph, {"kind": "bf16", "hsdp": True, "min_world": 4}),
    "fullgraph_bf16_inductor": (fullgraph, {"kind": "bf16", "compiler": "inductor"}),
    "patched": (patched, {}),
    "patched_hsdp": (patched, {"hsdp": True, "min_world": 4}),
    "one_sided": (one_sided, {}),
    "bad_arity": (bad_arity, {}),
    "patched_on_one_rank": (patched_on_one_rank, {}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)


__all__ = ["BATCH", "SCENARIOS", "run"]
