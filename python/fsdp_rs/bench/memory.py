"""``bench memory``: memory per phase of a training step, fsdp-rs against torch
FSDP2 on the same model, side by side.

On CPU (a fake process group, rank 0 of W) memory is what
``torch.distributed._tools.mem_tracker.MemTracker`` counts: every live tensor
storage, with the peak of each step; on CUDA it is
``torch.cuda.memory_allocated`` / ``max_memory_allocated``. Phases, of the last
of ``steps`` steps: after init (``fully_shard`` and the optimizer), after
forward, the peak over the step (backward's, in practice), after the optimizer
step, after ``zero_grad()``.

For fsdp-rs it also records the planner's predicted peak
(``fsdp_rs.predict_memory``), made after ``fully_shard`` and before the first
step: the group plans; the activations and the loss, profiled on a copy under
``FakeTensorMode`` (``fsdp_rs.activation_profile``); and, as resident bytes,
the input and the optimizer state AdamW keeps (two sharded copies of the
trained parameters and a step count per parameter).

[Note: Requested bytes]
``memory_allocated`` counts whole allocator blocks: sizes rounded up to 512
bytes, and a block the allocator does not split because what would remain is
under 1 MiB (a large-pool rule) counts whole. Two runs that ask for the same
bytes in other sizes (one flat state buffer per group against one per
parameter) can therefore differ by up to about 1 MiB per such block. On CUDA
the peak and ``zero_grad`` rows also carry the bytes the tensors requested
(the allocator's ``requested_bytes`` counters), which tell that rounding apart
from memory a library actually holds.

The CPU reference ops' index cache ([Note: Cached CPU indices]) is dropped
before each measurement, so that a row does not depend on the ones before it;
it is not part of the prediction.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any

import torch
from torch import nn

__all__ = ["CONFIGS", "PHASES", "measure", "records"]

PHASES = ("init", "forward", "peak", "optimizer", "zero_grad")
# name: (minimum world size, options)
CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "fp32": (2, {}),
    "bf16_fp32_reduce": (2, {"mp": True}),
    "no_reshard": (2, {"reshard_after_forward": False}),
    "reshard_2": (4, {"reshard_after_forward": 2}),
    "accumulate_4_no_sync": (2, {"micro": 4}),
    "hsdp": (4, {"hsdp": True}),
    # LoRA-like: each layer's weight frozen, its bias trained, in one group
    "frozen_weights": (2, {"frozen_weights": True}),
    # fsdp-rs steps fsdp_rs.optim.FlatOptimizer(AdamW), FSDP2 torch's AdamW
    "flat_adamw": (2, {"flat": True}),
    "flat_adamw_frozen_weights": (2, {"flat": True, "frozen_weights": True}),
    # torch.utils.checkpoint around every block's forward: each block saves its
    # input alone and recomputes the rest in its backward
    "activation_checkpointing": (2, {"ac": True}),
    # CPUOffloadPolicy in both libraries (pinned host memory on CUDA): on CUDA
    # the rows are device memory, the sharded parameters and AdamW's states
    # being on the host
    "cpu_offload": (2, {"offload": True}),
    "cpu_offload_bf16": (2, {"offload": True, "mp": True}),
}


VOCAB, SEQ = 1024, 64  # the transformer's vocabulary and sequence length


def _model(name: str, dim: int, layers: int) -> nn.Module:
    """``mlp``: blocks of Linear + ReLU. ``transformer``: the demo's (embedding
    tied to the output, pre-norm blocks of attention and MLP, ``dim // 64``
    heads)."""
    torch.manual_seed(0)
    if name == "transformer":
        from fsdp_rs.demo import Transformer

        return Transformer(VOCAB, dim, layers, max(1, dim // 64))
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(getattr(model, "blocks", model))


def _prepare(model: nn.Module, options: dict) -> nn.Module:
    """The config's changes to a freshly built model: weights frozen, blocks
    checkpointed."""
    if options.get("grad_dtype"):  # torch >= 2.15: [Note: Gradient dtype policy]
        for p in model.parameters():
            if p.ndim >= 2 or not options.get("grad_dtype_weights_only"):
                p.grad_dtype = getattr(torch, options["grad_dtype"])
    if options.get("frozen_weights"):
        _freeze_weights(model)
    if options.get("ac"):
        from torch.utils.checkpoint import checkpoint

        for block in _blocks(model):
            forward = block.forward
            block.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    return model


def _freeze_weights(model: nn.Module) -> None:
    """LoRA's shape: every matrix of every block frozen, the rest trained."""
    for block in _blocks(model):
        for p in block.parameters():
            if p.ndim >= 2:
                p.requires_grad_(False)


def _input(name: str, dim: int, batch: int, device: torch.device, dtype=torch.float32):
    if name == "transformer":
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, VOCAB, (batch, SEQ), generator=g).to(device)
    return torch.randn(batch, dim, device=device, dtype=dtype)


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def _compute_dtype(options: dict) -> torch.dtype:
    return torch.bfloat16 if options.get("mp") or options.get("bf16_params") else torch.float32


