"""``torch.compile`` of fully_shard models, run by spawned gloo ranks (CPU).

Each scenario trains the same tied-weight transformer for ``STEPS`` steps three
times: fsdp-rs eager (the reference), fsdp-rs compiled and torch FSDP2 compiled
the same way. Compiled runs record, besides losses and final full parameters,
what Dynamo did at the first step (graphs compiled, graph breaks, frames,
operations captured) and whether any later step compiled again (it must not:
the later steps run with ``error_on_recompile``).
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from fsdp_rs.demo import Block
from spawned import finish, scenario_done

STEPS = 5
LAYERS = 2

# How users call compile on a model sharded per block and at the root.
HOWS = ("model", "blocks", "model_method", "blocks_method")

# name: options. ``how``: torch.compile(model) / torch.compile(block) per block /
# model.compile() / block.compile(); ``backend``; ``dynamic`` (None: torch's
# default); ``bf16``: MixedPrecisionPolicy(bfloat16, float32); ``raf``:
# reshard_after_forward of every fully_shard call; ``ac``: torch.utils.checkpoint
# inside each block; ``loop``: the model's forward loops over its blocks (Dynamo
# then runs that frame eager after a break in it) or calls them one by one
# (Dynamo resumes after each hook); ``fullgraph`` (per block only).
BASE = {"dynamic": None, "bf16": False, "raf": True, "ac": False, "loop": True}
_CONFIGS = {
    # every way of calling compile with each backend; the other options rotate
    "model_aot_eager": {"how": "model", "backend": "aot_eager"},
    "model_eager_bf16_ac_noraf": {
        "how": "model",
        "backend": "eager",
        "bf16": True,
        "ac": True,
        "raf": False,
    },
    "model_aot_eager_dynamic_unrolled_ac_noraf": {
        "how": "model",
        "backend": "aot_eager",
        "dynamic": True,
        "ac": True,
        "loop": False,
        "raf": False,
    },
    "model_method_aot_eager_bf16_dynamic_unrolled_ac": {
        "how": "model_method",
        "backend": "aot_eager",
        "bf16": True,
        "dynamic": True,
        "ac": True,
        "loop": False,
    },
    "model_method_eager_unrolled": {"how": "model_method", "backend": "eager", "loop": False},
    "blocks_aot_eager_dynamic_unrolled_noraf": {
        "how": "blocks",
        "backend": "aot_eager",
        "dynamic": True,
        "loop": False,
        "raf": False,
    },
    "blocks_eager_bf16_ac": {"how": "blocks", "backend": "eager", "bf16": True, "ac": True},
    "blocks_method_aot_eager_bf16_ac": {
        "how": "blocks_method",
        "backend": "aot_eager",
        "bf16": True,
        "ac": True,
    },
    # torchtitan's call: each block.compile(fullgraph=True); the hooks run eager
    # around the compiled blocks (Dynamo skips module hooks there, as for FSDP2)
    "blocks_method_aot_eager_fullgraph": {
        "how": "blocks_method",
        "backend": "aot_eager",
        "fullgraph": True,
    },
    "blocks_method_eager_dynamic_noraf": {
        "how": "blocks_method",
        "backend": "eager",
        "dynamic": True,
        "raf": False,
    },
    # inductor: the model unrolled (a graph between every two hooks), and per block
    "model_inductor_unrolled_ac": {
        "how": "model",
        "backend": "inductor",
        "ac": True,
        "loop": False,
    },
    "blocks_method_inductor_bf16_dynamic_noraf": {
        "how": "blocks_method",
        "backend": "inductor",
        "bf16": True,
        "dynamic": True,
        "raf": False,
    },
}
SCENARIOS: dict[str, dict[str, Any]] = {k: {**BASE, **v} for k, v in _CONFIGS.items()}
# Compiled with inductor against eager, per ``bf16``: inductor fuses and reorders
# arithmetic (a bf16 ulp is 2**-8).
INDUCTOR_TOLERANCE = {
    False: {"rtol": 1e-5, "atol": 1e-6},  # fp32
    True: {"rtol": 1e-2, "atol": 1e-3},  # bf16 parameters, fp32 reduction
}
# Run in the default test pass; the others are marked slow (still run in CI).
FAST = (
    "model_aot_eager",
    "model_method_aot_eager_bf16_dynamic_unrolled_ac",
    "blocks_eager_bf16_ac",
    "model_inductor_unrolled_ac",
)


class _Block(Block):
    def __init__(self, dim: int, heads: int, ac: bool) -> None:
        super().__init__(dim, heads)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac:
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


class Model(nn.Module):
    """The demo transformer (tied embedding and output), with activation
    checkpointing inside the blocks and a forward that loops or not."""

    def __init__(self, ac: bool, loop: bool, vocab: int = 37, dim: int = 12) -> None:
        super().__init__()
        self.loop = loop
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, 2, ac) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.loop:
            for block in self.blocks:
                x = block(x)
        else:
            first, second = self.blocks
            x = second(first(x))
        return self.out(self.norm(x))


def tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 37, (4, 9), generator=g)


def sharded_model(
    spec: dict, fs: Callable, mp_cls: type, world_size: int, model_cls: type | None = None
) -> Model:
    torch.manual_seed(0)
    device = spec.get("device", "cpu")
    model = (model_cls or Model)(spec["ac"], spec["loop"]).to(device)
    if spec.get("hsdp"):  # two replicas of world_size // 2 shards
        names = ("replicate", "shard")
        mesh = init_device_mesh(device, (2, world_size // 2), mesh_dim_names=names)
    else:
        mesh = init_device_mesh(device, (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": spec["raf"]}
    if spec["bf16"]:
        kwargs["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if spec.get("shard1"):  # matrices whose dim 1 splits evenly, on dim 1
        kwargs["shard_placement_fn"] = lambda p: (
            Shard(1) if p.ndim == 2 and p.shape[1] % world_size == 0 else None
        )
    if spec.get("frozen"):  # LoRA's shape: the blocks' matrices frozen
        for block in model.blocks:
            for p in block.parameters():
                p.requires_grad_(p.ndim < 2)
    if spec.get("gathered"):  # the blocks' matrices all-gathered in bf16 (an extension)
        from extension_scenarios import Bf16Gathered

        for linear in (m for m in model.blocks.modules() if isinstance(m, nn.Linear)):
            linear.weight = nn.Parameter(Bf16Gathered(linear.weight.detach().clone()))
    blocks = list(model.blocks)
    if spec.get("multi"):  # the last block and the final norm in one call
        fs([blocks.pop(), model.norm], **kwargs)
    for block in blocks:
        fs(block, **kwargs)
    fs(model, **kwargs)
    return model


def compile_model(model: Model, spec: dict, backend: Callable) -> nn.Module:
    """``model`` compiled as ``spec['how']`` says; returns what to call."""
    options = {"backend": backend, "dynamic": spec["dynamic"]}
    if spec.get("fullgraph"):  # per block, as torchtitan compiles its blocks
        options["fullgraph"] = True
    how = spec["how"]
    if how == "model":
        return torch.compile(model, **options)
    if how == "model_method":
        model.compile(**options)
    elif how == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, **options)
    elif how == "blocks_method":
        for block in model.blocks:
            block.compile(**options)
    else:
        raise ValueError(f"unknown way to compile: {how!r}")
    return model


class CountingBackend:
    """A Dynamo backend that counts the graphs it is given and hands them to
    the named one (``torch._dynamo.lookup_backend``)."""

    def __init__(self, name: str) -> None:
        self.inner = torch._dynamo.lookup_backend(name)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _dynamo_counts(backend: CountingBackend | None) -> dict[str, int]:
    from torch._dynamo.utils import counters

    # Breaks Dynamo resumed after, and those that made it run a frame eager (torch
    # 2.9 files these under "inline_call" when they are in an inlined function).
    categories = ("graph_break", "unimplemented", "inline_call")
    reasons = [r for c in categories for r in counters[c].elements()]
    return {
        "graphs": backend.graphs if backend else 0,
        "breaks": len(reasons),
        "reasons": [r[:400] for r in reasons],
        "frames": counters["frames"]["total"],
        "captured": counters["stats"]["calls_captured"],
    }


def _events(profiler) -> list:
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    events = []
    while stack:
        event = stack.pop()
        events.append(event)
        stack.extend(event.children)
    return events


def step_memory(spec: dict, world_size: int, compile_fn: Callable | None) -> tuple[int, int, int]:
    """Graphs compiled, and bytes allocated over the last of three steps: net
    after forward, and the step's peak; see [Note: Measuring memory under
    compile] (tests/test_compile.py). ``compile_fn(model, backend)``: what to
    call for a compiled step (None: eager)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from fsdp_rs import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    backend = CountingBackend(spec["backend"])
    # Profiled from the model's creation: the profiler knows the size of what it saw allocated.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        model = sharded_model(spec, fully_shard, MixedPrecisionPolicy, world_size)
        run = compile_fn(model, backend) if compile_fn is not None else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            with record_function(f"forward {step}"):
                loss = run(tokens(step, 0)).float().pow(2).mean()
            with record_function(f"rest {step}"):
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad()
    events = _events(profiler)
    spans = {e.name: (e.start_time_ns, e.start_time_ns + e.duration_time_ns) for e in events}
    (start, forward_end), (_, end) = spans["forward 2"], spans["rest 2"]
    allocs = sorted(
        (e.start_time_ns, e.extra_fields.alloc_size)
        for e in events
        if e.tag == _EventType.Allocation and start <= e.start_time_ns <= end
    )
    total = peak = after_forward = 0
    for t, size in allocs:
        total += size
        peak = max(peak, total)
        if t <= forward_end:
            after_forward = total
    return backend.graphs, after_forward, peak


