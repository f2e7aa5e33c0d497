"""``fsdp_rs.clip_grad_norm_`` against torch's ``clip_grad_norm_`` ([Note:
Clipping over group buffers]): spawned gloo ranks (W = 2 and 4) train an MLP
with uneven layer widths (so the group buffers have padding) under fsdp-rs and
clip with fsdp-rs's function, next to the same model under torch FSDP2 clipped
with torch's, for three AdamW steps. Per step, fsdp-rs's total norm and clipped
gradients are compared with torch's ``get_total_norm`` / ``clip_grads_with_norm_``
on copies of the same gradients: the norm to relative 1e-6 (the same elements
summed in another order), the gradients to the same (a clip coefficient one
rounding apart); and losses with FSDP2 + torch's clip to 1e-6. Each scenario
also records how many gradients went through whole group buffers, so a test
cannot pass by falling back to the per-gradient path unnoticed.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_rs
from fsdp_rs.runtime.group.grad_buffers import sharded_grad_buffers

sys.path.insert(0, str(Path(__file__).parent))
from spawned import gloo_worker, read_ranks, spawn_scenarios

DIMS = (16, 33, 7, 13, 5)
STEPS = 3

SCENARIOS: dict[str, dict] = {
    "l2": {"norm": 2.0, "max_norm": 0.05},
    "l2_no_clip": {"norm": 2.0, "max_norm": 1e6},
    "l1": {"norm": 1.0, "max_norm": 0.1},
    "l3": {"norm": 3.0, "max_norm": 0.05},
    # torch's inf-norm fails on an empty local shard (W = 4 and a width of 5):
    # widths that leave every rank a row; misuse() covers the empty case
    "inf": {"norm": math.inf, "max_norm": 0.01, "dims": (16, 33, 7, 13, 7)},
    "bf16": {"norm": 2.0, "max_norm": 0.05, "mp": True},
    "no_reshard": {"norm": 2.0, "max_norm": 0.05, "reshard": False},
    # only the first two layers' parameters passed: a whole buffer and half of one
    "subset": {"norm": 2.0, "max_norm": 0.05, "subset": 3},
    # the user replaced one .grad: that group goes per gradient
    "replaced": {"norm": 2.0, "max_norm": 0.05, "replace": True},
    # ... on rank 0 only (as the rare path of a gradient some ranks lacked): the
    # ranks compute their parts differently and must still run the same collectives
    "replaced_on_rank_0": {"norm": 2.0, "max_norm": 0.05, "replace": True, "only_rank": 0},
    "hsdp": {"norm": 2.0, "max_norm": 0.05, "hsdp": True, "min_world": 4},
}


def _model(dims: tuple[int, ...] = DIMS) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _shard(model: nn.Sequential, fs, spec: dict, world_size: int) -> None:
    shape = (2, world_size // 2) if spec.get("hsdp") else (world_size,)
    names = ("replicate", "shard") if spec.get("hsdp") else None
    kwargs = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=names)}
    if spec.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if spec.get("reshard") is False:
        kwargs["reshard_after_forward"] = False
    for layer in model:
        if isinstance(layer, nn.Linear):
            fs(layer, **kwargs)
    fs(model, **kwargs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(world_size: int, rank: int, spec: dict) -> dict:
    dims = spec.get("dims", DIMS)
    rs_model, torch_model = _model(dims), _model(dims)
    _shard(rs_model, fsdp_rs.fully_shard, spec, world_size)
    _shard(torch_model, torch_fully_shard, spec, world_size)
    rs_opt = torch.optim.AdamW(rs_model.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    norm_type, max_norm = spec["norm"], spec["max_norm"]
    out: dict = {"norm_rel": [], "grad_rel": [], "whole": [], "losses": ([], [])}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, dims[0], generator=gen)
        for i, model in enumerate((rs_model, torch_model)):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            out["losses"][i].append(loss.item())
        params = list(rs_model.parameters())
        if spec.get("subset"):
            params = params[: spec["subset"]]
        if spec.get("replace") and spec.get("only_rank", rank) == rank:
            params[0].grad = params[0].grad.clone()
        grads = [p.grad for p in params]
        whole, _ = sharded_grad_buffers(grads)
        out["whole"].append(sum(len(b.grads) for b in whole))
        expected = [g.clone() for g in grads]
        expected_norm = torch.nn.utils.get_total_norm(expected, norm_type)
        holders = [types.SimpleNamespace(grad=e) for e in expected]  # torch's reads p.grad
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, expected_norm)
        out["torch_total_placements"] = str(getattr(expected_norm, "placements", None))
        norm = fsdp_rs.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        out["returns_dtensor"] = isinstance(norm, DTensor)
        out["norm_rel"].append(_rel(norm.full_tensor(), expected_norm.full_tensor()))
        out["grad_rel"].append(
            max(
                _rel(g.full_tensor(), e.full_tensor()) for g, e in zip(grads, expected, strict=True)
            )
        )
        torch_params = list(torch_model.parameters())[: len(params)]
        if spec.get("replace") and spec.get("only_rank", rank) == rank:
            torch_params[0].grad = torch_params[0].grad.clone()
        torch.nn.utils.clip_grad_norm_(torch_params, max_norm, norm_type=norm_type)
        for opt in (rs_opt, torch_opt):
            opt.step()
            opt.zero_grad()
    out["n_params"] = len(list(rs_model.parameters()))
    return out


def misuse(world_size: int, rank: int) -> dict:
    """Non-finite norms, no gradients, and plain tensors mixed in."""
    model = _model()
    _shard(model, fsdp_rs.fully_shard, {}, world_size)
    out = {"empty": fsdp_rs.clip_grad_norm_(model.parameters(), 1.0).item()}
    model(torch.randn(4, DIMS[0])).sum().backward()
    params = list(model.parameters())
    # the inf-norm where a rank's shard is empty (W = 4: 5 rows), which torch's fails on
    full = [p.grad.full_tensor() for p in params]
    norm = fsdp_rs.clip_grad_norm_(params, 1e6, norm_type=math.inf).full_tensor()
    out["inf_empty_shard"] = [norm.item(), max(g.abs().max().item() for g in full)]
    if rank == 0:  # one rank's gradient is inf: every rank sees a non-finite total
        params[0].grad._local_tensor.view(-1)[0] = math.inf
    try:
        fsdp_rs.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
        out["nonfinite_error"] = None
    except RuntimeError as e:
        out["nonfinite_error"] = str(e)
    expected = [p.grad.full_tensor() for p in params]
    holders = [types.SimpleNamespace(grad=e) for e in expected]
    torch.nn.utils.clip_grads_with_norm_(holders, 1.0, torch.nn.utils.get_total_norm(expected))
    norm = fsdp_rs.clip_grad_norm_(model, 1.0)
    out["nonfinite_norm"] = norm.full_tensor().item()
    # scaled by the non-finite norm anyway, as torch does
    out["nonfinite_grads_as_torch"] = all(
        torch.equal(p.grad.full_tensor().nan_to_num(), e.nan_to_num())
        for p, e in zip(params, expected, strict=True)
    )
    plain = torch.zeros(3, requires_grad=True)
    plain.grad = torch.ones(3)
    try:
        fsdp_rs.clip_grad_norm_([*params, plain], 1.0)
        out["mixed_error"] = None
    except RuntimeError as e:
        out["mixed_error"] = str(e)
    return out


def run_named(world_size: int, rank: int, name: str) -> dict:
    if name == "misuse":
        return misuse(world_size, rank)
    return run(world_size, rank, SCENARIOS[name])


@pytest.fixture(scope="module", params=(2, 4), ids=lambda w: f"W{w}")
def results(request, tmp_path_factory):
    world_size = request.param
    names = [n for n, s in SCENARIOS.items() if s.get("min_world", 2) <= world_size]
    out = tmp_path_factory.mktemp(f"clip{world_size}")
    worker = functools.partial(gloo_worker, run=run_named)
    spawn_scenarios(worker, world_size, [*names, "misuse"], out, timeout_s=300)
    return world_size, read_ranks(out, world_size)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_clip_grad_norm_as_torch(results, name):
    world_size, per_rank = results
    spec = SCENARIOS[name]
    if spec.get("min_world", 2) > world_size:
        pytest.skip(f"needs world size >= {spec['min_world']}")
    for rank, r in enumerate(per_rank):
        r = r[name]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["returns_dtensor"]
        assert max(r["norm_rel"]) <= 1e-6, f"rank {rank}: total norm differs: {r['norm_rel']}"
        # torch <= 2.9 returns the 2-norm as a Partial DTensor and adds clip_grads_with_norm_'s
        # 1e-6 to each rank's part, so its coefficient is off by about 1e-6 / norm
        partial = "Partial" in r["torch_total_placements"] and not math.isinf(spec["norm"])
        tol = 2e-5 if partial else 1e-6
        assert max(r["grad_rel"]) <= tol, f"rank {rank}: clipped grads differ: {r['grad_rel']}"
        rs_losses, torch_losses = r["losses"]
        torch.testing.assert_close(rs_losses, torch_losses, rtol=tol, atol=tol / 10)
        # which gradients took the O(groups) path (4 groups of 2 parameters)
        expected = r["n_params"]
        if name == "subset":
            expected = 2
        elif spec.get("replace") and spec.get("only_rank", rank) == rank:
            expected = r["n_params"] - 2
        assert r["whole"] == [expected] * STEPS, f"rank {rank}: {r['whole']}"


def test_clip_grad_norm_misuse(results):
    _, per_rank = results
    for rank, r in enumerate(per_rank):
        r = r["misuse"]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["empty"] == 0.0
        norm, expected = r["inf_empty_shard"]
        assert norm == expected, f"rank {rank}: inf-norm {norm} != {expected}"
        assert "non-finite" in r["nonfinite_error"], f"rank {rank}: {r['nonfinite_error']}"
        assert math.isinf(r["nonfinite_norm"]) or math.isnan(r["nonfinite_norm"])
        assert r["nonfinite_grads_as_torch"]
        assert "plain tensor" in r["mixed_error"], r["mixed_error"]
