"""``fsdp_rs.optim.FlatOptimizer`` against the same torch optimizer stepping the
sharded parameters one by one ([Note: Flat optimizer]), bit for bit.

Spawned gloo ranks (W = 2 and 4) train the same fsdp-rs model twice per
scenario, once with ``Optimizer(params, **kw)`` and once with
``FlatOptimizer(params, Optimizer, **kw)``, and compare the final shards, the
losses and the optimizer states bit for bit. The model has uneven widths (so
the group buffers have padding) and an ``extra`` layer inside each block that
runs on odd steps only: on even steps those parameters get no gradient, so the
runs split inside a group, the parameters' step counts diverge and torch's
skipping is what must be matched. Every scenario uses two user parameter
groups (biases with another learning rate and no weight decay), a
``LambdaLR`` schedule, and, where named, ``zero_grad(set_to_none=False)``,
bf16 mixed precision, HSDP (W = 4), CPU offload, frozen parameters (also one
frozen between a backward and the step) and an ignored (plain) parameter. The
``*_resume`` scenarios also hand a checkpoint over mid-way: ``state_dict()`` of
one kind loaded into the other, both ways; the ``*_scaler`` ones step through
``torch.amp.GradScaler`` with an inf in one rank's gradient at one step.
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_rs
from fsdp_rs.optim import FlatOptimizer

sys.path.insert(0, str(Path(__file__).parent))
from spawned import gloo_worker, read_ranks, spawn_scenarios

OPT = torch.optim
STEPS = 5
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd": (OPT.SGD, {"lr": 0.05}),
    "sgd_momentum": (
        OPT.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    "adam": (OPT.Adam, {"lr": 1e-2}),
    "adam_amsgrad_maximize": (
        OPT.Adam,
        {"lr": 1e-2, "amsgrad": True, "maximize": True, "weight_decay": 0.01},
    ),
    "adamw": (OPT.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_foreach": (OPT.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adamw_fused": (OPT.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "adam_fused": (OPT.Adam, {"lr": 1e-2, "fused": True}),
    "adagrad": (OPT.Adagrad, {"lr": 1e-2, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    "rmsprop": (OPT.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    "adamax": (OPT.Adamax, {"lr": 1e-2}),
    "nadam": (OPT.NAdam, {"lr": 1e-2, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    "radam": (OPT.RAdam, {"lr": 1e-2}),
    "adadelta": (OPT.Adadelta, {"lr": 0.5}),
    "asgd": (OPT.ASGD, {"lr": 1e-2}),
}
# CPU fused Adam rounds its vectorized body and scalar tail differently, so an
# element's bits depend on its position in the tensor (DESIGN.md, measured facts):
# compared to rounding there, bit for bit everywhere else. (Fused SGD has no DTensor
# sharding rule in torch: no per-parameter reference to compare with.)
NOT_SPLIT_INVARIANT = {"adam_fused"}
SCENARIOS: dict[str, dict] = {
    name: {"optim": name, "close": name in NOT_SPLIT_INVARIANT} for name in OPTIMIZERS
}
SCENARIOS.update(
    {
        "adamw_keep_grads": {"optim": "adamw_foreach", "set_to_none": False},
        "adamw_bf16": {"optim": "adamw", "mp": True},
        "adamw_offload": {"optim": "adamw", "offload": True},
        "adamw_ignored": {"optim": "adamw", "ignored": True},
        "adamw_frozen": {"optim": "adamw_foreach", "frozen": True},
        "adamw_hsdp": {"optim": "adamw", "hsdp": True, "min_world": 4},
        # frozen between its backward and the step: torch still steps its .grad
        "adamw_frozen_after_backward": {"optim": "adamw_foreach", "freeze_at": 2},
        "adamw_resume": {"optim": "adamw", "resume": True},
        "sgd_momentum_resume": {"optim": "sgd_momentum", "resume": True},
        "adagrad_resume": {"optim": "adagrad", "resume": True},
        # the hand-over through torch.distributed.checkpoint: get_/set_optimizer_state_dict
        # and dcp.save / dcp.load of a directory
        "adamw_resume_dcp": {"optim": "adamw", "resume": True, "dcp": True},
        # torch.amp.GradScaler, an inf in one rank's gradient at step INF_AT:
        # fused steps take the scale and the flag from it ([Note: Gradient scaling])
        "adamw_fused_scaler": {"optim": "adamw_fused", "scaler": True},
        "adam_fused_scaler": {"optim": "adam_fused", "scaler": True, "close": True},
        "adamw_foreach_scaler": {"optim": "adamw_foreach", "scaler": True},
        # the optimizer holds some of each group's parameters, another one the
        # rest: states for its own only ([Note: Flat state layout])
        "adamw_split": {"optim": "adamw", "split": True},
        "adamw_split_resume": {"optim": "adamw", "split": True, "resume": True},
        "adagrad_split": {"optim": "adagrad", "split": True},
    }
)
INF_AT = 2
DIMS = (16, 33, 7, 13, 5)


class Block(nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.lin = nn.Linear(a, b)
        self.extra = nn.Linear(b, b)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y + self.extra(y) if use_extra else y


class Model(nn.Module):
    def __init__(self, ignored: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(a, b) for a, b in itertools.pairwise(DIMS))
        self.scale = nn.Parameter(torch.ones(DIMS[-1])) if ignored else None

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, use_extra=step % 2 == 1)
        return x * self.scale if self.scale is not None else x


def _model(spec: dict, world_size: int) -> Model:
    torch.manual_seed(0)
    model = Model(spec.get("ignored", False))
    if spec.get("frozen"):  # frozen parameters between trainable ones in a group
        model.blocks[1].lin.weight.requires_grad_(False)
        model.blocks[2].extra.bias.requires_grad_(False)
    shape = (2, world_size // 2) if spec.get("hsdp") else (world_size,)
    names = ("replicate", "shard") if spec.get("hsdp") else None
    kwargs: dict = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=names)}
    if spec.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if spec.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fsdp_rs.fully_shard(block, **kwargs)
    ignored = {model.scale} if model.scale is not None else None
    fsdp_rs.fully_shard(model, ignored_params=ignored, **kwargs)
    return model


def _param_groups(model: nn.Module, kwargs: dict) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    second = {"params": biases, "lr": kwargs["lr"] * 2}
    if "weight_decay" in kwargs:
        second["weight_decay"] = 0.0
    return [{"params": weights}, second]


def _optimizer(model: nn.Module, name: str, flat: bool, split: bool = False):
    """``split``: it holds the ``lin`` layers only (``_second_optimizer`` the rest)."""
    cls, kwargs = OPTIMIZERS[name]
    groups = _param_groups(model, kwargs)
    if split:
        held = {id(p) for n, p in model.named_parameters() if ".lin." in n}
        groups = [{**g, "params": [p for p in g["params"] if id(p) in held]} for g in groups]
    return FlatOptimizer(groups, cls, **kwargs) if flat else cls(groups, **kwargs)


def _second_optimizer(model: nn.Module):
    """What a split leaves to another optimizer (as Muon takes the matrices)."""
    rest = [p for n, p in model.named_parameters() if ".lin." not in n]
    return torch.optim.SGD(rest, lr=0.05, momentum=0.9)


def _state_bytes(opt) -> tuple[int, int]:
    """(bytes of the optimizer's elementwise states, bytes a per-parameter optimizer
    would hold plus the flat layout's padding bound: per state, 16 elements a
    block and up to 16 between parameters, where the rows align them to 16 bytes)."""
    per_param = pad = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                local = v._local_tensor if isinstance(v, DTensor) else v
                per_param += local.numel() * local.element_size()
                pad += 32 * local.element_size()
    if not isinstance(opt, FlatOptimizer):
        return per_param, per_param
    flat = sum(
        f.numel() * f.element_size() for gs in opt._groups.values() for f in gs.flat.values()
    )
    return flat, per_param + pad


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _state(opt) -> dict:
    """The optimizer state dict with full tensors, as lists (JSON)."""
    sd = opt.state_dict()
    out = {}
    for idx, st in sd["state"].items():
        out[str(idx)] = {k: _full(v).tolist() if torch.is_tensor(v) else v for k, v in st.items()}
    return out


def _dcp_handover(model: nn.Module, old, new, flat: bool, ckpt: Path):
    """Save ``old``'s state with DCP and load it into ``new``, as a trainer does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    path = ckpt / ("from_flat" if flat else "from_per_param")
    dcp.save({"optim": get_optimizer_state_dict(model, old)}, checkpoint_id=str(path))
    for group in new.param_groups:  # a key DCP fills only where the target has it
        group["initial_lr"] = None
    target = {"optim": get_optimizer_state_dict(model, new)}
    dcp.load(target, checkpoint_id=str(path))
    set_optimizer_state_dict(model, new, target["optim"])
    return new


