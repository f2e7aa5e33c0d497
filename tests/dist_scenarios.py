"""Training scenarios run under real collectives by spawned processes: gloo on
CPU meshes (``worker``) and NCCL on CUDA meshes (``cuda_worker``, one rank per GPU).

Every scenario trains the same model, from the same initial weights and with
per-rank data, twice: with torch FSDP2's ``fully_shard`` and with fsdp-rs's,
and records losses and final full parameters. Some also train a replicated
reference (plain model, gradients averaged with ``all_reduce``).

Both libraries get an explicit mesh of the scenario's device type: their
default mesh is on the accelerator whenever one is present, whatever the
backend, so a gloo run that left it to them would put CUDA tensors on gloo
next to a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_rs.demo import Transformer
from spawned import finish, scenario_done
from stream_sim import simulated_streams

STEPS = 5


def mlp(dims=(16, 33, 7, 13, 5)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _mlp_data(step: int, rank: int, dim: int = 16, device: str = "cpu"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, dim, generator=g).to(device)


def _tokens(step: int, rank: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 37, (4, 9), generator=g).to(device)


def _mesh(device: str, world_size: int, hsdp: bool = False):
    """The mesh both libraries shard over: (replicate, shard) for HSDP, else 1-D."""
    if hsdp:
        shape, names = (2, world_size // 2), ("replicate", "shard")
        return init_device_mesh(device, shape, mesh_dim_names=names)
    return init_device_mesh(device, (world_size,))


def _shard_layers(model: nn.Module, fs: Callable, **kwargs) -> None:
    children = model.blocks if isinstance(model, Transformer) else model
    for child in children:
        if any(True for _ in child.parameters()):
            fs(child, **kwargs)
    fs(model, **kwargs)


SCENARIOS: dict[str, dict] = {
    "mlp": {},
    "mlp_no_reshard": {"kwargs": {"reshard_after_forward": False}},
    "mlp_reshard_int": {"kwargs": {"reshard_after_forward": 2}, "min_world": 4},
    "transformer_tied": {"model": "transformer"},
    "transformer_bf16": {"model": "transformer", "mp": (torch.bfloat16, torch.float32)},
    # RMSNorm's backward gives its bf16 weight an fp32 gradient on torch >= 2.15,
    # which both libraries reduce as it is (the other gradients cast up to it)
    "transformer_rmsnorm_bf16": {
        "model": "transformer",
        "rms_norm": True,
        "mp": (torch.bfloat16, torch.float32),
    },
    # reduce_dtype=None: FSDP2 reduces (and accumulates without sync) in param_dtype
    # up to torch 2.14 and in the parameters' own dtype from 2.15 ([Note: Default
    # reduce dtype]); weight-tied, so several contributions meet in one gradient
    "transformer_bf16_default_reduce_accumulation": {
        "model": "transformer",
        "mp": (torch.bfloat16, None),
        "accumulate": True,
        "layout_differs": True,
    },
    "mlp_bf16_fp32_accumulation": {"mp": (torch.bfloat16, torch.float32), "accumulate": True},
    "mlp_cpu_offload": {"offload": True},
    "mlp_grad_accumulation": {"accumulate": True, "layout_differs": True},
    "mlp_explicit_prefetch": {"prefetch": True},
    "mlp_uneven": {"dims": (16, 3, 13, 2, 5)},
    "mlp_frozen": {"frozen": 2, "layout_differs": True},
    "mlp_ignored": {"ignored": 2, "layout_differs": True},
    # frozen and trained parameters in one group (LoRA's shape): the reduction
    # holds the trained ones only, as FSDP2's ([Note: Gradient layout]); the row
    # alignment gaps between many parameters place elements elsewhere than
    # FSDP2's chunk_cat, so W = 4 agrees to rounding ([Reduction order])
    "mlp_frozen_in_group": {"frozen": 2, "root_only": True, "layout_differs": True},
    "mlp_frozen_in_group_accumulation": {
        "frozen": 2,
        "root_only": True,
        "accumulate": True,
        "layout_differs": True,
    },
    "mlp_hsdp": {"hsdp": True, "min_world": 4},
    "transformer_compiled_blocks": {"model": "transformer", "compile": True},
    # one group holding fp32 and (frozen, as FSDP2 requires) bf16 parameters,
    # which fsdp-rs shards as one group per dtype ([Note: One group per dtype])
    "mlp_mixed_dtype_root_only": {
        "mixed_dtype": True,
        "frozen": 2,
        "root_only": True,
        "mp": (torch.bfloat16, torch.float32),
        "layout_differs": True,
    },
    # fsdp-rs with a simulated accelerator's streams (tests/stream_sim.py) and its
    # race checker: CPU only (on CUDA the streams are real)
    "mlp_streams": {"streams": True},
    "transformer_bf16_streams": {
        "model": "transformer",
        "mp": (torch.bfloat16, torch.float32),
        "streams": True,
    },
    "mlp_hsdp_streams": {"hsdp": True, "min_world": 4, "streams": True},
    "mlp_frozen_in_group_streams": {
        "frozen": 2,
        "root_only": True,
        "streams": True,
        "layout_differs": True,
    },
    "mlp_reshard_int_streams": {
        "kwargs": {"reshard_after_forward": 2},
        "min_world": 4,
        "streams": True,
    },
}


def cuda_scenarios(world_size: int) -> list[str]:
    """The scenarios ``cuda_worker`` runs at ``world_size``."""
    return [
        name
        for name, spec in SCENARIOS.items()
        if spec.get("min_world", 1) <= world_size and not spec.get("streams")
    ]


def _build(spec: dict) -> nn.Module:
    torch.manual_seed(0)
    if spec.get("model") == "transformer":
        model = Transformer(vocab=37, dim=12, layers=2, heads=2)  # weight-tied
        if spec.get("rms_norm"):  # Llama's norms
            for module in list(model.modules()):
                for name, child in module.named_children():
                    if isinstance(child, nn.LayerNorm):
                        setattr(module, name, nn.RMSNorm(child.normalized_shape))
        return model
    model = mlp(spec.get("dims", (16, 33, 7, 13, 5)))
    if spec.get("mixed_dtype"):
        model[2].to(torch.bfloat16)
    return model


def train(
    spec: dict,
    fs: Callable | None,
    world_size: int,
    rank: int,
    checker=None,
    device: str = "cpu",
):
    """Losses and final full parameters; ``fs=None`` trains the replicated reference.
    ``checker``: a stream_sim race checker to run the steps under. ``device``: the
    mesh's device type; fully_shard moves the model there, the data is made there."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    model = _build(spec)
    if spec.get("frozen") is not None:
        for p in model[spec["frozen"]].parameters():
            p.requires_grad_(False)
    kwargs = dict(spec.get("kwargs", {}))
    if spec.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=spec["mp"][0], reduce_dtype=spec["mp"][1]
        )
    if spec.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    ignored = None
    if spec.get("ignored") is not None:
        ignored = set(model[spec["ignored"]].parameters())
        model[spec["ignored"]].to(device)  # fully_shard leaves ignored params where they are
    if fs is None:
        model.to(device)
    else:
        kwargs["mesh"] = _mesh(device, world_size, hsdp=spec.get("hsdp", False))
        if ignored is not None:
            children = list(model)
            for i, child in enumerate(children):
                if i != spec["ignored"] and any(True for _ in child.parameters()):
                    fs(child, **kwargs)
            fs(model, ignored_params=ignored, **kwargs)
        elif spec.get("root_only"):
            fs(model, **kwargs)
        else:
            _shard_layers(model, fs, **kwargs)
        if spec.get("prefetch"):
            layers = [m for m in model if any(True for _ in m.parameters())]
            for a, b in itertools.pairwise(layers):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        if spec.get("compile"):
            for block in model.blocks:
                block.forward = torch.compile(block.forward)
        if checker is not None:
            for module in model.modules():
                state = getattr(module, "_fsdp_rs_state", None)
                if state is not None and state.group is not None:
                    state.group.preplace_grads = False  # as on an accelerator
    trained = [p for p in model.parameters() if p.requires_grad]
    # Ignored params stay plain tensors beside the DTensors: torch's foreach
    # step (the default on CUDA) refuses the mix in one param group, under FSDP2
    # too, so they get a group of their own, as a user's script would.
    kept = ignored or set()
    groups = [[p for p in trained if p not in kept], [p for p in trained if p in kept]]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-2)
    losses = []
    with checker or contextlib.nullcontext():
        _steps(spec, model, opt, fs, world_size, rank, losses, device)
    params = [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
    ]
    ignored_local = [p.detach() for p in ignored] if ignored else []
    return losses, [t.tolist() for t in params + ignored_local]


