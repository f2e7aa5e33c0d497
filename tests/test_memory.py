"""Memory per phase of a training step, fsdp-rs against torch FSDP2 on the same
model in one process (fake process group, MemTracker on CPU): fsdp-rs may hold
no more than FSDP2 (+1% or +1 MiB, whichever is larger) at any phase, the
backward peak included ([Note: Reduction memory]), both as on CPU and with an
accelerator's streams simulated (``stream_sim``), where tensors used across
streams live longer ([Note: Cross-stream lifetimes])."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_rs.bench.memory import CONFIGS, PHASES, measure
from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy

sys.path.insert(0, str(Path(__file__).parent))
from stream_sim import simulated_streams

MiB = 2**20

# The README's sizes: a layer (4 MiB unsharded in fp32) is well above the
# tolerance, so holding one layer's buffer more than FSDP2 anywhere fails.
SIZES = {"dim": 1024, "layers": 4, "batch": 32, "steps": 2}

# Combinations the bench does not run by name, measured the same way.
EXTRA = {
    "bf16_accumulate_4_no_sync": (2, {"mp": True, "micro": 4}),
    "reshard_2_bf16": (4, {"reshard_after_forward": 2, "mp": True}),
    "no_reshard_accumulate_4_no_sync": (2, {"reshard_after_forward": False, "micro": 4}),
    "hsdp_accumulate_4_no_sync": (4, {"hsdp": True, "micro": 4}),
    # [Note: Manual backward finalization]: every micro-step without sync, then
    # finalize_backward() reduces (FSDP2's needs torch >= 2.15)
    "manual_accumulate_4": (2, {"micro": 4, "manual": True}),
    # parameters that keep gradients of another dtype ([Note: Gradient dtype
    # policy], torch >= 2.15), stepped by SGD with momentum (AdamW refuses them)
    "bf16_params_fp32_grads": (2, {"bf16_params": True, "grad_dtype": "float32"}),
    "fp32_params_bf16_grads": (2, {"grad_dtype": "bfloat16"}),
    # ... on the weights only: each block is two groups (fp32 and bf16 gradients)
    "bf16_params_fp32_weight_grads": (
        2,
        {"bf16_params": True, "grad_dtype": "float32", "grad_dtype_weights_only": True},
    ),
}


@pytest.fixture
def fake_pg(request):
    world_size = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    yield world_size
    dist.destroy_process_group()


def _above(ours: int, theirs: int) -> bool:
    """More than FSDP2, beyond the tolerance: +1% or +1 MiB, whichever is larger."""
    return ours > max(theirs * 1.01, theirs + MiB)


def _config(config: str, monkeypatch) -> str:
    """The bench config a test parameter names: an ``EXTRA`` combination is
    added to ``CONFIGS`` for the test."""
    if config in EXTRA:
        monkeypatch.setitem(CONFIGS, config, EXTRA[config])
    if CONFIGS[config][1].get("grad_dtype") and not fsdp2_has_grad_dtype_policy():
        pytest.skip("this torch's FSDP2 keeps no per-parameter grad_dtype")
    return config


def _check_prediction(config: str, ours: dict) -> None:
    """The planner's peak, predicted after fully_shard from the plans and an
    activation profile (``bench.memory._predict``), is within 5% of the peak
    MemTracker measures in the step."""
    error = ours["predicted_peak"] / ours["peak"] - 1
    assert abs(error) <= 0.05, (
        f"{config}: predicted {ours['predicted_peak']} bytes, measured {ours['peak']} "
        f"({error:+.2%})"
    )


@pytest.mark.parametrize("fake_pg", [4], indirect=True, ids=["W4"])
@pytest.mark.parametrize("config", [*CONFIGS, *EXTRA])
def test_memory_not_above_fsdp2_and_predicted(fake_pg, config, monkeypatch):
    config = _config(config, monkeypatch)
    if CONFIGS[config][1].get("manual") and not hasattr(TorchFSDPModule, "finalize_backward"):
        pytest.skip("this torch's FSDP2 has no manual backward finalization")
    ours = measure("fsdp_rs", config, fake_pg, torch.device("cpu"), **SIZES)
    with simulated_streams():  # FSDP2 holds the same references on every device
        streamed = measure("fsdp_rs", config, fake_pg, torch.device("cpu"), **SIZES)
    theirs = measure("torch", config, fake_pg, torch.device("cpu"), **SIZES)
    over = {
        (phase, where): (mine[phase] / MiB, theirs[phase] / MiB)
        for where, mine in (("cpu", ours), ("streams", streamed))
        for phase in PHASES
        if _above(mine[phase], theirs[phase])
    }
    assert not over, f"{config}: fsdp-rs above torch FSDP2 (MiB, ours vs theirs): {over}"
    _check_prediction(config, ours)
    _check_prediction(f"{config} (streams)", streamed)  # the side-stream memory model


@pytest.mark.parametrize("fake_pg", [2], indirect=True, ids=["W2"])
@pytest.mark.parametrize("config", [*CONFIGS, *EXTRA])
def test_predicted_peak_within_5_percent(fake_pg, config, monkeypatch):
    """W = 4 is checked beside the FSDP2 comparison above."""
    config = _config(config, monkeypatch)
    if CONFIGS[config][0] > fake_pg:
        pytest.skip(f"{config} needs W >= {CONFIGS[config][0]}")
    _check_prediction(config, measure("fsdp_rs", config, fake_pg, torch.device("cpu"), **SIZES))


# fsdp_rs.demo's transformer: a root with parameters of its own (the tied
# embedding), attention, and a loss whose backward peaks above the blocks'.
TRANSFORMER = {"dim": 128, "layers": 2, "batch": 8, "steps": 2, "model": "transformer"}


@pytest.mark.parametrize("fake_pg", [4], indirect=True, ids=["W4"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_predicted_peak_within_5_percent_transformer(fake_pg, config):
    ours = measure("fsdp_rs", config, fake_pg, torch.device("cpu"), **TRANSFORMER)
    theirs = measure("torch", config, fake_pg, torch.device("cpu"), **TRANSFORMER)
    _check_prediction(config, ours)
    assert not _above(ours["peak"], theirs["peak"])


# At dim 1024 a block's backward holds far more than its saved activations
# (the MLP's 4 * dim wide gradients, two at once in the GELU's backward): with
# the weights frozen the prediction was 12% low until activation_profile
# measured each block's backward. (Every config is within 5% at this size,
# -0.7% to -1.2%; three of them here, for CI's time.)
TRANSFORMER_1024 = {"dim": 1024, "layers": 2, "batch": 32, "steps": 2, "model": "transformer"}


@pytest.mark.parametrize("fake_pg", [4], indirect=True, ids=["W4"])
@pytest.mark.parametrize("config", ["fp32", "frozen_weights", "bf16_fp32_reduce"])
def test_predicted_peak_within_5_percent_transformer_1024(fake_pg, config):
    _check_prediction(
        config, measure("fsdp_rs", config, fake_pg, torch.device("cpu"), **TRANSFORMER_1024)
    )


@pytest.mark.parametrize("fake_pg", [2], indirect=True, ids=["W2"])
def test_zero_grad_set_to_none_frees_gradients(fake_pg):
    """After zero_grad() no gradient memory is held; with set_to_none=False the
    gradients stay (and are zeros), as with FSDP2."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_rs import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    mesh = init_device_mesh("cpu", (fake_pg,))  # the default mesh is on a GPU if present
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 64)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    import weakref

    bases = [g._local_tensor._base for g in grads]  # the gradient buffers
    storages = [
        weakref.ref(b if b is not None else g._local_tensor)
        for b, g in zip(bases, grads, strict=True)
    ]
    del bases
    del grads
    model.zero_grad(set_to_none=True)
    # gone, or parked with its memory freed ([Note: Parked gradient buffers])
    assert all(r() is None or r().untyped_storage().nbytes() == 0 for r in storages), (
        "a .grad's buffer holds memory after zero_grad"
    )
    model(torch.randn(4, 64)).sum().backward()
    kept = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    assert all(p.grad is g for p, g in zip(model.parameters(), kept, strict=True))
    assert all(bool((g._local_tensor == 0).all()) for g in kept)