def train(
    world_size: int,
    rank: int,
    spec: dict,
    flat: bool,
    switch_at: int | None,
    ckpt: Path | None = None,
) -> dict:
    """``flat``: the optimizer's kind before ``switch_at`` (the other one after,
    loaded from its ``state_dict``)."""
    model = _model(spec, world_size)
    name = spec["optim"]
    split = spec.get("split", False)
    opt = _optimizer(model, name, flat, split)
    second = _second_optimizer(model) if split else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    losses, states, scales = [], {}, []
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        if spec.get("scaler")
        else None
    )
    for step in range(STEPS):
        if step == switch_at and spec.get("dcp"):
            opt = _dcp_handover(model, opt, _optimizer(model, name, not flat, split), flat, ckpt)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s, last_epoch=step - 1)
        elif step == switch_at:
            sd = opt.state_dict()
            opt = _optimizer(model, name, not flat, split)
            opt.load_state_dict(sd)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s, last_epoch=step - 1)
        gen = torch.Generator().manual_seed(100 * rank + step)
        loss = model(torch.randn(8, DIMS[0], generator=gen), step).float().pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if step == spec.get("freeze_at"):
            model.blocks[1].lin.weight.requires_grad_(False)
        if scaler is None:
            opt.step()
        else:
            if step == INF_AT and rank == 1:
                model.blocks[0].lin.weight.grad._local_tensor.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        sched.step()
        opt.zero_grad(set_to_none=spec.get("set_to_none", True))
        if second is not None:
            second.step()
            second.zero_grad()
        losses.append(loss.item())
        if step == 2:
            states["mid"] = _state(opt)
    states["end"] = _state(opt)
    params = {n: _full(p.detach()).tolist() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "states": states,
        "scales": scales,
        "state_bytes": _state_bytes(opt),
    }