def _steps(spec, model, opt, fs, world_size: int, rank: int, losses: list, device: str) -> None:
    transformer = spec.get("model") == "transformer"
    for step in range(STEPS):
        micro = 2 if spec.get("accumulate") else 1
        for k in range(micro):
            if fs is not None and spec.get("accumulate"):
                model.set_requires_gradient_sync(k == micro - 1)
            t = step * 10 + k
            data = _tokens(t, rank, device) if transformer else _mlp_data(t, rank, device=device)
            out = model(data)
            loss = out.float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        if fs is None:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
        opt.step()
        opt.zero_grad()


def checkpoint_round_trip(out_dir: str, world_size: int, device: str = "cpu") -> dict:
    """Save an fsdp-rs model (trained one step) with torch.distributed.checkpoint,
    load it into a differently initialized fsdp-rs model and into a torch FSDP2
    model: every parameter's full tensor must come back bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp_rs

    mesh = _mesh(device, world_size)

    def build(seed: int, fs: Callable) -> nn.Module:
        torch.manual_seed(seed)
        model = mlp()
        _shard_layers(model, fs, mesh=mesh)
        return model

    model = build(0, fsdp_rs.fully_shard)
    x = _mlp_data(0, dist.get_rank(), device=device)
    model(x).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
    saved = {k: v.full_tensor() for k, v in model.state_dict().items()}
    path = os.path.join(out_dir, "checkpoint")
    dcp.save(model.state_dict(), checkpoint_id=path)
    result = {}
    for name, fs in (("fsdp_rs", fsdp_rs.fully_shard), ("torch", torch_fully_shard)):
        fresh = build(1, fs)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state)
        loaded = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
        result[name] = sorted(saved) == sorted(loaded) and all(
            torch.equal(saved[k], loaded[k]) for k in saved
        )
        # the loaded model trains: its gradients land in the sharded buffer
        fresh(x).square().mean().backward()
        result[f"{name}_grads"] = all(p.grad is not None for p in fresh.parameters())
    return result


def worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    """The scenarios on CPU meshes over gloo."""
    _run(rank, world_size, port, names, out_dir, "gloo", "cpu")


def cuda_worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    """The scenarios on CUDA meshes over NCCL, rank r on GPU r."""
    # cuBLAS picks its workspace per stream; a fixed one keeps matmuls bitwise
    # reproducible whichever stream runs them (set before CUDA starts).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(rank)
    # Both libraries' runs must compute alike: deterministic kernels where torch
    # has them, and the math attention (the fused ones' backward may use atomics).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    _run(rank, world_size, port, names, out_dir, "nccl", "cuda")


def _run(rank, world_size, port, names, out_dir, backend: str, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp_rs

    results = {}
    for name in names:
        spec = SCENARIOS[name]
        try:
            torch_run = train(spec, torch_fully_shard, world_size, rank, device=device)
            if spec.get("streams"):
                with simulated_streams() as (_, checker):
                    ours = train(spec, fsdp_rs.fully_shard, world_size, rank, checker)
            else:
                ours = train(spec, fsdp_rs.fully_shard, world_size, rank, device=device)
            result = {"torch": torch_run, "fsdp_rs": ours}
            if spec.get("streams"):
                result["violations"] = checker.violations
            if name in ("mlp", "transformer_tied"):
                result["replicated"] = train(spec, None, world_size, rank, device=device)
        except Exception:
            result = {"error": traceback.format_exc()}
        results[name] = result
        scenario_done(out_dir, rank, results)
    try:
        results["checkpoint"] = checkpoint_round_trip(out_dir, world_size, device)
    except Exception:
        results["checkpoint"] = {"error": traceback.format_exc()}
    finish(out_dir, rank, results)
