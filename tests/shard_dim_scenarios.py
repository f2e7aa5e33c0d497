"""``shard_placement_fn`` returning ``Shard(d)`` for ``d != 0`` ([Note:
Sharding on another dim]) trained with fsdp-rs and with torch FSDP2 side by
side in one spawned gloo process: stacked expert weights ``(E, d, h)`` on dim
1 next to dense layers on dim 0, every parameter on its largest dim, and on
dim -1. Each returns, per library, the losses, every parameter's placements,
local shape and stride, ``full_tensor()`` and gradient (compared bit for bit
by ``test_shard_dim.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import Shard

import fsdp_rs
import fsdp_rs.optim
from scenario_common import LIBS, _inputs, _mesh
from spawned import run_named

DIM, EXPERTS, HIDDEN, STEPS = 16, 2, 32, 3


class Experts(nn.Module):
    """Stacked expert weights ``(E, DIM, HIDDEN)`` and a dense projection."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.1)
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1)  # (B, E)
        h = torch.relu(torch.einsum("bd,edh->beh", x, self.w_in))
        y = torch.einsum("beh,ehd->bed", h, self.w_out)
        return x + (weights.unsqueeze(-1) * y).sum(1)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Experts() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)  # every local shard whole 16-byte units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def experts_on_dim1(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.ndim == 3 else None


def largest_dim(p: nn.Parameter) -> Shard:
    return Shard(max(range(p.ndim), key=lambda d: p.shape[d]))


def last_dim(p: nn.Parameter) -> Shard:
    return Shard(-1)


PLACEMENT_FNS = {"experts": experts_on_dim1, "largest": largest_dim, "last": last_dim}


def _model(meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return MoE()
    return MoE()


def _chunk(full: torch.Tensor, dim: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s chunk on ``dim`` as FSDP2 chunks (``torch.chunk``; empty
    past the last chunk)."""
    size = -(-full.size(dim) // world_size)
    start = min(rank * size, full.size(dim))
    return full.narrow(dim, start, min(size, full.size(dim) - start))


def _observe(model: nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        local = p._local_tensor
        out[name] = {
            "placements": str(p.placements),
            "local": [list(local.shape), list(local.stride())],
            "full": p.full_tensor().double().flatten().tolist(),
            "grad": None if p.grad is None else p.grad.full_tensor().double().flatten().tolist(),
        }
    return out


def train(
    world_size: int,
    rank: int,
    fn: str,
    meta: bool = False,
    accumulate: bool = False,
    flat: bool = False,
    hsdp: bool = False,
    **shard_kwargs,
) -> dict:
    if shard_kwargs.pop("mp", False):
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if shard_kwargs.pop("offload", False):
        shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    reference = _model().state_dict()
    out = {}
    for lib, shard in LIBS.items():
        model = _model(meta)
        kwargs = {"mesh": _mesh(world_size, hsdp), "shard_placement_fn": PLACEMENT_FNS[fn]}
        for block in model.blocks:
            shard(block, **kwargs, **shard_kwargs)
        shard(model, **kwargs, **shard_kwargs)
        if meta:
            model.to_empty(device="cpu")
            with torch.no_grad():
                for name, p in model.named_parameters():
                    dim = p.placements[0].dim
                    p._local_tensor.copy_(_chunk(reference[name], dim, world_size, rank))
        if flat and lib == "rs":
            optim = fsdp_rs.optim.FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        else:
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x = _inputs(rank, step)
            if accumulate:
                model.set_requires_gradient_sync(False)
                model(x).pow(2).mean().backward()
                model.set_requires_gradient_sync(True)
            loss = model(x).pow(2).mean()
            loss.backward()
            # torch's clip on both: fsdp_rs.clip_grad_norm_ sums the norm's parts
            # in another order (within fp32 rounding, tests/test_clip_grad.py)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            losses.append([loss.item(), norm.full_tensor().item()])
            if step < STEPS - 1:
                optim.step()
                optim.zero_grad()
        out[lib] = {"losses": losses, "params": _observe(model)}
    return out


def uneven(world_size: int, rank: int) -> dict:
    """An uneven dim > 0: refused as FSDP2 refuses it, on every rank."""
    out = {}
    for lib, shard in LIBS.items():
        model = nn.Linear(world_size + 1, DIM, bias=False)  # weight (DIM, W + 1)
        try:
            shard(model, mesh=_mesh(world_size, False), shard_placement_fn=last_dim)
        except Exception as e:  # the class is what is compared
            out[lib] = {"error": type(e).__name__ == "NotImplementedError"}
        else:
            out[lib] = {"error": False}
    return out


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "experts": (train, {"fn": "experts"}),
    "experts_keep": (train, {"fn": "experts", "reshard_after_forward": False}),
    "experts_bf16": (train, {"fn": "experts", "mp": True}),
    "experts_offload": (train, {"fn": "experts", "offload": True}),
    "experts_accumulate": (train, {"fn": "experts", "accumulate": True}),
    "experts_meta": (train, {"fn": "experts", "meta": True}),
    "experts_flat": (train, {"fn": "experts", "flat": True}),
    "experts_hsdp": (train, {"fn": "experts", "hsdp": True, "min_world": 4}),
    "largest": (train, {"fn": "largest"}),
    "last": (train, {"fn": "last"}),
    "uneven": (uneven, {}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
