"""torch's composable ``replicate`` over a model whose blocks fsdp-rs sharded
(FSDP2's HSDP by composition: ``fully_shard`` per block, then ``replicate`` on
the root) works as it does over FSDP2's blocks: replicate sees them as already
fully sharded ([Note: fsdp-rs in torch's composable registry] in
``runtime/api/composable.py``); and the other way round (``replicate`` per block,
then the root sharded: its ``fully_shard`` leaves the blocks out). Each
scenario trains the same model both ways in the same spawned gloo ranks and
compares the losses and the final full parameters bit for bit; the other
tests check the registry entries and the errors where torch's or fsdp-rs's API
meets the other library's module."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed._composable.replicate import replicate as ddp_replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_rs

sys.path.insert(0, str(Path(__file__).parent))
from spawned import gloo_worker, read_ranks, spawn_scenarios

try:
    from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
except ImportError:  # a torch without it
    fsdp_replicate = None

LIBS = {"rs": fsdp_rs.fully_shard, "torch": torch_fully_shard}
DIM, STEPS = 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Sharded blocks, and a projection of the root's own that replicate manages."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def train(world_size: int, rank: int, name: str) -> dict:
    """Per library: the losses, the names of the parameters replicate took and
    the final full parameters; the result says which of those differ."""
    kind, optim = SCENARIOS[name]
    if kind == "ddp_hsdp":  # each block HSDP over (2 replicas, 1 shard)
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    elif kind == "ddp_2x2":  # each block sharded over 2 ranks, the root replicated over 2
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:  # each block sharded over every rank
        mesh = init_device_mesh("cpu", (world_size,))
    block_mesh = mesh["shard"] if kind == "ddp_2x2" else mesh
    records = {}
    for lib, shard in LIBS.items():
        torch.manual_seed(0)
        model = Net()
        if kind == "replicated_blocks":  # the other way round: replicate per block, then
            for block in model.blocks:  # the root sharded, its call skipping the blocks
                fsdp_replicate(block)
            shard(model, mesh=mesh)
        else:
            for block in model.blocks:
                shard(block, mesh=block_mesh)
        if kind == "replicated_blocks":
            pass
        elif kind == "fsdp_replicate":
            fsdp_replicate(model)
        elif kind in ("ddp_hsdp", "ddp_2x2"):
            ddp_replicate(model, process_group=mesh["replicate"].get_group())
        else:
            ddp_replicate(model)
        assert all(isinstance(p, DTensor) for p in model.blocks.parameters())
        params = list(model.parameters())
        if optim == "adamw":
            opt = torch.optim.AdamW(params, lr=0.01, foreach=False)
        else:
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        losses = []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * rank + step)
            loss = model(torch.randn(4, DIM, generator=gen)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
            losses.append(loss.item())
        taken = None
        if kind not in ("fsdp_replicate", "replicated_blocks"):
            taken = list(ddp_replicate.state(model)._param_names)
        full = {n: _full(p) for n, p in model.named_parameters()}
        records[lib] = (losses, taken, full)
    (losses, taken, full), (ref_losses, ref_taken, ref_full) = records["rs"], records["torch"]
    return {
        "losses": [losses, ref_losses],
        "taken": [taken, ref_taken],
        "names": [list(full), list(ref_full)],
        "differ": [n for n in ref_full if n in full and not torch.equal(full[n], ref_full[n])],
    }


SCENARIOS = {
    "ddp_adamw": ("ddp", "adamw"),
    "ddp_hsdp_sgd": ("ddp_hsdp", "sgd"),
    "ddp_2x2_adamw": ("ddp_2x2", "adamw"),
}
if fsdp_replicate is not None:
    SCENARIOS["fsdp_replicate_adamw"] = ("fsdp_replicate", "adamw")
    SCENARIOS["replicated_blocks_sgd"] = ("replicated_blocks", "sgd")
W4 = ["ddp_2x2_adamw"]  # 4 ranks; the others run on 2
CASES = [pytest.param(4, n, id=f"W4-{n}") if n in W4 else (2, n) for n in SCENARIOS]


@pytest.fixture(scope="module")
def spawn(tmp_path_factory):
    """Per world size, once: each rank's results and the failure, if any."""
    done: dict[int, tuple] = {}

    def run(world_size: int) -> tuple:
        if world_size not in done:
            names = [n for n in SCENARIOS if (n in W4) == (world_size == 4)]
            out = tmp_path_factory.mktemp(f"replicate{world_size}")
            failure = None
            try:
                worker = functools.partial(gloo_worker, run=train)
                spawn_scenarios(worker, world_size, names, out, timeout_s=240)
            except Exception as e:
                failure = e
            done[world_size] = (read_ranks(out, world_size), failure)
        return done[world_size]

    return run