@pytest.mark.parametrize("fake_pg", [2], indirect=True, ids=["W2"])
def test_replicate_only_memory_not_above_fsdp2(fake_pg):
    """``dp_mesh_dims`` naming replicate dims only (FSDP2's DDP form, [Note:
    Replicate dims only]) on DTensor parameters, with and without
    ``reshard_after_forward``: no phase above FSDP2's. (The bench's models take
    plain parameters; this one is replicated on the mesh. One mesh for all
    runs: DTensor's caches hand back an equal mesh made earlier, and FSDP2
    requires the parameters' mesh to be the one passed.)"""
    import torch.distributed.fsdp as torch_fsdp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import fsdp_rs
    from fsdp_rs.bench.memory import _Meter

    if not hasattr(torch_fsdp, "DataParallelMeshDims"):
        pytest.skip("this torch has no DataParallelMeshDims")
    mesh = init_device_mesh("cpu", (fake_pg,), mesh_dim_names=("dp",))
    dims = torch_fsdp.DataParallelMeshDims(replicate="dp")
    dim = 512

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
            for block in self.blocks:
                for name, p in list(block.named_parameters()):
                    replicated = distribute_tensor(p.detach(), mesh, [Replicate()])
                    setattr(block, name, nn.Parameter(replicated))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
            for block in self.blocks:
                x = torch.relu(block(x))
            return x.to_local()

    def phases(fully_shard, reshard_after_forward: bool) -> dict[str, int]:
        torch.manual_seed(0)
        model = Net()
        with _Meter(torch.device("cpu"), (model,)) as meter:
            for module in [*model.blocks, model]:
                fully_shard(
                    module,
                    mesh=mesh,
                    dp_mesh_dims=dims,
                    reshard_after_forward=reshard_after_forward,
                )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            meter._tracker.track_external(model, opt)
            x = torch.randn(32, dim)
            out = {"init": meter.current()}
            for _ in range(2):
                meter.reset_peak()
                loss = model(x).pow(2).mean()
                out["forward"] = meter.current()
                loss.backward()
                del loss
                opt.step()
                out["optimizer"] = meter.current()
                opt.zero_grad()
                out["zero_grad"] = meter.current()
                out["peak"] = meter.peak()
        return out

    for raf in (True, False):
        ours, theirs = phases(fsdp_rs.fully_shard, raf), phases(torch_fsdp.fully_shard, raf)
        assert ours["peak"] > 4 * dim * dim * 4  # the parameters at least: it measured
        over = {k: (ours[k] / MiB, theirs[k] / MiB) for k in ours if _above(ours[k], theirs[k])}
        assert not over, f"raf={raf}: fsdp-rs above torch FSDP2 (MiB, ours vs theirs): {over}"
