"""``bench optim``: the optimizer step over many parameter tensors, side by
side in one process: the unsharded model's per-parameter step, torch FSDP2 with
the per-parameter optimizer, fsdp-rs with the per-parameter optimizer, and
fsdp-rs with ``fsdp_rs.optim.FlatOptimizer`` ([Note: Flat optimizer]); then the
whole training step (forward, backward, clip, optimizer step, ``zero_grad``)
under FSDP2 + torch's optimizer and clip and under fsdp-rs + the flat optimizer
and ``fsdp_rs.clip_grad_norm_``.

The model is ``bench step``'s (``BLOCK_SHAPES`` blocks, one ``fully_shard``
group each, then the root) on torch's fake process group (rank 0 of W), so the
collectives return at once and what is timed is the step's own work. Before the
optimizer timings, every model's gradients are overwritten with the same
deterministic values (the fake collectives leave them undefined), so the two
fsdp-rs models step identical shards from identical gradients and their final
shards must be equal bit for bit (``equal``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_rs.bench.timing import fresh_dtensor_caches, time_call
from fsdp_rs.bench.training import BenchModel, fake_process_group, shard_model
from fsdp_rs.runtime.group.grad_buffers import local_tensor as _local

__all__ = ["COLUMNS", "OPTIMIZERS", "bench_optim", "check_columns"]

#: What ``columns`` may name: the four optimizer steps and the whole training step
#: (which needs ``torch`` and ``flat``).
COLUMNS = ("plain", "torch", "fsdp_rs", "flat", "step")
_MODELS = {"plain": "plain", "torch": "torch", "fsdp_rs": "fsdp_rs", "flat": "fsdp_rs_flat"}

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    # what torch's optimizers default to on CUDA (the loop is their CPU default)
    "adamw-foreach": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01, "foreach": True}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
}


def _set_grads(model: nn.Module) -> None:
    """Every parameter's gradient (local shard) := a fixed function of its
    index and position, written in place (fsdp-rs's stay views of its buffers)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = _local(p.grad)
            values = torch.arange(g.numel(), dtype=torch.float32, device=g.device)
            g.copy_(((values * 0.37 + i) % 7 - 3).mul_(1e-3).view_as(g))


def _grads_ready(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    _set_grads(model)


def _train_step(model, opt, clip, x: torch.Tensor) -> None:
    model(x).sum().backward()
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def check_columns(columns: tuple[str, ...]) -> None:
    """ValueError unless ``columns`` are among ``COLUMNS``, name flat and one to
    check its shards against (torch or fsdp_rs), and torch where they name step."""
    if not set(columns) <= set(COLUMNS) or "flat" not in columns:
        raise ValueError(f"columns {columns!r}: choose from {','.join(COLUMNS)}, flat included")
    if not {"torch", "fsdp_rs"} & set(columns):
        raise ValueError("the flat shards are checked against torch's or fsdp_rs's: add one")
    if "step" in columns and "torch" not in columns:
        raise ValueError("the step column compares with FSDP2: add torch")


def bench_optim(
    n_params: int,
    world_size: int,
    block_params: int,
    optimizer: str,
    repeat: int,
    device: torch.device,
    columns: tuple[str, ...] = COLUMNS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One record: median seconds per optimizer step of each column, and of a
    whole training step under FSDP2 and fsdp-rs + flat; None for a column not
    in ``columns`` (at 1e5 parameters the per-parameter columns take minutes).
    ``equal``: the flat optimizer's shards against fsdp-rs per parameter's, or
    FSDP2's where that column is left out (their shards are the same bits)."""
    from fsdp_rs.optim import FlatOptimizer, clip_grad_norm_

    check_columns(columns)
    cls, kwargs = OPTIMIZERS[optimizer]
    fake_process_group(world_size)
    x = torch.zeros(4, device=device)
    models = {}
    # flat first: where a run is cut short (a lease's limit), its figure is in
    order = sorted((c for c in COLUMNS if c in columns and c != "step"), key=lambda c: c != "flat")
    for name in map(_MODELS.get, order):
        torch.manual_seed(0)
        model = BenchModel(n_params, block_params).to(device)
        if name != "plain":
            shard_model(model, "torch" if name == "torch" else "fsdp_rs")
        models[name] = model
    opts = {name: cls(m.parameters(), **kwargs) for name, m in models.items()}
    opts["fsdp_rs_flat"] = FlatOptimizer(models["fsdp_rs_flat"].parameters(), cls, **kwargs)
    record: dict[str, Any] = {
        "bench": "optim",
        "n_params": n_params,
        "world_size": world_size,
        "block_params": block_params,
        "optimizer": optimizer,
        "device": device.type,
        **{f"{name}_s": None for name in _MODELS.values()},
        "step_plain_s": None,  # the unsharded model's whole step, with plain
        "step_torch_s": None,
        "step_fsdp_rs_flat_s": None,
        "step_speedup": None,
    }
    for name, model in models.items():
        fresh_dtensor_caches()  # [Note: One process, two libraries]
        _grads_ready(model, x)
        opt = opts[name]
        opt.step()  # states made: not timed

        def step(opt=opt):
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()

        # one more untimed step before timing: on an H200 the two steps right after
        # the states were made gave flat a median of 12.9 ms, where
        # tools/profile_flat_step.py (20 steps after one) gave 4.7
        timing, _ = time_call(step, repeat, warmup=1, collect=False)
        record[f"{name}_s"] = timing.median
        if progress is not None:
            progress(f"N={n_params} {name} optimizer step {timing.median * 1e3:.2f} ms")
        gc.collect()
    reference = "fsdp_rs" if "fsdp_rs" in models else "torch"
    shards = [
        [_local(p).detach() for p in models[n].parameters()] for n in (reference, "fsdp_rs_flat")
    ]
    record["equal"] = all(map(torch.equal, *shards))  # the same steps from the same grads
    record["equal_to"] = reference
    torch_s = record["torch_s"]
    record["flat_speedup"] = None if torch_s is None else torch_s / record["fsdp_rs_flat_s"]
    if "step" not in columns:
        del models, opts
        gc.collect()
        return record
    clips = {"fsdp_rs_flat": clip_grad_norm_, "torch": torch.nn.utils.clip_grad_norm_}
    if "plain" in models:  # the floor: the same model's own forward, backward and step
        clips["plain"] = torch.nn.utils.clip_grad_norm_
    for name, clip in clips.items():
        model, opt = models[name], opts[name]
        opt.zero_grad()
        fresh_dtensor_caches()  # the warm-up step fills them again

        def train(model=model, opt=opt, clip=clip):
            _train_step(model, opt, clip, x)
            if device.type == "cuda":
                torch.cuda.synchronize()

        timing, _ = time_call(train, max(repeat // 2, 1), warmup=1, collect=False)
        record[f"step_{name}_s"] = timing.median
        if progress is not None:
            progress(f"N={n_params} {name} whole step {timing.median * 1e3:.2f} ms")
    record["step_speedup"] = record["step_torch_s"] / record["step_fsdp_rs_flat_s"]
    del models, opts
    gc.collect()
    return record