def _storage_dtype(options: dict) -> torch.dtype:
    """The parameters' dtype, and the input's (mixed precision casts that)."""
    return torch.bfloat16 if options.get("bf16_params") else torch.float32


def _optimizer(params: list, options: dict, library: str):
    """AdamW, or FlatOptimizer(AdamW) for fsdp-rs under ``flat``; SGD with
    momentum where gradients have another dtype than their parameters."""
    if options.get("grad_dtype"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if options.get("flat") and library == "fsdp_rs":  # FSDP2 keeps torch's AdamW
        from fsdp_rs.optim import FlatOptimizer

        return FlatOptimizer(params, torch.optim.AdamW, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def _optimizer_bytes(trained: list, options: dict) -> int:
    """The optimizer's states: SGD's momentum in the gradient dtype, or AdamW's
    two copies of each parameter and a step count."""
    if options.get("grad_dtype"):
        return sum(p.to_local().numel() * p.grad_dtype.itemsize for p in trained)
    return sum(2 * p.to_local().numel() * p.element_size() + 4 for p in trained)


def _activations(name: str, options: dict, dim: int, layers: int, batch: int, device):
    """What a forward and the loss leave for backward (``activation_profile``),
    measured on a copy built under ``FakeTensorMode`` for the measured device,
    in the compute dtype: the same kernels as the real run (a ``meta`` copy may
    pick another attention), and nothing allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_rs.runtime.memory.activation_profile import activation_profile

    dtype = _compute_dtype(options)
    default = torch.get_default_dtype()
    with FakeTensorMode(), torch.device(device):
        torch.set_default_dtype(dtype)  # built in place: .to() cannot swap tied fakes
        try:
            copy = _model(name, dim, layers)
        finally:
            torch.set_default_dtype(default)
        # A wider grad_dtype left out: a synced backward computes the gradients in
        # the compute dtype ([Note: Wider gradient accumulation] in runtime/group/gradients.py)
        grad_dtype = options.get("grad_dtype")
        if grad_dtype and getattr(torch, grad_dtype).itemsize > dtype.itemsize:
            options = {k: v for k, v in options.items() if k != "grad_dtype"}
        _prepare(copy, options)
        x = _input(name, dim, batch, device, dtype)
        return activation_profile(copy, [*_blocks(copy), copy], x, loss_fn=_loss)


def _predict(
    model: nn.Module, options: dict, activations, input_bytes: int, device: torch.device
) -> int:
    """The planner's predicted peak for one step of ``model`` (sharded with
    fsdp-rs, not yet run) on ``device``: AdamW's states (two sharded copies of
    the trained parameters on ``device``, a step count each; with CPU offload
    on an accelerator they are on the host) and the input are resident."""
    from fsdp_rs.runtime.memory.memory_plan import predict_memory

    trained = [p for p in model.parameters() if p.requires_grad and p.device.type == device.type]
    optimizer = _optimizer_bytes(trained, options)
    predicted = predict_memory(
        model,
        activations=activations,
        resident_bytes=optimizer + input_bytes,
        accumulate=options.get("micro", 1) > 1,
    )
    return predicted["peak"]


def _tracker():
    """A ``MemTracker`` that also measures models with frozen parameters: torch's
    registers a gradient hook on every parameter of a module it enters, which
    raises for one that does not require grad. The hooks only sort gradients into
    MemTracker's categories; the totals read here do not need them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            frozen = not all(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(
                module, install_grad_hooks=install_grad_hooks and not frozen
            )

    return Tracker()


