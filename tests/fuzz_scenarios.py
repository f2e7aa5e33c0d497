"""Differential fuzzing against torch FSDP2: a seeded random model, sharding
and training loop, run under both libraries in one spawn of gloo ranks; each
step's losses, gradients (whole) and the final parameters are compared bit
for bit, and where the run is fp32 also with the unsharded model whose
gradients are all-reduced (``train_reference``).

What a seed draws: 1-4 blocks of odd widths (bias or not, LayerNorm, a scale
vector, a parameter never used, a branch used on even steps only, activation
checkpointing); which blocks get their own ``fully_shard`` (a call over two,
or left to the root), each call's ``reshard_after_forward``; the mixed
precision policy (one for all, or drawn per call), CPU offload; frozen
parameters; SGD with momentum, AdamW or single-tensor Adam; micro-steps with
and without gradient sync; ``zero_grad`` with and without ``set_to_none``;
evaluation forwards under ``no_grad`` between steps; an explicit ``unshard()``;
``set_reshard_after_backward(False)`` (resharding before the optimizer, as it
asks); a call's matrices sharded on dim 1 (``shard_placement_fn``), explicit
forward and backward prefetching, a call's gradient divide factor, sums only
(``set_force_sum_reduction_for_comms``), a block called twice per forward; a
``requires_grad`` flipped through the registered parameter before the second
step ([Note: Trainable set changes]: FSDP2 follows a change on the sharded
parameter, so its run reshards first).

A seed may also run the branches on alternate ranks, so that their parameters
get a gradient on some ranks only ([Note: Gradient agreement]): both libraries
then reduce unused parameters' zeros (``set_reduce_scatter_unused_params``,
without which FSDP2's ranks issue reduce-scatters of different sizes), and
under mixed precision, where FSDP2's reduction of those zeros fails, fsdp-rs
runs alone (against the reference where fp32). The reference runs at W = 2
only: gloo's sums of two values do not depend on buffer sizes ([Note: Gloo sums
by buffer size] in test_dropin.py).

At W = 4 (gloo sums four values in an order that depends on the buffer's
size) the widths are multiples of 32 and only FSDP2 is compared; there the
mesh may be HSDP (2 x 2, micro-steps skipping the all-reduce only) and
``reshard_after_forward`` 2. fsdp-rs may step a ``FlatOptimizer`` where FSDP2
steps the per-parameter optimizer, and both may clip with torch's
``clip_grad_norm_`` (its norm compared too).

``python tests/fuzz_scenarios.py FIRST LAST [W]`` runs seeds FIRST..LAST-1 and
prints each one that differs with its configuration."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_state as _torch_fsdp_state
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

import fsdp_rs
from fsdp_rs.optim import FlatOptimizer
from scenario_common import reshard_all

WIDTHS = (5, 7, 8, 12, 13, 16, 17, 33)
WIDTHS_W4 = (32, 64)  # bf16 shards of whole 16-byte units at W = 4
# FSDP2 casts each module's output of a call over several modules to output_dtype
_CASTS_EVERY_OUTPUT = hasattr(_torch_fsdp_state.FSDPState, "_cast_output_dtype")
POLICIES = {
    "none": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "bf16_fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "fp32_out_bf16": {"output_dtype": torch.bfloat16},
    "bf16_nocast": {"param_dtype": torch.bfloat16, "cast_forward_inputs": False},
}


class Block(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.c = c
        self.lin1 = nn.Linear(c["din"], c["hid"], bias=c["bias1"])
        self.norm = nn.LayerNorm(c["hid"]) if c["norm"] else None
        self.lin2 = nn.Linear(c["hid"], c["dout"], bias=c["bias2"])
        self.scale = nn.Parameter(torch.randn(c["dout"]) * 0.1 + 1) if c["scale"] else None
        self.unused = nn.Parameter(torch.randn(c["dout"], 4)) if c["unused"] else None
        self.branch = nn.Linear(c["hid"], c["hid"]) if c["branch"] else None

    def _body(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.lin1(x.to(self.lin1.weight.dtype))
        if self.norm is not None:
            h = self.norm(h)
        h = torch.tanh(h)
        if self.branch is not None and step % 2 == 0:
            h = h + self.branch(h)
        y = self.lin2(h.to(self.lin2.weight.dtype))
        return y if self.scale is None else y * self.scale

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        if self.c["ckpt"] and torch.is_grad_enabled():
            return checkpoint(self._body, x, step, use_reentrant=False)
        return self._body(x, step)


class Model(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(c) for c in cfg["blocks"])
        self.head = nn.Linear(cfg["blocks"][-1]["dout"], cfg["head_out"], bias=cfg["head_bias"])
        self.twice = cfg.get("twice")

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, step)
            if i == self.twice:
                x = block(x, step)
        return self.head(x.to(self.head.weight.dtype))


def config(seed: int, world_size: int = 2) -> dict:
    """The run seed ``seed`` stands for at ``world_size`` (plain data: printed
    when it differs). At W = 4 the widths are multiples of 32 (every shard
    whole 16-byte units: [Note: Gloo sums by buffer size]), and the mesh may be
    HSDP 2 x 2, with ``reshard_after_forward=2`` on the flat mesh."""
    r = random.Random(seed if world_size == 2 else seed * 7919 + world_size)
    widths_of = WIDTHS if world_size == 2 else WIDTHS_W4
    n = r.randint(1, 4)
    widths = [r.choice(widths_of) for _ in range(n + 1)]
    hsdp = world_size == 4 and r.random() < 0.4
    rafs = [True, False, None] + ([2] if world_size == 4 and not hsdp else [])
    blocks = [
        {
            "din": widths[i],
            "dout": widths[i + 1],
            "hid": r.choice(widths_of),
            "bias1": r.random() < 0.7,
            "bias2": r.random() < 0.5,
            "norm": r.random() < 0.4,
            "scale": r.random() < 0.3,
            "unused": r.random() < 0.2,
            "branch": r.random() < 0.25,
            "ckpt": r.random() < 0.25,
        }
        for i in range(n)
    ]
    calls: list[list[int]] = []  # block indices, one fully_shard call each
    i = 0
    while i < n:
        u = r.random()
        if u < 0.2 and i + 1 < n:
            calls.append([i, i + 1])
            i += 2
        else:
            if u < 0.85:
                calls.append([i])
            i += 1  # else left to the root
    frozen = [
        (b, name)
        for b, c in enumerate(blocks)
        for name in ("lin1.weight", "lin2.bias")
        if (name != "lin2.bias" or c["bias2"]) and r.random() < 0.15
    ]
    steps = r.randint(2, 4)
    mp = r.choice(["none", "none", "bf16", "bf16_fp32", "fp32_out_bf16", "bf16_nocast"])
    per_call = r.random() < 0.2
    return (
        {
            "seed": seed,
            "blocks": blocks,
            "head_bias": r.random() < 0.5,
            "calls": calls,
            "hsdp": hsdp,
            "raf": [r.choice(rafs) for _ in calls],
            "root_raf": r.choice(rafs),
            "mp": mp,
            "call_mp": [r.choice(["none", "bf16", "bf16_fp32"]) if per_call else mp for _ in calls],
            "offload": r.random() < 0.15,
            "frozen": frozen,
            "optim": r.choice(["sgd", "adamw", "adam_single"]),
            "steps": steps,
            "micro": [r.choice([1, 1, 2, 3]) for _ in range(steps)],
            "nosync": [r.random() < 0.6 for _ in range(steps)],
            "set_to_none": [r.random() < 0.7 for _ in range(steps)],
            "eval_between": r.random() < 0.35,
            "explicit_unshard": r.random() < 0.15,
            # one parameter's requires_grad flipped before the second step: a frozen
            # one unfrozen, or a trained one frozen
            "toggle": None
            if r.random() < 0.65
            else r.choice(frozen)
            if frozen and r.random() < 0.5
            else (r.randrange(n), r.choice(["lin1.weight", "lin2.weight"])),
            "no_reshard_after_backward": r.random() < 0.1,
            "loss": r.choice(["sum", "mean_sq"]),
        }
        | {  # drawn after the rest, so that earlier seeds kept their runs
            # fsdp-rs steps a FlatOptimizer of the same class and settings
            "flat": r.random() < 0.3,
            "clip": r.random() < 0.3,  # torch.nn.utils.clip_grad_norm_ before the step
            # HSDP: the micro-steps without sync skip only the all-reduce
            "no_all_reduce": hsdp and r.random() < 0.5,
            "head_out": 4 if world_size == 2 else widths_of[0],
            # the branches run on alternate ranks: their parameters get a gradient on
            # some ranks only ([Note: Gradient agreement])
            "rank_branch": r.random() < 0.25,
        }
        | {  # drawn after the rest (2026-11-29)
            # each call's matrices sharded on dim 1 (shard_placement_fn)
            "shard1": [r.random() < 0.2 for _ in calls],
            # explicit prefetching: each call's module gathers the next one's in
            # forward and the previous one's in backward
            "prefetch": r.random() < 0.2,
            # each call's gradient divide factor (None: the data-parallel size)
            "divide": [r.choice([None, None, None, None, 1.0, 3.0]) for _ in calls],
            "force_sum": r.random() < 0.15,  # sums only, dividing before and after
            # a block whose input and output widths match called twice per forward
            "twice": _twice(r, blocks),
        }
    )


def _twice(r: random.Random, blocks: list[dict]) -> int | None:
    square = [i for i, c in enumerate(blocks) if c["din"] == c["dout"]]
    return r.choice(square) if square and r.random() < 0.3 else None


def _optimizer(cfg: dict, params: list, flat: bool = False) -> torch.optim.Optimizer:
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        "adam_single": (torch.optim.Adam, {"lr": 0.01, "foreach": False}),
    }[cfg["optim"]]
    return FlatOptimizer(params, cls, **kwargs) if flat else cls(params, **kwargs)


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _model(cfg: dict) -> nn.Module:
    torch.manual_seed(cfg["seed"])
    model = Model(cfg)
    for b, name in cfg["frozen"]:
        model.blocks[b].get_parameter(name).requires_grad_(False)
    return model


def _on_dim1(p: nn.Parameter) -> Shard | None:
    """Matrices whose dim 1 divides evenly on dim 1 (FSDP refuses the others)."""
    return Shard(1) if p.ndim == 2 and p.shape[1] % dist.get_world_size() == 0 else None


def _set_flags(cfg: dict, model: nn.Module) -> None:
    """The drawn FSDPModule setters of each call's module (the first of a
    call over several) and the root."""
    firsts = [model.blocks[call[0]] for call in cfg["calls"]]
    for module, factor in zip(firsts, cfg.get("divide", []), strict=False):
        if factor is not None:  # gloo has no pre-multiplied sum: sums only
            module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(True)
    if cfg.get("force_sum"):
        for module in [*firsts, model]:
            module.set_force_sum_reduction_for_comms(True)
    if cfg.get("prefetch") and len(firsts) > 1:
        for i, module in enumerate(firsts):
            if i + 1 < len(firsts):
                module.set_modules_to_forward_prefetch([firsts[i + 1]])
            if i > 0:
                module.set_modules_to_backward_prefetch([firsts[i - 1]])


def _flip(cfg: dict, model: nn.Module) -> None:
    b, name = cfg["toggle"]
    p = model.blocks[b].get_parameter(name)  # the registered one: unsharded or not
    p.requires_grad_(not p.requires_grad)


def _phase(cfg: dict, rank: int, step: int) -> int:
    """What decides whether the branches run (on even phases)."""
    return step + rank if cfg["rank_branch"] else step


def _batch(cfg: dict, rank: int, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(3, cfg["blocks"][0]["din"], generator=gen)


def _loss(cfg: dict, out: torch.Tensor) -> torch.Tensor:
    return out.float().sum() if cfg["loss"] == "sum" else out.float().pow(2).mean()


def _evaluate(cfg: dict, model: Callable, step: int, rec: dict) -> None:
    """The evaluation forward under ``no_grad`` after a step, where drawn."""
    if cfg["eval_between"]:
        with torch.no_grad():
            x = torch.ones(2, cfg["blocks"][0]["din"])
            rec["losses"].append(_loss(cfg, model(x, step)))


def train(cfg: dict, lib: str, rank: int, compiled: Callable | None = None) -> dict:
    """The run under ``lib`` ("torch" or "rs"): losses, each step's whole
    gradients before the optimizer, the final whole parameters. ``compiled``,
    given the sharded model, returns what the loop calls in its place
    (``fuzz_compile_scenarios``)."""
    shard = torch_fully_shard if lib == "torch" else fsdp_rs.fully_shard
    model = _model(cfg)
    offload = CPUOffloadPolicy(pin_memory=False) if cfg["offload"] else OffloadPolicy()
    world_size = dist.get_world_size()
    if cfg.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    shard1 = cfg.get("shard1") or [False] * len(cfg["calls"])
    for call, raf, mp, dim1 in zip(cfg["calls"], cfg["raf"], cfg["call_mp"], shard1, strict=True):
        modules = [model.blocks[i] for i in call]
        if lib == "torch" and dim1 and type(raf) is int:
            # torch 2.13's FSDP2 fails to gather its post-forward shards of
            # Shard(1) matrices (IndexError in foreach_all_gather_copy_out);
            # resharding to a smaller group changes memory only, not the values
            raf = True
        shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=raf,
            mp_policy=MixedPrecisionPolicy(**POLICIES[mp]),
            offload_policy=offload,
            shard_placement_fn=_on_dim1 if dim1 else None,
        )
    shard(
        model,
        mesh=mesh,
        reshard_after_forward=cfg["root_raf"],
        mp_policy=MixedPrecisionPolicy(**POLICIES[cfg["mp"]]),
        offload_policy=offload,
    )
    if cfg["no_reshard_after_backward"]:
        model.set_reshard_after_backward(False)
    _set_flags(cfg, model)
    if cfg["rank_branch"]:
        # FSDP2 reduce-scatters the gradients each rank holds, so the ranks'
        # collectives would differ; with this it reduces zeros for the others
        # (fsdp-rs agrees on them anyway: [Note: Gradient agreement])
        for module in model.modules():
            if isinstance(module, fsdp_rs.FSDPModule | TorchFSDPModule):
                module.set_reduce_scatter_unused_params(True)
    run = model if compiled is None else compiled(model)
    params = list(model.parameters())
    optim = _optimizer(cfg, params, flat=cfg.get("flat", False) and lib == "rs")
    rec: dict = {"losses": [], "grads": []}
    for step in range(cfg["steps"]):
        if cfg["toggle"] is not None and step == 1:
            if lib == "torch":  # FSDP2 follows a change on the sharded parameter
                reshard_all(model)
            _flip(cfg, model)
        micro = cfg["micro"][step]
        for m in range(micro):
            sync = m == micro - 1 or not cfg["nosync"][step]
            if cfg.get("no_all_reduce"):
                model.set_requires_all_reduce(sync)
            else:
                model.set_requires_gradient_sync(sync)
            if cfg["explicit_unshard"] and m == 0:
                model.unshard()
            loss = _loss(cfg, run(_batch(cfg, rank, step, m), _phase(cfg, rank, step)))
            loss.backward()
            rec["losses"].append(loss.detach().clone())
        rec["grads"].append([_whole(p.grad) for p in params])
        if cfg["no_reshard_after_backward"]:  # the optimizer steps the shards
            reshard_all(model)
        if cfg.get("clip"):
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
            rec["losses"].append(_whole(norm))
        optim.step()
        optim.zero_grad(set_to_none=cfg["set_to_none"][step])
        _evaluate(cfg, run, step, rec)
    rec["params"] = [_whole(p) for p in params]
    return rec


def train_reference(cfg: dict, rank: int) -> dict:
    """The unsharded model (fp32, no mixed precision, no clipping): each synced backward's
    gradients all-reduced and averaged, then added to what the step's earlier
    synced backwards left, as FSDP adds reduced gradients."""
    model = _model(cfg)
    world_size = dist.get_world_size()
    params = list(model.parameters())
    optim = _optimizer(cfg, params)
    rec: dict = {"losses": [], "grads": []}
    reduced: list = [None] * len(params)
    for step in range(cfg["steps"]):
        if cfg["toggle"] is not None and step == 1:
            _flip(cfg, model)
        micro = cfg["micro"][step]
        for m in range(micro):
            loss = _loss(cfg, model(_batch(cfg, rank, step, m), _phase(cfg, rank, step)))
            loss.backward()
            rec["losses"].append(loss.detach().clone())
            if m == micro - 1 or not cfg["nosync"][step]:
                # a gradient some rank had counts as zeros on the others; with
                # set_reduce_scatter_unused_params every trained parameter has one
                unused = cfg["rank_branch"]
                had = [p.grad is not None or (unused and p.requires_grad) for p in params]
                had = torch.tensor(had, dtype=torch.uint8)
                dist.all_reduce(had, op=dist.ReduceOp.MAX)
                for i, (p, some) in enumerate(zip(params, had.tolist(), strict=True)):
                    if some:
                        g = torch.zeros_like(p) if p.grad is None else p.grad
                        dist.all_reduce(g)
                        g = g / world_size
                        reduced[i] = g if reduced[i] is None else reduced[i] + g
                        p.grad = None
        for p, g in zip(params, reduced, strict=True):
            p.grad = g
        rec["grads"].append([_whole(p.grad) for p in params])
        optim.step()
        optim.zero_grad(set_to_none=cfg["set_to_none"][step])
        reduced = [p.grad for p in params]
        for p in params:
            p.grad = None
        _evaluate(cfg, model, step, rec)
    rec["params"] = [_whole(p) for p in params]
    return rec


def first_difference(a, b, path: str = "") -> str | None:
    """Where two records first differ (bits, dtype, shape, or a missing
    gradient), or None."""
    if isinstance(a, dict):
        for key in a:
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if a is None or b is None:
        if a is b:
            return None
        return f"{path}: None on the {'second' if a is not None else 'first'} side only"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not _equal(a, b):
        return f"{path}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}"
    return None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal elementwise, a NaN equal to a NaN (a run that diverged in both)."""
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def run_seed(world_size: int, rank: int, seed: int) -> dict:
    """One seed on this rank: where fsdp-rs differs from FSDP2, and (fp32 runs)
    where each differs from the reference; None where equal."""
    cfg = config(seed, world_size)
    fp32 = set(cfg["call_mp"]) == {"none"} and cfg["mp"] == "none"
    # FSDP2's reduction of unused parameters' zeros fails under mixed precision
    # ("expects uniform gradient dtype"): there fsdp-rs meets the reference only
    # (and older torch, 2.9, has no set_reduce_scatter_unused_params)
    alone = cfg["rank_branch"] and (
        not fp32 or not hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params")
    )
    # torch 2.9's FSDP2 casts to output_dtype the output of a call's last module
    # only; later ones (and fsdp-rs) cast every module's output
    multi_output_cast = (
        any(len(call) > 1 for call in cfg["calls"]) and "fp32_out_bf16" in (cfg["call_mp"])
    )
    alone = alone or (multi_output_cast and not _CASTS_EVERY_OUTPUT)
    libs = ("rs",) if alone else ("torch", "rs")
    records = {}
    for lib in libs:
        records[lib] = train(cfg, lib, rank)
        dist.barrier()
    out = {"vs_torch": None, "reference": False}
    if "torch" in records:
        out["vs_torch"] = first_difference(records["torch"], records["rs"])
    # gloo sums two values alike in any order, four by buffer size; a clipped
    # norm is summed over shards, not over the whole gradients
    # a divide factor or sums only change how the reduction rounds; so does a
    # block called twice with micro-steps without sync: FSDP2 (and fsdp-rs) reduce
    # what those accumulated at its first backward visit, apart from the last
    # visit's gradients ([Note: Partial gradients of a module called twice])
    divides = any(f is not None for f in cfg["divide"]) or cfg["force_sum"]
    unsynced = any(m > 1 and n for m, n in zip(cfg["micro"], cfg["nosync"], strict=True))
    apart = cfg["twice"] is not None and unsynced
    if world_size == 2 and fp32 and not cfg["clip"] and not divides and not apart:
        reference = train_reference(cfg, rank)
        out["reference"] = True
        out["rs_vs_reference"] = first_difference(reference, records["rs"])
        if "torch" in records:
            out["torch_vs_reference"] = first_difference(reference, records["torch"])
    return out


def run(world_size: int, rank: int, name: str) -> dict:
    result = run_seed(world_size, rank, int(name.removeprefix("seed")))
    dist.barrier()
    return result


if __name__ == "__main__":
    from spawned import run_seeds_cli

    names, ranks, world_size = run_seeds_cli(run, sys.argv)
    for name in names:
        results = [r[name] for r in ranks]
        if any(v for r in results for k, v in r.items() if k != "reference"):
            print(name, results, config(int(name.removeprefix("seed")), world_size))
    print(f"{len(names)} seeds run")