@pytest.mark.parametrize(("world_size", "name"), CASES)
def test_replicate_over_fsdp_rs_blocks_trains_as_over_fsdp2_blocks(spawn, world_size, name):
    per_rank, failure = spawn(world_size)
    for rank in range(world_size):
        r = per_rank[rank].get(name)
        assert r is not None, f"rank {rank}: {name} did not run ({failure})"
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["taken"][0] == r["taken"][1], f"rank {rank}: replicate took other parameters"
        assert r["names"][0] == r["names"][1], f"rank {rank}"
        assert r["losses"][0] == r["losses"][1], f"rank {rank}: losses differ"
        assert not r["differ"], f"rank {rank}: parameters differ: {r['differ']}"


def _sharded_blocks() -> Net:
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fsdp_rs.fully_shard(block)
    return model


def test_fsdp_rs_modules_are_in_torchs_registry(fake_pg) -> None:
    from torch.distributed._composable.replicate import _is_fully_sharded

    model = _sharded_blocks()
    assert all("fully_shard" in _get_registry(b) for b in model.blocks)
    assert _get_registry(model) is None
    assert all(_is_fully_sharded(b) for b in model.blocks)
    # one entry per call, shared by the modules of a list, as torch's contract
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    fsdp_rs.fully_shard([a, b])
    assert _get_registry(a)["fully_shard"] is _get_registry(b)["fully_shard"]


def test_replicate_refuses_an_fsdp_rs_module_as_it_refuses_fsdp2s(fake_pg) -> None:
    for replicate in (ddp_replicate, fsdp_replicate):
        if replicate is not None:
            model = _sharded_blocks()
            with pytest.raises(RuntimeError, match="already managed by `fully_shard`"):
                replicate(model.blocks[0])


def test_fsdp2_state_of_an_fsdp_rs_module_is_refused_by_name(fake_pg) -> None:
    # what torch reads (pipelining's stage on torch 2.13) finds an object that
    # raises on use, naming fsdp-rs, instead of None
    model = _sharded_blocks()
    state = torch_fully_shard.state(model.blocks[0])
    assert state is not None
    with pytest.raises(AssertionError, match="sharded by fsdp-rs's fully_shard"):
        state._comm_ctx  # noqa: B018
    with pytest.raises(AssertionError, match="sharded by fsdp-rs's fully_shard"):
        state._fsdp_param_groups  # noqa: B018
    # but for what torch < 2.15's pipeline stages read (test_finalize.py trains them)
    assert state._state_ctx.all_states == ()
    assert callable(state._root_post_backward_final_callback)
    assert torch_fully_shard.state(model) is None
    # fsdp-rs's fully_shard (in torch's place under the switch) answers as torch's
    assert fsdp_rs.fully_shard.state(model.blocks[0]) is state


def test_the_libraries_refuse_each_others_modules(fake_pg) -> None:
    model = _sharded_blocks()
    with pytest.raises(AssertionError, match="can only be applied to a module once"):
        torch_fully_shard(model.blocks[0])
    lin = nn.Linear(4, 4)
    torch_fully_shard(lin)
    with pytest.raises(AssertionError, match="torch's fully_shard"):
        fsdp_rs.fully_shard(lin)
    lin = nn.Linear(4, 4)
    ddp_replicate(lin)
    with pytest.raises(ValueError, match="torch's replicate"):
        fsdp_rs.fully_shard(lin)
    assert "fully_shard" not in _get_registry(lin)  # refused before registering
    dist.barrier()
