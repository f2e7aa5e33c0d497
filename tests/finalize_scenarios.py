"""Manual backward finalization and kept unsharded storage (torch >= 2.15's
``set_manual_backward_finalization`` / ``finalize_backward`` /
``set_keep_unsharded_storage``), trained with fsdp-rs and torch FSDP2 side by
side in spawned gloo ranks, and the pipeline schedules that drive them.

Where the installed torch's FSDP2 lacks the API, its reference is the same
training without it: gradient accumulation with the last micro-step synced
instead of a manual finalization, the default reshard instead of kept storage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

import fsdp_rs
from scenario_common import DIM, LIBS, _inputs, _mesh
from spawned import run_named

TORCH_HAS_MANUAL = hasattr(TorchFSDPModule, "finalize_backward")
# torch 2.9's pipeline schedules abort (SIGABRT) in their first p2p exchange on
# gloo, with or without FSDP (plain nn.Linear stages alike)
PIPELINES_ON_GLOO = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 10)
TORCH_HAS_KEEP = hasattr(TorchFSDPModule, "set_keep_unsharded_storage")
MICRO = 3


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(_block() for _ in range(3)), nn.Linear(DIM, DIM))


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))


def _sharded(lib: str, model: nn.Sequential, mesh, **kwargs) -> nn.Sequential:
    for block in model[:-1]:
        LIBS[lib](block, mesh=mesh, **kwargs)
    LIBS[lib](model, mesh=mesh, **kwargs)
    return model


def _shards(model: nn.Module) -> dict[str, list[float]]:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    return {n: local(p).detach().flatten().tolist() for n, p in model.named_parameters()}


def _loss(model: nn.Module, rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return model(_inputs(rank, step, micro)).pow(2).mean()


def manual_finalize(
    world_size: int, rank: int, mode: str, hsdp: bool = False, mp: bool = False
) -> dict:
    """``mode``: "accumulate" (torchtitan's deferred reduction: micro-steps
    without sync or reshard, then sync on and one ``finalize_backward()``),
    "sync" (one synced backward; the root's reduction waits for the
    finalization), "async" (as "accumulate", with ``async_op=True``; a forward
    before ``wait()`` raises). ``mp``: bf16 parameters, fp32 reduce, CPU offload."""
    kwargs = {}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, hsdp), **kwargs)
        manual = lib == "rs" or TORCH_HAS_MANUAL
        if manual:
            model.set_manual_backward_finalization(True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, raised = [], []
        for step in range(3):
            if mode == "sync":
                loss = _loss(model, rank, step)
                loss.backward()
                losses.append(loss.item())
            else:
                for micro in range(MICRO):
                    last = micro == MICRO - 1
                    if manual:  # every micro-step without sync; the sync at finalize
                        model.set_requires_gradient_sync(False)
                        model.set_reshard_after_backward(False)
                    else:  # FSDP2 without the API: the last micro-step synced
                        model.set_requires_gradient_sync(last)
                    loss = _loss(model, rank, step, micro)
                    loss.backward()
                    losses.append(loss.item())
                if manual:
                    model.set_requires_gradient_sync(True)
                    model.set_reshard_after_backward(True)
            if manual and mode == "async":
                handle = model.finalize_backward(async_op=True)
                try:
                    model(_inputs(rank, 99))
                    raised.append(None)
                except RuntimeError as e:
                    raised.append("waited on before forward" in str(e))
                handle.wait()
            elif manual:
                model.finalize_backward()
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(model), "raised": raised}
    out["torch_manual"] = TORCH_HAS_MANUAL
    return out


class _RankZeroHead(nn.Module):
    """The model with a head (in the root's group) and a sharded block whose
    output only rank 0 uses: gradients present on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()
        self.aux = nn.Linear(DIM, DIM)
        self.extra = _block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, extra = self.body(x), self.extra(x)  # every rank runs every forward
        if dist.get_rank() == 0:
            out = out + self.aux(x) + extra
        return out


def partial_grads(world_size: int, rank: int, mode: str) -> dict:
    """Gradients on rank 0 only, finalized by hand ("sync": the root's group
    reduced at the finalization; "accumulate": every micro-step without sync),
    against fsdp-rs's automatic end of backward (the last micro-step synced):
    every rank reduces the same groups, the missing gradients count as zeros
    ([Note: Gradient agreement]). FSDP2 leaves a parameter without a local
    gradient out of its reduce-scatter, so it is not the reference here."""
    out = {}
    for how in ("manual", "automatic"):
        model = _RankZeroHead()
        mesh = _mesh(world_size, False)
        for block in [*model.body[:-1], model.extra]:
            fsdp_rs.fully_shard(block, mesh=mesh)
        fsdp_rs.fully_shard(model, mesh=mesh)
        model.set_manual_backward_finalization(how == "manual")
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        micro = 1 if mode == "sync" else MICRO
        for step in range(3):
            for k in range(micro):
                sync = (how == "automatic" and k == micro - 1) or mode == "sync"
                model.set_requires_gradient_sync(sync)
                loss = _loss(model, rank, step, k)
                loss.backward()
                losses.append(loss.item())
            if how == "manual":
                model.set_requires_gradient_sync(True)
                model.finalize_backward()
            optim.step()
            optim.zero_grad()
        out[how] = {"losses": losses, "params": _shards(model)}
    return out


def finalize_errors(world_size: int, rank: int) -> dict:
    """What fsdp-rs refuses, as FSDP2 does: finalization without manual mode or
    on a nested module, manual mode on a nested module or changed inside
    backward, and a second finalization before the first handle's wait."""
    model = _sharded("rs", _net(), _mesh(world_size, False))
    errors = {}

    def expect(key: str, fn) -> None:
        try:
            fn()
            errors[key] = None
        except (RuntimeError, TypeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"

    errors["before_forward"] = model.finalize_backward()  # a no-op, as FSDP2
    model.set_manual_backward_finalization(False)
    model[0].set_manual_backward_finalization(True)  # before lazy init: accepted
    expect("nested_at_lazy_init", lambda: _loss(model, rank, 0))
    model[0].set_manual_backward_finalization(False)
    _loss(model, rank, 0).backward()
    expect("not_manual", model.finalize_backward)
    expect("nested", lambda: model[0].set_manual_backward_finalization(True))
    expect("not_bool", lambda: model.set_manual_backward_finalization(1))
    model.set_manual_backward_finalization(True)
    loss = _loss(model, rank, 1)
    loss.register_hook(lambda g: expect("in_backward", model.finalize_backward) or g)
    loss.backward()
    expect("change_after_backward", lambda: model.set_manual_backward_finalization(False))
    handle = model.finalize_backward(async_op=True)
    expect("twice", model.finalize_backward)
    handle.wait()
    expect("nested_finalize", model[0].finalize_backward)
    _loss(model, rank, 2).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    expect("after_reset", handle.wait)
    return {"errors": errors}


class _Capture:
    """Keeps the unsharded weights each forward ran with, to read their
    storage once the step resharded them."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: list[torch.Tensor] = []
        for block in model[:-1]:
            block[0].register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args) -> None:
        self.seen.append(module.weight)


def keep_storage(world_size: int, rank: int, reshard_after_forward: bool = True) -> dict:
    """``set_keep_unsharded_storage(True)`` on the root (recursing): every
    unsharded weight keeps its memory and data pointer across reshards and
    steps; training is unchanged. Then False: reshard frees them again."""
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False), reshard_after_forward=True)
        keep = lib == "rs" or TORCH_HAS_KEEP
        if keep:
            model.set_keep_unsharded_storage(True)
        capture = _Capture(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = _loss(model, rank, step)
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        kept = [t.untyped_storage().nbytes() > 0 for t in capture.seen]
        pointers = [t.data_ptr() for t in capture.seen]
        per_block = len(model) - 1
        stable = all(p == pointers[i % per_block] for i, p in enumerate(pointers))
        if keep:
            model.set_keep_unsharded_storage(False)
        capture.seen.clear()
        losses.append(_loss(model, rank, 3).item())
        freed = [t.untyped_storage().nbytes() == 0 for t in capture.seen]
        out[lib] = {
            "losses": losses,
            "params": _shards(model),
            "kept": kept,
            "stable": stable,
            "freed_after": freed,
        }
    out["torch_keep"] = TORCH_HAS_KEEP
    return out


def _stage_model(lib: str, index: int, mesh) -> nn.Sequential:
    """Pipeline stage ``index``: two blocks, each sharded, then the stage."""
    torch.manual_seed(index)
    model = nn.Sequential(*(_block() for _ in range(2)))
    for param in model.parameters():
        nn.init.normal_(param, std=0.2)
    for block in model:
        LIBS[lib](block, mesh=mesh)
    LIBS[lib](model, mesh=mesh)
    return model


def pipeline(world_size: int, rank: int, schedule: str) -> dict:
    """torch's pipeline schedules over two ranks of stages (two stages each for
    the interleaved ones), each stage data parallel over the other mesh dim: a
    schedule treats a stage as data parallel when it is a torch ``FSDPModule``,
    which fsdp-rs modules are (nothing patched); torch >= 2.15's stages drive
    manual finalization, older ones read ``fully_shard.state(m)`` ([Note:
    fsdp-rs in torch's composable registry]), and the interleaved schedules
    ``unshard(async_op=True)`` a stage ahead of its forward."""
    if not PIPELINES_ON_GLOO:
        return {
            "skipped": "torch 2.9's pipeline schedules abort in their first p2p exchange on "
            "gloo, whatever shards the stages"
        }
    import torch.distributed.pipelining as pipelining

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    cls, per_rank = {
        "gpipe": (pipelining.ScheduleGPipe, 1),
        "1f1b": (pipelining.Schedule1F1B, 1),
        "interleaved_1f1b": (pipelining.ScheduleInterleaved1F1B, 2),
        "zero_bubble": (pipelining.ScheduleInterleavedZeroBubble, 2),
    }[schedule]
    out = {}
    for lib in LIBS:
        # nothing patched: fsdp-rs modules are torch's FSDPModules to the schedules
        indices = [pp_rank + 2 * v for v in range(per_rank)]
        models = [_stage_model(lib, i, mesh["dp"]) for i in indices]
        stages = [
            pipelining.PipelineStage(
                m, i, 2 * per_rank, torch.device("cpu"), group=mesh["pp"].get_group()
            )
            for m, i in zip(models, indices, strict=True)
        ]
        runner = cls(
            stages if per_rank > 1 else stages[0],
            n_microbatches=4,
            loss_fn=lambda o, t: (o - t).pow(2).mean(),
        )
        params = [p for m in models for p in m.parameters()]
        optim = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * mesh["dp"].get_local_rank() + step)
            x, y = torch.randn(8, DIM, generator=gen), torch.randn(8, DIM, generator=gen)
            step_losses: list[torch.Tensor] = []
            if pp_rank == 0:
                runner.step(x)
            else:
                runner.step(target=y, losses=step_losses)
            losses.append([loss.item() for loss in step_losses])
            optim.step()
            optim.zero_grad()
        shards = {
            f"{i}.{k}": v
            for i, m in zip(indices, models, strict=True)
            for k, v in _shards(m).items()
        }
        out[lib] = {"losses": losses, "params": shards}
    return out


SCENARIOS = {
    "accumulate": (manual_finalize, {"mode": "accumulate"}),
    "sync": (manual_finalize, {"mode": "sync"}),
    "async": (manual_finalize, {"mode": "async"}),
    "accumulate_hsdp": (manual_finalize, {"mode": "accumulate", "hsdp": True, "min_world": 4}),
    "accumulate_bf16_offload": (manual_finalize, {"mode": "accumulate", "mp": True}),
    "sync_bf16_offload": (manual_finalize, {"mode": "sync", "mp": True}),
    "partial_sync": (partial_grads, {"mode": "sync"}),
    "partial_accumulate": (partial_grads, {"mode": "accumulate"}),
    "errors": (finalize_errors, {}),
    "keep_storage": (keep_storage, {}),
    "gpipe": (pipeline, {"schedule": "gpipe"}),
    "1f1b": (pipeline, {"schedule": "1f1b"}),
    "interleaved_1f1b": (pipeline, {"schedule": "interleaved_1f1b"}),
    "zero_bubble": (pipeline, {"schedule": "zero_bubble"}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
