"""``reshard_after_forward=k`` on a DP mesh that is one slice of a larger mesh
(a TP column, a pipeline stage): the backward all-gathers over k-rank groups
give every slice its own gradients, bit for bit those of
``reshard_after_forward=True`` ([Note: Post-forward groups]).

Eight gloo ranks: DP 4 x TP 2, and 2 stages x DP 4; and a mesh over the
world after the user made groups some ranks are not in (4 and 8 ranks). Before the fix each slice
made its groups with ``new_group`` in its global form, whose rendezvous
connected ranks of different slices (sums across slices, or a hang). torch's
FSDP2 hangs making its post-forward mesh here (torch 2.13, measured), so the
reference is fsdp-rs's own ``reshard_after_forward=True``, which the N-D tests
hold to FSDP2's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_rs
from nd_scenarios import (
    BATCH,
    DIM,
    SEQ,
    _inputs,
    _mse,
    _nd_mesh,
    _net,
    _params,
    _tensor_parallel,
    _train,
)
from spawned import each_rank, results_fixture, run_named

WORLD = 8


@functools.cache
def _stage_mesh():
    return init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pp", "dp"))


def _stage_inputs(stage: int, dp: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * stage + 1000 * dp + step)
    return torch.randn(BATCH, SEQ, DIM, generator=gen)


def _trained(model, mesh, raf, batch, steps: int) -> dict:
    """``model`` sharded per block and at the root over ``mesh`` by fsdp-rs (FSDP2
    hangs where the mesh is a slice), trained: what ``_train`` observes, and the
    trained parameters."""
    for block in model.blocks:
        fsdp_rs.fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    fsdp_rs.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return {**_train(model, batch, _mse, steps), "params": _params(model)}


def sliced_dp(world_size: int, rank: int, slicing: str, steps: int = 2) -> dict:
    """Per ``reshard_after_forward`` (True, 2): losses, gradient norms, the last
    gradients and the trained parameters."""
    out = {}
    for raf in (True, 2):
        if slicing == "tp":
            mesh = _nd_mesh(world_size, 2)
            model = _tensor_parallel(_net(), mesh["tp"])
            batch = functools.partial(_inputs, mesh)
        else:  # pipeline stages: each stage trains a model of its own on its own data
            mesh = _stage_mesh()
            stage = mesh.get_coordinate()[0]
            model = _net(seed=stage)
            batch = functools.partial(_stage_inputs, stage, mesh["dp"].get_local_rank())
        out[str(raf)] = _trained(model, mesh["dp"], raf, batch, steps)
    return out


def after_uneven_groups(world_size: int, rank: int, steps: int = 2) -> dict:
    """The mesh spans the world, and the user made a group rank 0 alone is in
    first: each rank has made a different number of groups, which a name made
    from that number would not survive (the world's form names by a counter)."""
    dist.new_group([0])
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    batch = functools.partial(_stage_inputs, 0, rank)
    for raf in (True, 2):
        out[str(raf)] = _trained(_net(), mesh, raf, batch, steps)
    return out


SCENARIOS = {
    "tp_columns": (sliced_dp, {"slicing": "tp", "min_world": WORLD}),
    "pipeline_stages": (sliced_dp, {"slicing": "pp", "min_world": WORLD}),
    "after_uneven_groups": (after_uneven_groups, {"min_world": 4}),
}

results = results_fixture(SCENARIOS, functools.partial(run_named, SCENARIOS), (4, WORLD))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reshard_int_matches_reshard_true(results, name):
    for rank, r in each_rank(SCENARIOS, results, name):
        assert r["True"]["losses"] and r["True"]["grads"], rank
        assert r["2"] == r["True"], f"rank {rank}: reshard_after_forward=2 differs from True"