class _Meter:
    """Current and peak bytes: MemTracker's on CPU, the allocator's on CUDA.
    On CUDA the bytes already allocated when the run began (``base``: what
    an earlier run left behind) are not counted, so each library's run is
    measured from the same zero."""

    def __init__(
        self, device: torch.device, roots: tuple, base: int = 0, requested_base: int = 0
    ) -> None:
        self.cuda = device.type == "cuda"
        self._base = base
        self._requested_base = requested_base
        self._tracker = None
        if not self.cuda:
            self._tracker = _tracker()
            self._tracker.track_external(*roots)

    def __enter__(self) -> _Meter:
        if self._tracker is not None:
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)

    def _total(self, which: str) -> int:
        snapshot = self._tracker.get_tracker_snapshot(which)
        return int(sum(v["Total"] for v in snapshot.values()))

    def current(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() - self._base
        return self._total("current")

    def before_forward(self) -> None:
        """MemTracker's per-module stats take one forward each."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            # The peak of this step only: MemTracker has no public reset, so
            # restart its peak from now as its __enter__ does.
            tracker = self._tracker
            tracker.reset_mod_stats()
            tracker._peak_mem_snap = tracker.get_tracker_snapshot()
            tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._base
        return self._total("peak")

    def requested(self, which: str) -> int | None:
        """On CUDA, the bytes the tensors asked for (``current`` or ``peak``),
        before the allocator's rounding and unsplit block remainders, which
        ``memory_allocated`` counts ([Note: Requested bytes]); None on CPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return _requested(which) - self._requested_base


def _requested(which: str) -> int:
    return int(torch.cuda.memory_stats().get(f"requested_bytes.all.{which}", 0))


def measure(
    library: str,
    config: str,
    world_size: int,
    device: torch.device,
    dim: int = 256,
    layers: int = 8,
    batch: int = 32,
    steps: int = 3,
    model: str = "mlp",
) -> dict[str, int]:
    """Bytes per phase for one library (``"fsdp_rs"`` or ``"torch"``) in one
    config, the process group already initialized; for fsdp-rs also
    ``predicted_peak``, the planner's prediction of ``peak``."""
    from torch.distributed.device_mesh import init_device_mesh

    if library == "torch":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_rs import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    options = CONFIGS[config][1]
    shape = (2, world_size // 2) if options.get("hsdp") else (world_size,)
    names = ("replicate", "shard") if options.get("hsdp") else ("shard",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if "reshard_after_forward" in options:
        kwargs["reshard_after_forward"] = options["reshard_after_forward"]
    if options.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if options.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    gc.collect()
    name, activations = model, None
    if library == "fsdp_rs":
        from fsdp_rs.kernels import _cpu_index

        _cpu_index.clear()
        activations = _activations(name, options, dim, layers, batch, device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    requested_base = _requested("current") if device.type == "cuda" else 0
    with contextlib.ExitStack() as stack:
        model = _model(name, dim, layers).to(device, _storage_dtype(options))
        model = _prepare(model, options)
        meter = stack.enter_context(_Meter(device, (model,), base, requested_base))
        for block in _blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        x = _input(name, dim, batch, device, _storage_dtype(options))
        predicted = None
        if activations is not None:
            predicted = _predict(model, options, activations, x.nbytes, device)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(trained, options, library)
        if not meter.cuda:
            meter._tracker.track_external(model, opt)
        micro = options.get("micro", 1)
        manual = options.get("manual", False)  # every micro-step without sync, then
        if manual:  # finalize_backward() (torch >= 2.15 for FSDP2)
            if not hasattr(model, "finalize_backward"):
                raise ValueError(f"{config}: this torch's FSDP2 has no finalize_backward")
            model.set_manual_backward_finalization(True)
        result: dict[str, int] = {"init": meter.current()}
        for _ in range(steps):
            meter.reset_peak()
            for k in range(micro):
                model.set_requires_gradient_sync(k == micro - 1 and not manual)
                meter.before_forward()
                loss = _loss(model(x))
                result["forward"] = meter.current()
                loss.backward()
                del loss
            if manual:
                model.set_requires_gradient_sync(True)
                model.finalize_backward()
            opt.step()
            result["optimizer"] = meter.current()
            opt.zero_grad()
            result["zero_grad"] = meter.current()
            result["peak"] = meter.peak()
            if meter.cuda:
                result["zero_grad_requested"] = meter.requested("current")
                result["peak_requested"] = meter.requested("peak")
        if predicted is not None:
            result["predicted_peak"] = predicted
        del model, opt, x
    return result


def records(world_size: int, device: torch.device, configs: list[str], **sizes: Any) -> list:
    """One record per config and phase, both libraries measured in this process."""
    out = []
    model = f"{sizes.get('model', 'mlp')} {sizes.get('layers', 8)}x{sizes.get('dim', 256)}"
    if device.type == "cuda" and configs:
        # [Note: Warm-up before measuring] The first matmuls of a process make
        # cuBLAS workspaces (one per thread and stream: the forward's, the
        # autograd thread's), allocated through torch's allocator and never
        # freed: 66 MiB on an H200 with torch 2.11, which counted against
        # whichever library ran first. One untimed step makes them first.
        measure("torch", configs[0], world_size, device, **{**sizes, "steps": 1})
    for config in configs:
        ours = measure("fsdp_rs", config, world_size, device, **sizes)
        theirs = measure("torch", config, world_size, device, **sizes)
        for phase in PHASES:
            a, b = ours[phase], theirs[phase]
            out.append(
                {
                    "bench": "memory",
                    "model": model,
                    "config": config,
                    "world_size": world_size,
                    "device": device.type,
                    "phase": phase,
                    "fsdp_rs_bytes": a,
                    "torch_bytes": b,
                    "ratio": a / b if b else float("nan"),
                    # the planner's prediction of fsdp-rs's peak (peak rows only)
                    "predicted_bytes": ours["predicted_peak"] if phase == "peak" else None,
                    # CUDA, peak and zero_grad rows: the bytes requested ([Note: Requested bytes])
                    "fsdp_rs_requested_bytes": ours.get(f"{phase}_requested"),
                    "torch_requested_bytes": theirs.get(f"{phase}_requested"),
                }
            )
    return out
