"""Per-parameter ``grad_dtype`` ([Note: Gradient dtype policy]): bf16 weights
whose gradients accumulate, reduce and stay in fp32, fp32 weights with bf16
gradients, ``grad_dtype=None`` under an explicit ``reduce_dtype``. Each scenario
trains the same model under fsdp-rs and torch FSDP2 in the same spawned gloo
ranks (W = 4, where a sum of four bf16 values rounds differently from one in
fp32; under TP, 2 x 2) and compares, after every step, each sharded gradient's dtype and bytes,
the losses and the final shards, bit for bit. On a torch whose FSDP2 drops
``grad_dtype`` (before 2.15), fsdp-rs refuses it instead.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_rs
from fsdp_rs.optim import FlatOptimizer
from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy
from fsdp_rs.runtime.group.grad_dtypes import adopt_grad_dtypes
from fsdp_rs.runtime.group.params import state_of

sys.path.insert(0, str(Path(__file__).parent))
from spawned import gloo_worker, read_ranks, spawn_scenarios

LIBS = {"rs": fsdp_rs.fully_shard, "torch": torch_fully_shard}
DIM = 24
STEPS = 3
HAS_POLICY = fsdp2_has_grad_dtype_policy()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _set(model: nn.Module, which: str, grad_dtype) -> None:
    """``grad_dtype`` on the parameters ``which`` names: "weights" (every
    Linear weight), "first" (the first block's) or "all"."""
    for name, p in model.named_parameters():
        chosen = {
            "all": True,
            "weights": name.endswith("weight"),
            "first": name.startswith("0."),
        }[which]
        if chosen:
            p.grad_dtype = grad_dtype


def _raw(t: torch.Tensor) -> list[int]:
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.detach().contiguous().view(-1).view(torch.uint8).tolist()


def _grads(model: nn.Module, values=_raw) -> dict:
    """Each sharded gradient's dtype and ``values`` (its bytes by default)."""
    return {n: (str(p.grad.dtype), values(p.grad)) for n, p in model.named_parameters()}


def _finished(model: nn.Module, steps: list, values=_raw) -> dict:
    """A library's record: ``steps``, the parameters' ``grad_dtype``, the shards."""
    return {
        "steps": steps,
        "grad_dtypes": {n: str(p.grad_dtype) for n, p in model.named_parameters()},
        "shards": {n: values(p) for n, p in model.named_parameters()},
    }


def train(
    world_size: int,
    rank: int,
    dtype: str,
    grads: list[tuple[str, str | None]],
    mp: tuple[str | None, str | None] = (None, None),
    micro: int = 1,
    reshard: bool = True,
    offload: bool = False,
    hsdp: bool = False,
    flat: bool = False,
    after: bool = False,
) -> dict:
    """Per library: per step the loss and every sharded gradient (dtype, bytes),
    the parameters' ``grad_dtype``, and the final shards. ``grads``: which
    parameters set which ``grad_dtype`` (a dtype name or None); ``micro``
    micro-batches per step, all but the last without gradient sync; ``hsdp``:
    2 replicas of ``world_size // 2`` shards; ``flat``: SGD with momentum
    (fsdp-rs's through ``FlatOptimizer``) instead of a plain update; ``after``:
    ``grad_dtype`` set on the sharded parameters, after ``fully_shard`` and
    before the first forward (FSDP2 reads it at lazy init)."""
    shape, names = ((2, world_size // 2), ("replicate", "shard")) if hsdp else ((world_size,), None)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    param_dtype, reduce_dtype = (None if d is None else getattr(torch, d) for d in mp)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": reshard}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    out = {}
    for lib, shard in LIBS.items():
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block()).to(getattr(torch, dtype))
        settings = [(which, name and getattr(torch, name)) for which, name in grads]
        for which, grad_dtype in [] if after else settings:
            _set(model, which, grad_dtype)
        for block in model:
            shard(block, **kwargs)
        shard(model, **kwargs)
        for which, grad_dtype in settings if after else []:  # on the sharded parameters
            _set(model, which, grad_dtype)
        opt = None
        if flat:  # fsdp-rs's FlatOptimizer against torch's SGD on FSDP2
            params, kw = list(model.parameters()), {"lr": 0.05, "momentum": 0.9}
            sgd = torch.optim.SGD
            opt = FlatOptimizer(params, sgd, **kw) if lib == "rs" else sgd(params, **kw)
        steps = []
        for step in range(STEPS):
            losses = []
            for m in range(micro):
                model.set_requires_gradient_sync(m == micro - 1)
                gen = torch.Generator().manual_seed(1000 * rank + 10 * step + m)
                x = torch.randn(3, DIM, generator=gen).to(getattr(torch, dtype))
                loss = model(x).float().pow(2).mean()
                loss.backward()
                losses.append(loss.item())
            grads_now = _grads(model)
            if opt is not None:
                opt.step()
            else:
                with torch.no_grad():  # torch's AdamW refuses mixed dtypes: plain SGD
                    for p in model.parameters():
                        p.add_(p.grad.to(p.dtype), alpha=-0.05)
            model.zero_grad(set_to_none=step % 2 == 0)
            steps.append({"losses": losses, "grads": grads_now})
        out[lib] = _finished(model, steps)
    return out


def train_tp(world_size: int, rank: int, which: str) -> dict:
    """``train``'s records for ``nd_scenarios``' net in bf16 under TP (2 ranks,
    sequence-parallel norms, whose gradients are reduced over TP first) and
    FSDP over the other dim, the parameters named with ``which`` set to fp32
    gradients (after TP: ``parallelize_module`` makes new parameters)."""
    import nd_scenarios as nd

    mesh = nd._nd_mesh(world_size, 2)
    out = {}
    for lib in LIBS:
        model = nd._tensor_parallel(nd._net().bfloat16(), mesh["tp"], True)
        for name, p in model.named_parameters():
            if which in name:
                p.grad_dtype = torch.float32
        nd._fully_shard(lib, model, nd._dp_mesh(mesh))
        steps = []
        for step in range(STEPS):
            loss = model(nd._inputs(mesh, step, True).bfloat16()).float().pow(2).mean()
            loss.backward()
            grads = _grads(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad.to(p.dtype), alpha=-0.05)
            model.zero_grad()
            steps.append({"losses": [loss.item()], "grads": grads})
        out[lib] = _finished(model, steps)
    return out


def train_extension(world_size: int, rank: int, kind: str, grad_dtype: str) -> dict:
    """``train``'s records (values as exact doubles) for ``extension_scenarios``'
    MLP whose weights are all-gather extension subclasses of ``kind`` with
    ``grad_dtype``: two backwards per step, the first without sync."""
    import extension_scenarios as ext

    out = {}
    for lib in LIBS:
        wrap, model_kwargs = ext._subclass(kind, {})
        model = ext._model(wrap, **model_kwargs)
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                p.grad_dtype = getattr(torch, grad_dtype)
        ext._shard(lib, model, ext._mesh(world_size, False))
        steps = []
        for step in range(STEPS):
            losses = []
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                loss = model(ext._inputs(rank, step, micro)).sum()
                loss.backward()
                losses.append(loss.item())
            grads = _grads(model, ext._values)
            model.zero_grad()
            steps.append({"losses": losses, "grads": grads})
        out[lib] = _finished(model, steps, ext._values)
    return out


FP32, BF16 = "float32", "bfloat16"
SCENARIOS = {
    # some bf16 weights with fp32 gradients: the group reduces in fp32 (promoted)
    "bf16_weights_fp32": {"dtype": BF16, "grads": [("weights", FP32)]},
    "bf16_all_fp32": {"dtype": BF16, "grads": [("all", FP32)]},
    "bf16_first_fp32_no_sync": {"dtype": BF16, "grads": [("first", FP32)], "micro": 3},
    "bf16_weights_fp32_keep": {"dtype": BF16, "grads": [("weights", FP32)], "reshard": False},
    "bf16_weights_fp32_offload": {"dtype": BF16, "grads": [("weights", FP32)], "offload": True},
    "bf16_weights_fp32_hsdp_no_sync": {
        "dtype": BF16,
        "grads": [("weights", FP32)],
        "hsdp": True,
        "micro": 2,
    },
    # the bf16 gradients stepped flat, the fp32 ones per parameter, as torch steps them
    "bf16_weights_fp32_flat_sgd": {"dtype": BF16, "grads": [("weights", FP32)], "flat": True},
    # fp32 weights with bf16 gradients: autograd casts to bf16 on accumulation
    "fp32_weights_bf16_no_sync": {"dtype": FP32, "grads": [("weights", BF16)], "micro": 2},
    # fp32 parameters computed in bf16, fp32 gradients set explicitly
    "mp_bf16_grads_fp32": {"dtype": FP32, "grads": [("all", FP32)], "mp": (BF16, None)},
    # an explicit reduce_dtype decides the reduction and the accumulation
    "bf16_fp32_grads_reduce_bf16": {
        "dtype": BF16,
        "grads": [("weights", FP32)],
        "mp": (None, BF16),
        "micro": 2,
    },
    # set after fully_shard, before the first forward: the first block's group
    # takes fp32 gradients; fp32 parameters' groups take bf16 ones, which
    # changes their row alignment (the shards move to a new buffer)
    "after_shard_first_fp32": {"dtype": BF16, "grads": [("first", FP32)], "after": True},
    "after_shard_all_bf16_relayout": {"dtype": FP32, "grads": [("all", BF16)], "after": True},
    # grad_dtype=None: the sharded gradients stay in the reduce dtype
    "none_reduce_fp32": {"dtype": BF16, "grads": [("first", None)], "mp": (None, FP32)},
}


# [Note: DTensor parameters] with grad_dtype: sequence-parallel norms, weights
TP_SCENARIOS = {"tp_norms_fp32": "norm", "tp_weights_fp32": "weight"}
# [Note: All-gather extensions] with grad_dtype: fp32 weights gathered in bf16
# with bf16 gradients (narrower: set on the unsharded parameters for good), and
# pairs of fp32 copies with fp64 gradients
EXTENSION_SCENARIOS = {
    "ext_bf16_gathered_bf16": ("bf16", BF16),
    "ext_pair_fp64": ("pair_v2", "float64"),
}


def run_named(world_size: int, rank: int, name: str) -> dict:
    if name in EXTENSION_SCENARIOS:
        return train_extension(world_size, rank, *EXTENSION_SCENARIOS[name])
    if name in TP_SCENARIOS:
        return train_tp(world_size, rank, TP_SCENARIOS[name])
    return train(world_size, rank, **SCENARIOS[name])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not HAS_POLICY:
        pytest.skip(f"torch {torch.__version__}'s FSDP2 has no grad_dtype policy")
    world_size = 4
    out = tmp_path_factory.mktemp("grad_dtypes")
    failure = None
    try:
        worker = functools.partial(gloo_worker, run=run_named)
        spawn_scenarios(
            worker,
            world_size,
            [*SCENARIOS, *TP_SCENARIOS, *EXTENSION_SCENARIOS],
            out,
            timeout_s=300,
        )
    except Exception as e:
        failure = e
    return world_size, read_ranks(out, world_size), failure


@pytest.mark.parametrize("name", [*SCENARIOS, *TP_SCENARIOS, *EXTENSION_SCENARIOS])
def test_grad_dtype_as_fsdp2(results, name):
    """Every step's sharded gradients (dtype and bits), the losses, the sharded
    parameters' ``grad_dtype`` and the final shards equal FSDP2's."""
    world_size, per_rank, failure = results
    for rank in range(world_size):
        r = per_rank[rank].get(name)
        assert r is not None, f"rank {rank}: {name} did not run ({failure})"
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        rs, ref = r["rs"], r["torch"]
        assert rs["grad_dtypes"] == ref["grad_dtypes"], f"rank {rank}"
        for step, (a, b) in enumerate(zip(rs["steps"], ref["steps"], strict=True)):
            assert a["losses"] == b["losses"], f"rank {rank} step {step}: losses differ"
            for key, (dtype, raw) in b["grads"].items():
                assert a["grads"][key][0] == dtype, f"rank {rank} step {step}: {key} dtype"
                assert a["grads"][key][1] == raw, f"rank {rank} step {step}: {key} grad differs"
        assert rs["shards"] == ref["shards"], f"rank {rank}: shards differ"


@pytest.fixture
def fake2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


def _lin(dtype=torch.bfloat16) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 8).to(dtype)


@pytest.mark.skipif(HAS_POLICY, reason="this torch's FSDP2 keeps grad_dtype")
@pytest.mark.skipif(not hasattr(torch.empty(0), "grad_dtype"), reason="no grad_dtype here")
def test_grad_dtype_refused_where_fsdp2_drops_it(fake2):
    """Before torch 2.15 FSDP2 drops a ``grad_dtype`` other than the dtype;
    fsdp-rs refuses it, naming the parameter. Equal to the dtype it is kept."""
    lin = _lin()
    lin.bias.grad_dtype = torch.float32
    with pytest.raises(ValueError, match=r"parameter bias has grad_dtype torch\.float32"):
        fsdp_rs.fully_shard(lin)
    lin.bias.grad_dtype = torch.bfloat16
    fsdp_rs.fully_shard(lin)
    assert lin.bias.grad_dtype == torch.bfloat16


@pytest.mark.skipif(not HAS_POLICY, reason="this torch's FSDP2 drops grad_dtype")
def test_grad_dtype_none_needs_reduce_dtype(fake2):
    """``grad_dtype=None`` on a trainable parameter without ``reduce_dtype``:
    the reduce dtype would follow each rank's gradients, so fsdp-rs refuses,
    naming the parameter and the fix. Frozen, or with ``reduce_dtype``, it is
    taken, and the sharded parameter keeps it."""
    lin = _lin()
    lin.weight.grad_dtype = None
    with pytest.raises(ValueError, match=r"weight has grad_dtype None.*reduce_dtype"):
        fsdp_rs.fully_shard(lin)
    lin.weight.requires_grad_(False)
    fsdp_rs.fully_shard(lin)
    assert lin.weight.grad_dtype is None
    other = _lin()
    other.weight.grad_dtype = None
    fsdp_rs.fully_shard(other, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    assert other.weight.grad_dtype is None and other.bias.grad_dtype == torch.bfloat16


@pytest.mark.skipif(not HAS_POLICY, reason="this torch's FSDP2 drops grad_dtype")
def test_grad_dtype_kept_on_sharded_params(fake2):
    """The sharded parameters keep the setting, as FSDP2's do, and those without
    one keep none."""
    lin = _lin()
    lin.weight.grad_dtype = torch.float32
    fsdp_rs.fully_shard(lin)
    assert lin.weight.grad_dtype == torch.float32 and lin.weight._has_grad_dtype_override
    assert lin.bias.grad_dtype == torch.bfloat16 and not lin.bias._has_grad_dtype_override


@pytest.mark.skipif(not HAS_POLICY, reason="this torch's FSDP2 drops grad_dtype")
def test_grad_dtype_set_after_fully_shard_unlike_in_a_group_refused(fake2):
    """Set after ``fully_shard`` on some parameters of a group and not the
    others: fsdp-rs would have to split the group, so the first forward raises,
    naming the parameters and the fix, before any collective."""
    lin = _lin()
    fsdp_rs.fully_shard(lin)
    lin.weight.grad_dtype = torch.float32
    with pytest.raises(ValueError, match=r"after fully_shard on some of the parameters weight"):
        lin(torch.randn(2, 8, dtype=torch.bfloat16))


@pytest.mark.skipif(not HAS_POLICY, reason="this torch's FSDP2 drops grad_dtype")
def test_grad_dtype_set_after_fully_shard_read_by_unshard(fake2):
    """FSDP2 reads ``grad_dtype`` at lazy init, which ``unshard()`` starts too:
    set after ``fully_shard``, it holds for an explicit first unshard, and a
    change after that raises instead of failing in the backward."""
    lin = _lin()
    fsdp_rs.fully_shard(lin)
    lin.weight.grad_dtype = lin.bias.grad_dtype = torch.float32
    lin.unshard()
    lin(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    assert lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32
    other = _lin()
    fsdp_rs.fully_shard(other)
    other(torch.randn(2, 8, dtype=torch.bfloat16))  # unsharded: too late to change
    other.reshard()  # the sharded parameters registered again
    other.weight.grad_dtype = other.bias.grad_dtype = torch.float32
    with pytest.raises(ValueError, match="after they were unsharded"):
        adopt_grad_dtypes(state_of(other).group)