def train(spec: dict, library: str, world_size: int, rank: int, compiled: bool) -> dict:
    """Losses, final full parameters and, compiled, Dynamo's counts."""
    from torch._dynamo.utils import counters

    if library == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_rs import MixedPrecisionPolicy, fully_shard
    model = sharded_model(spec, fully_shard, MixedPrecisionPolicy, world_size)
    torch._dynamo.reset()  # nothing from an earlier run: its cache entries, its counters
    counters.clear()
    backend = CountingBackend(spec["backend"]) if compiled else None
    run = compile_model(model, spec, backend) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first = [], {}
    for step in range(STEPS):
        # After the first step nothing may compile again.
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss = run(tokens(step, rank)).float().pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0:
            first = _dynamo_counts(backend)
    params = [p.full_tensor().float().tolist() for p in model.parameters()]
    result = {"losses": losses, "params": params}
    if compiled:
        result["first_step"] = first
        result["all_steps"] = _dynamo_counts(backend)
    return result


def init_rank(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """A spawned compile rank: gloo (or ``backend``), one thread (the ranks
    share the cores)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300)
    )
    torch.set_num_threads(1)


def worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    init_rank(rank, world_size, port)
    results: dict[str, Any] = {}
    eager: dict[tuple, dict] = {}  # the reference, per model and sharding options
    for name in names:
        try:
            spec = SCENARIOS[name]
            key = (spec["bf16"], spec["raf"], spec["ac"], spec["loop"])
            if key not in eager:
                eager[key] = train(spec, "fsdp_rs", world_size, rank, compiled=False)
            results[name] = {
                "eager": eager[key],
                "fsdp_rs": train(spec, "fsdp_rs", world_size, rank, compiled=True),
                "torch": train(spec, "torch", world_size, rank, compiled=True),
            }
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        scenario_done(out_dir, rank, results)
    finish(out_dir, rank, results)
