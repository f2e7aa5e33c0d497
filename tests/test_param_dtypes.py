"""Parameters of any dtype, as FSDP2 shards them: frozen float8, integer, bool
and complex parameters next to float32 ones that train. Each scenario runs
under fsdp-rs and torch FSDP2 in the same spawned gloo ranks and compares what
the forward sees (dtype and bits of every unsharded parameter), the losses and
the final local shards, bit for bit (non-float shards as their raw bytes).
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_rs

sys.path.insert(0, str(Path(__file__).parent))
from spawned import finish, read_ranks, spawn_scenarios, write_results

LIBS = {"rs": fsdp_rs.fully_shard, "torch": torch_fully_shard}
DIM = 16


class Frozen(nn.Module):
    """A float32 linear layer that trains, next to frozen parameters of the
    dtypes under test: a float8 weight (the quantized base of a float8
    fine-tune), an int64 index table and a bool mask (registered as
    parameters, as some checkpoints do) and a complex64 rotation."""

    def __init__(self, dtypes: tuple[str, ...]) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        gen = torch.Generator().manual_seed(7)
        if "float8" in dtypes:
            w = torch.randn(DIM, DIM, generator=gen) / 4
            self.w8 = nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)
        if "int" in dtypes:
            perm = torch.randperm(DIM, generator=gen)
            self.index = nn.Parameter(perm, requires_grad=False)
        if "bool" in dtypes:
            self.mask = nn.Parameter(torch.rand(DIM, generator=gen) > 0.3, requires_grad=False)
        if "complex" in dtypes:
            angle = torch.rand(DIM, 2, generator=gen)
            self.rot = nn.Parameter(torch.polar(torch.ones_like(angle), angle), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if hasattr(self, "w8"):
            y = y + y @ self.w8.to(y.dtype)
        if hasattr(self, "index"):
            y = y[:, self.index]
        if hasattr(self, "mask"):
            y = y * self.mask.to(y.dtype)
        if hasattr(self, "rot"):
            y = y * self.rot.real.sum(-1).to(y.dtype)
        return torch.tanh(y)


def _raw(t: torch.Tensor) -> list[int]:
    """The bytes of ``t``: how a float8 or bool tensor is compared bit for bit."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.detach().contiguous().view(-1).view(torch.uint8).tolist()


def _record(seen: dict, prefix: int, module: nn.Module, args) -> None:
    """What a block's forward sees: each unsharded parameter's dtype and bytes."""
    for name, p in module.named_parameters(recurse=False):
        seen[f"{prefix}.{name}"] = (str(p.dtype), _raw(p))


def train(world_size: int, rank: int, dtypes: tuple[str, ...], mp: bool = False) -> dict:
    """Per library the losses, final shards and what the forward saw; under
    ``"rs_compiled"``, fsdp-rs compiled whole with ``fullgraph=True`` after
    ``set_fullgraph_compile()`` (aot_eager; its forward is not observed)."""
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for lib, shard in [*LIBS.items(), ("rs_compiled", fsdp_rs.fully_shard)]:
        torch.manual_seed(0)
        model = nn.Sequential(Frozen(dtypes), Frozen(dtypes))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
        try:
            for block in model:
                shard(block, mesh=mesh, mp_policy=policy)
            shard(model, mesh=mesh, mp_policy=policy)
        except RuntimeError as e:  # torch < 2.10 FSDP2 makes every shard require grad
            if lib == "rs":
                raise
            out[lib] = {"unsupported": str(e)}
            continue
        seen: dict[str, tuple[str, list[int]]] = {}
        run: nn.Module = model
        if lib == "rs_compiled":
            model.set_fullgraph_compile()
            torch._dynamo.reset()
            run = torch.compile(model, backend="aot_eager", fullgraph=True)
        else:
            for i, block in enumerate(model):
                block.register_forward_pre_hook(functools.partial(_record, seen, i))
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * rank + step)
            loss = run(torch.randn(4, DIM, generator=gen)).float().pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        shards = {n: (str(p.dtype), _raw(p)) for n, p in model.named_parameters()}
        out[lib] = {"losses": losses, "shards": shards, "seen": seen}
    return out


SCENARIOS = {
    "float8": {"dtypes": ("float8",)},
    "float8_bf16": {"dtypes": ("float8",), "mp": True},
    "int_bool_complex": {"dtypes": ("int", "bool", "complex")},
    "all_bf16": {"dtypes": ("float8", "int", "bool", "complex"), "mp": True},
}


def worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            results[name] = train(world_size, rank, **SCENARIOS[name])
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            write_results(out_dir, rank, results)
            raise
        dist.barrier()
    finish(out_dir, rank, results)


@pytest.fixture(scope="module", params=(2, 4), ids=lambda w: f"W{w}")
def results(request, tmp_path_factory):
    world_size = request.param
    out = tmp_path_factory.mktemp(f"dtypes{world_size}")
    failure = None
    try:
        spawn_scenarios(worker, world_size, list(SCENARIOS), out)
    except Exception as e:
        failure = e
    return world_size, read_ranks(out, world_size), failure


def _each_rank(results: tuple, name: str):
    """Each rank's result of scenario ``name`` as ``(rank, result)``; fails
    where a rank did not run it or raised."""
    world_size, per_rank, failure = results
    for rank in range(world_size):
        r = per_rank[rank].get(name)
        assert r is not None, f"rank {rank}: {name} did not run ({failure})"
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        yield rank, r


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_params_of_any_dtype_as_fsdp2(results, name):
    """fsdp-rs gathers each dtype as FSDP2 does (casting to ``param_dtype``
    where FSDP2 casts), so the forward sees the same tensors and training ends
    in the same shards."""
    for rank, r in _each_rank(results, name):
        rs, ref = r["rs"], r["torch"]
        if "unsupported" in ref:
            assert len(rs["losses"]) == 3 and all(map(math.isfinite, rs["losses"]))
            pytest.skip(f"torch {torch.__version__} FSDP2 cannot shard these: {ref['unsupported']}")
        assert rs["seen"].keys() == ref["seen"].keys()
        for key in ref["seen"]:
            assert rs["seen"][key] == ref["seen"][key], f"rank {rank}: forward saw {key} differ"
        assert rs["losses"] == ref["losses"], f"rank {rank}: losses differ"
        for key in ref["shards"]:
            assert rs["shards"][key] == ref["shards"][key], f"rank {rank}: shard {key} differs"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_params_of_any_dtype_under_fullgraph(results, name):
    """Compiled whole with the traced hooks, frozen groups of any dtype are
    all-gathered as raw bits, as in eager: losses and final shards equal eager
    fsdp-rs's bit for bit."""
    for rank, r in _each_rank(results, name):
        eager, compiled = r["rs"], r["rs_compiled"]
        assert compiled["losses"] == eager["losses"], f"rank {rank}: losses differ"
        assert compiled["shards"] == eager["shards"], f"rank {rank}: shards differ"