def run(world_size: int, rank: int, spec: dict, ckpt: Path) -> dict:
    out = {
        "per_param": train(world_size, rank, spec, flat=False, switch_at=None),
        "flat": train(world_size, rank, spec, flat=True, switch_at=None),
    }
    if spec.get("resume"):
        out["flat_then_per_param"] = train(world_size, rank, spec, True, 3, ckpt)
        out["per_param_then_flat"] = train(world_size, rank, spec, False, 3, ckpt)
    return out


def run_named(world_size: int, rank: int, name: str, out_dir: str) -> dict:
    return run(world_size, rank, SCENARIOS[name], Path(out_dir) / "ckpt" / name)


@pytest.fixture(scope="module", params=(2, 4), ids=lambda w: f"W{w}")
def results(request, tmp_path_factory):
    world_size = request.param
    names = [n for n, s in SCENARIOS.items() if s.get("min_world", 2) <= world_size]
    out = tmp_path_factory.mktemp(f"flat{world_size}")
    run_here = functools.partial(run_named, out_dir=str(out))  # DCP checkpoints go there
    spawn_scenarios(functools.partial(gloo_worker, run=run_here), world_size, names, out, 600)
    return world_size, read_ranks(out, world_size)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flat_optimizer_bitwise_as_per_parameter(results, name):
    world_size, per_rank = results
    spec = SCENARIOS[name]
    if spec.get("min_world", 2) > world_size:
        pytest.skip(f"needs world size >= {spec['min_world']}")
    for rank, r in enumerate(per_rank):
        r = r[name]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        ref = r["per_param"]
        runs = ["flat", "flat_then_per_param", "per_param_then_flat"]
        for run_name in [k for k in runs if k in r]:
            got = r[run_name]
            if spec.get("close"):
                close = {"rtol": 1e-6, "atol": 1e-7}
                torch.testing.assert_close(got["losses"], ref["losses"], **close)
                torch.testing.assert_close(got["params"], ref["params"], **close)
                torch.testing.assert_close(got["states"], ref["states"], **close)
                continue
            assert got["losses"] == ref["losses"], f"rank {rank} {run_name}: losses differ"
            for n in ref["params"]:
                assert got["params"][n] == ref["params"][n], f"rank {rank} {run_name}: {n}"
            for when in ("mid", "end"):
                assert got["states"][when] == ref["states"][when], (
                    f"rank {rank} {run_name}: optimizer state ({when}) differs"
                )
        # the run trained: the parameters moved and the state is not empty
        assert ref["losses"][0] != ref["losses"][-1]
        # no more state memory than the per-parameter optimizer (and its padding)
        held, bound = r["flat"]["state_bytes"]
        assert held <= bound, f"rank {rank}: flat states {held} B > {bound} B"
        if spec.get("scaler"):  # the inf was found: the scale backed off, on every rank
            assert ref["scales"][INF_AT] == ref["scales"][INF_AT - 1] / 2, ref["scales"]
            for run_name in [k for k in runs if k in r]:
                assert r[run_name]["scales"] == ref["scales"], f"rank {rank} {run_name}"


def test_non_elementwise_optimizers_are_refused():
    params = [nn.Parameter(torch.zeros(3))]
    refused = [OPT.LBFGS, OPT.SparseAdam, OPT.Rprop]
    refused += [getattr(OPT, n) for n in ("Adafactor", "Muon") if hasattr(OPT, n)]
    for cls in refused:
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(model.parameters\(\)"):
            FlatOptimizer(params, cls, lr=0.1)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer class"):
        FlatOptimizer(params, "adam", lr=0.1)


def test_is_a_torch_optimizer_with_torchs_validation():
    params = [nn.Parameter(torch.zeros(3))]
    opt = FlatOptimizer(params, OPT.AdamW, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults == OPT.AdamW(params, lr=0.1).defaults
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FlatOptimizer(params, OPT.AdamW, lr=-1.0)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    params[0].grad = torch.ones(3)
    opt.step()
    assert calls == ["pre", "post"]
    assert not torch.equal(params[0].detach(), torch.zeros(3))  # a plain parameter steps too
