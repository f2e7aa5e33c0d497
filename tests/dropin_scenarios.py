"""Behaviours of torch FSDP2 that fsdp-rs must reproduce, each trained or
inspected with fsdp-rs and with torch FSDP2 side by side in the same spawned
gloo process, over explicit CPU meshes.

Each scenario returns a dict per library (``"rs"``, ``"torch"``) of what it
observed: losses and final local shards as float lists (compared bit for bit),
hook counts, dtypes, types. ``test_dropin.py`` asserts on them.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_rs
from fsdp_rs.optim import FlatOptimizer
from scenario_common import (
    DIM,
    HIDDEN,
    LIBS,
    OUT,
    STEPS,
    CountingAllGather,
    CountingReduceScatter,
    _inputs,
    _mesh,
    reshard_all,
)
from spawned import run_named

_BUILD_LOCK = threading.Lock()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.to(self.head.weight.dtype))


def _net(seed: int = 0, cls: type[nn.Module] = Net) -> nn.Module:
    """The model (``cls()``) at a seed; one construction at a time, so that
    ranks run as threads of one process build the same weights from the
    global RNG."""
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        return cls()


def _sharded(lib: str, model: nn.Module, mesh, **kwargs) -> nn.Module:
    shard = LIBS[lib]
    for block in model.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _shards(model: nn.Module | dict, grads: bool = False) -> dict[str, list[float]]:
    """Each parameter's local shard (its gradient's with ``grads``) as floats;
    ``model``: a module, or modules by name."""
    modules = model.items() if isinstance(model, dict) else [("", model)]
    return {
        f"{name}.{n}" if name else n: _local(p.grad if grads else p)
        .detach()
        .double()
        .flatten()
        .tolist()
        for name, module in modules
        for n, p in module.named_parameters()
    }


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


# ------------------------------------------------------- post-accumulate-grad


def post_acc_hook_counts(world_size: int, rank: int, hsdp: bool = False) -> dict:
    """Hook runs per parameter: a synced backward; two micro-steps, the first
    under set_requires_gradient_sync(False) (HSDP: set_requires_all_reduce)."""
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, hsdp))
        counts: dict[str, int] = {n: 0 for n, _ in model.named_parameters()}

        def hook(name: str, param: torch.Tensor, counts=counts) -> None:
            assert param.grad is not None, name
            counts[name] += 1

        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(functools.partial(hook, name))
        seen = []
        _loss(model, _inputs(rank, 0)).backward()
        seen.append(dict(counts))
        model.zero_grad()
        if hsdp:
            model.set_requires_all_reduce(False)
        else:
            model.set_requires_gradient_sync(False)
        _loss(model, _inputs(rank, 1)).backward()
        seen.append(dict(counts))
        model.set_requires_all_reduce(True)
        model.set_requires_gradient_sync(True)
        _loss(model, _inputs(rank, 2)).backward()
        seen.append(dict(counts))
        out[lib] = {"counts": seen}
    return out


def post_acc_hook_optim(
    world_size: int,
    rank: int,
    hsdp: bool = False,
    offload: bool = False,
    mp: bool = False,
    accumulate: bool = False,
) -> dict:
    """Optimizer in backward (one AdamW per parameter, stepped and zeroed in its
    post-accumulate-grad hook) against FSDP2 doing the same, and, for fsdp-rs,
    against one AdamW stepped after backward."""
    kwargs = {}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    optim_kwargs = {"lr": 1e-2, "foreach": False, "weight_decay": 0.1}
    out = {}
    for lib, in_backward in (("rs", True), ("torch", True), ("rs_step", False)):
        model = _sharded(lib.removesuffix("_step"), _net(), _mesh(world_size, hsdp), **kwargs)
        if in_backward:
            optims = {p: torch.optim.AdamW([p], **optim_kwargs) for p in model.parameters()}

            def hook(param: torch.Tensor, optims=optims) -> None:
                optims[param].step()
                optims[param].zero_grad()

            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hook)
        else:
            optim = torch.optim.AdamW(model.parameters(), **optim_kwargs)
        losses = []
        for step in range(STEPS):
            if accumulate:
                model.set_requires_gradient_sync(False)
                _loss(model, _inputs(rank, step, 1)).backward()
                model.set_requires_gradient_sync(True)
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            if not in_backward:
                optim.step()
                optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(model)}
    return out


# ---------------------------------------------------------------- conversions


def to_float64(world_size: int, rank: int, swap: bool = True) -> dict:
    """model.to(torch.float64) after fully_shard, then training."""
    out = {}
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        for lib in LIBS:
            model = _sharded(lib, _net(), _mesh(world_size, False))
            objects = list(model.parameters())
            model.to(torch.float64)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                loss = _loss(model, _inputs(rank, step).double())
                loss.backward()
                losses.append(loss.item())
                grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
                optim.step()
                optim.zero_grad()
            out[lib] = {
                "losses": losses,
                "params": _shards(model),
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "local_dtypes": sorted({str(_local(p).dtype) for p in model.parameters()}),
                "grad_dtypes": grad_dtypes,
                "same_objects": all(map(_is, objects, model.parameters())),
            }
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    return out


def _is(a, b) -> bool:
    return a is b


# ----------------------------------------------------------------- state dict


def state_dict_after_forward(world_size: int, rank: int) -> dict:
    """state_dict() after a forward with reshard_after_forward=False: the
    sharded DTensors, not the unsharded parameters; then a backward and a step
    still train."""
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False), reshard_after_forward=False)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = _loss(model, _inputs(rank, 0))
        sd = model.state_dict()
        types = sorted({type(v).__name__ for v in sd.values()})
        shapes = {k: list(_local(v).shape) for k, v in sd.items()}
        values = {k: _local(v).flatten().tolist() for k, v in sd.items()}
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss2 = _loss(model, _inputs(rank, 1))
        model.load_state_dict(model.state_dict())  # after forward, in place
        loss2.backward()
        optim.step()
        out[lib] = {
            "types": types,
            "shapes": shapes,
            "values": values,
            "losses": [loss.item(), loss2.item()],
            "params": _shards(model),
        }
    return out


def load_assign(world_size: int, rank: int) -> dict:
    """Hugging Face accelerate's RAM-efficient loading: full weights made into
    new DTensors, load_state_dict(assign=True), the optimizer built over the
    parameters registered then; training must update them."""
    out = {}
    full = _net(seed=1).state_dict()
    for lib in LIBS:
        mesh = _mesh(world_size, False)
        model = _sharded(lib, _net(), mesh)
        sd = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in full.items()}
        model.load_state_dict(sd, assign=True)
        objects = list(model.parameters())
        optim = torch.optim.AdamW(objects, lr=1e-2)
        start = _shards(model)
        losses = []
        for step in range(3):
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        end = _shards(model)
        out[lib] = {
            "losses": losses,
            "params": end,
            "trained": all(start[n] != end[n] for n in start if start[n]),
            "same_objects": all(map(_is, objects, model.parameters())),
        }
    return out


# ------------------------------------------------------------------ meta init


class Routed(Net):
    """Net with a router of 2 outputs: at W >= 4 some ranks hold an empty shard
    of it (dim 0 below the world size), as an 8-expert router at W >= 16."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.router(x).softmax(-1)[:, :1]


def meta_init(world_size: int, rank: int) -> dict:
    """The model built on the meta device, sharded, then to_empty and
    reset_parameters: every rank (those with empty shards too) trains."""
    out = {}
    for lib in LIBS:
        with torch.device("meta"):
            model = Routed()
        mesh = _mesh(world_size, False)
        shard = LIBS[lib]
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model.router, mesh=mesh)
        shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with _BUILD_LOCK:
            torch.manual_seed(rank)
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {
            "losses": losses,
            "params": _shards(model),
            "router_shard": list(model.router.weight.to_local().shape),
        }
    return out


class Trunk(Net):
    """torchtitan's shape: the model's forward ends at the norm; the loss runs
    the output head in chunks afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def chunked_loss(world_size: int, rank: int) -> dict:
    """One group over [norm, head] (torchtitan), built on meta; the forward runs
    only norm, the loss calls head.unshard() and head per chunk."""
    out = {}
    for lib in LIBS:
        with torch.device("meta"):
            model = Trunk()
        mesh = _mesh(world_size, False)
        shard = LIBS[lib]
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard([model.norm, model.head], mesh=mesh)
        shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with _BUILD_LOCK:
            torch.manual_seed(rank)
            for module in model.modules():
                if isinstance(module, (nn.Linear, nn.LayerNorm)):
                    module.reset_parameters()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, sharded_after_forward = [], []
        for step in range(3):
            hidden = model(_inputs(rank, step))
            sharded_after_forward.append(isinstance(model.head.weight, DTensor))
            model.head.unshard()
            loss = sum(model.head(c).pow(2).mean() for c in hidden.chunk(3))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {
            "losses": losses,
            "params": _shards(model),
            "sharded_after_forward": sharded_after_forward,
        }
    return out


class _Collectives(TorchDispatchMode):
    """Counts the all-gathers and reduce-scatters issued inside it (what
    torch's CommDebugMode counts, without its module tracking)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket._qualified_op_name
        if "allgather" in name or "reduce_scatter" in name:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class Normed(Trunk):
    """Hugging Face's causal LM shape: the forward runs norm, then head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


def group_of_two(world_size: int, rank: int) -> dict:
    """One group over [norm, head] (accelerate and torchtitan shard the final
    norm with the output head), both run in forward, bf16 parameters and
    reduction, two micro-steps without sync: one reduce-scatter per group per
    synced backward and FSDP2's bits ([Note: Groups over several modules])."""
    out = {}
    for lib in LIBS:
        model = _net(0, Normed)
        mesh = _mesh(world_size, False)
        shard = LIBS[lib]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=mp)
        shard([model.norm, model.head], mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, counts = [], []
        for step in range(3):
            with _Collectives() as seen:
                for micro in range(2):
                    model.set_requires_gradient_sync(micro == 1)
                    loss = model(_inputs(rank, step, micro)).float().pow(2).mean()
                    loss.backward()
                    losses.append(loss.item())
            counts.append(seen.counts)
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(model), "counts": counts}
    return out


class Twice(Net):
    """``Net`` whose middle block runs twice per forward (shared weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = block(x)
        return self.head(x)


def called_twice(world_size: int, rank: int, hsdp: bool, group: bool = False) -> dict:
    """A block called twice per forward (also in a group over two blocks, with
    ``group``), three micro-steps per step without sync (HSDP: without the
    all-reduce across replicas): gradients, losses and parameters with FSDP2's
    bits ([Note: Partial gradients of a module called twice])."""
    out = {}
    for lib in LIBS:
        model = _net(0, Twice)
        mesh = _mesh(world_size, hsdp)
        shard = LIBS[lib]
        blocks = list(model.blocks)
        shard(blocks[0], mesh=mesh)
        if group:
            shard(blocks[1:], mesh=mesh)
        else:
            for block in blocks[1:]:
                shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for step in range(2):
            for micro in range(3):
                if hsdp:
                    model.set_requires_all_reduce(micro == 2)
                else:
                    model.set_requires_gradient_sync(micro == 2)
                loss = _loss(model, _inputs(rank, step, micro))
                loss.backward()
                losses.append(loss.item())
            grads.append(_shards(model, grads=True))
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "grads": grads, "params": _shards(model)}
    return out


def forward_ad(world_size: int, rank: int, reshard_after_forward: bool = False) -> dict:
    """torch.func.jvp through the sharded model before any other forward, then
    a training step."""
    out = {}
    for lib in LIBS:
        model = _sharded(
            lib, _net(), _mesh(world_size, False), reshard_after_forward=reshard_after_forward
        )
        x, v = _inputs(rank, 0), _inputs(rank, 1)
        primal, tangent = torch.func.jvp(model, (x,), (v,))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = _loss(model, x)
        loss.backward()
        optim.step()
        out[lib] = {
            "primal": primal.flatten().tolist(),
            "tangent": tangent.flatten().tolist(),
            "loss": loss.item(),
            "params": _shards(model),
        }
    return out


def jvp_of_outside_input(world_size: int, rank: int) -> dict:
    """torch's own test (test_no_warmup_jvp_reshard_after_forward_false): an
    encoder's output computed outside ``torch.func.jvp``, the decoder run
    inside it on that output (bf16, ``reshard_after_forward=False``), then a
    backward of the primal output. FSDP2 before torch 2.10 fails inside jvp
    (a functorch wrapper has no storage): there only fsdp-rs is checked."""
    out = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for lib in LIBS:
        with _BUILD_LOCK:
            torch.manual_seed(0)
            enc, dec = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, OUT, bias=False)
        for module in (enc, dec):
            LIBS[lib](
                module, mesh=_mesh(world_size, False), mp_policy=mp, reshard_after_forward=False
            )
        x = _inputs(rank, 0)
        primal = torch.randn(OUT, generator=torch.Generator().manual_seed(rank))
        encoded = enc(x)
        try:
            decode = functools.partial(_ignore_first, dec, encoded)
            output, tangent = torch.func.jvp(decode, (primal,), (primal,))
        except NotImplementedError as e:  # FSDP2 < 2.10
            out[lib] = {"failed": str(e)}
            continue
        output.float().pow(2).mean().backward()
        out[lib] = {
            "output": output.float().flatten().tolist(),
            "dtype": str(output.dtype),
            "tangent_zero": bool((tangent == 0).all()),
            "grads": _shards({"enc": enc, "dec": dec}, grads=True),
        }
    return out


def _ignore_first(module: nn.Module, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    return module(x)


# ----------------------------------------------------------------- containers


@dataclasses.dataclass
class Carry:
    hidden: torch.Tensor
    extras: dict


class Pair(NamedTuple):
    hidden: torch.Tensor
    skip: torch.Tensor


class CarryBlock(Block):
    """A block passing a dataclass (holding a dict) and a NamedTuple on."""

    def forward(self, carry: Carry | torch.Tensor) -> Carry:
        if isinstance(carry, torch.Tensor):
            carry = Carry(carry, {"pair": Pair(carry, carry * 0.5)})
        pair = carry.extras["pair"]
        h = super().forward(carry.hidden) + pair.skip
        return Carry(h, {"pair": Pair(h, torch.tanh(pair.hidden))})


class CarryNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CarryBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry = x
        for block in self.blocks:
            carry = block(carry)
        return self.head(carry.hidden + carry.extras["pair"].skip)


def containers(world_size: int, rank: int, mp: bool = False) -> dict:
    """Tensors inside dataclasses, dicts and NamedTuples between sharded modules
    get their backward hooks (and casts, with mixed precision)."""
    out = {}
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mp else {}
    for lib in LIBS:
        with _BUILD_LOCK:
            torch.manual_seed(0)
            model = CarryNet()
        model = _sharded(lib, model, _mesh(world_size, False), **kwargs)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(model)}
    return out


# ------------------------------------------------------------- FSDPModule API


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    fsdp_module = (fsdp_rs.FSDPModule, TorchFSDPModule)
    return [m for m in model.modules() if isinstance(m, fsdp_module)]


def _train(model: nn.Module, rank: int, steps: int = 3, **optim_kwargs) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, **optim_kwargs)
    losses = []
    for step in range(steps):
        loss = _loss(model, _inputs(rank, step))
        loss.backward()
        losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return losses


def api_setting(world_size: int, rank: int, setting: str) -> dict:
    """Train with one FSDPModule setting applied to every module, as users call
    them; the same training as FSDP2's with it."""
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False))
        extra: dict = {}
        if setting == "custom_comms":
            comms = []
            for module in _fsdp_modules(model):
                ag, rs = CountingAllGather(), CountingReduceScatter()
                module.set_custom_all_gather(ag)
                module.set_custom_reduce_scatter(rs)
                comms.append((ag, rs))
        elif setting == "divide_factor":
            for module in _fsdp_modules(model):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
                module.set_reduce_scatter_divide_factor(3.0 * world_size)
        elif setting == "separate_rs_group":
            model.set_separate_reduce_scatter_group()
            model.set_reduce_scatter_max_input_buffers(2)
        elif setting == "pg_alloc":
            for module in _fsdp_modules(model):
                module.set_allocate_memory_from_process_group_for_comm(True)
        losses = _train(model, rank)
        if setting == "custom_comms":
            extra["calls"] = [(ag.calls, rs.calls) for ag, rs in comms]
        out[lib] = {"losses": losses, "params": _shards(model), **extra}
    return out


def checkpoint_wrapped(world_size: int, rank: int) -> dict:
    """accelerate's activation checkpointing: each block's inner module and
    then its CheckpointWrapper are passed to fully_shard (both are sharded,
    as with FSDP2), then the root; training equals FSDP2's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    out = {}
    for lib in LIBS:
        model = _net()
        model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
        mesh = _mesh(world_size, False)
        shard = LIBS[lib]
        for wrapper in model.blocks:
            shard(wrapper._checkpoint_wrapped_module, mesh=mesh)
            shard(wrapper, mesh=mesh)
        shard(model, mesh=mesh)
        out[lib] = {"losses": _train(model, rank), "params": _shards(model)}
    return out


def symm_mem_on_cpu(world_size: int, rank: int) -> dict:
    """set_symm_mem_for_comm on a CPU mesh: accepted, then the first collective
    raises (no symmetric memory backend for the CPU), as with FSDP2."""
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False))
        for module in _fsdp_modules(model):
            module.set_symm_mem_for_comm()
        try:
            model(_inputs(rank, 0))
            raised = None
        except Exception as e:
            raised = type(e).__name__
        out[lib] = {"raised": raised}
    return out


class Sometimes(Net):
    """A head used on rank 0 only and a branch no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(DIM, OUT)
        self.unused = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if dist.get_rank() == 0:
            out = out + self.aux(x)
        return out


def unused_params(world_size: int, rank: int) -> dict:
    """set_reduce_scatter_unused_params(True): every trainable parameter gets a
    .grad (zeros where no rank used it), so AdamW's weight decay moves all."""
    out = {}
    for lib in LIBS:
        model = _net(0, Sometimes)
        mesh = _mesh(world_size, False)
        shard = LIBS[lib]
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(True)
        _loss(model, _inputs(rank, 0)).backward()
        has_grad = {n: p.grad is not None for n, p in model.named_parameters()}
        model.zero_grad()
        losses = _train(model, rank)
        out[lib] = {"has_grad": has_grad, "losses": losses, "params": _shards(model)}
    return out


class Failing(Exception):
    pass


def reset_iter_state(world_size: int, rank: int, where: str) -> dict:
    """An exception in the middle of a forward or a backward, caught; then
    reset_iter_state() on the root and training goes on."""
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, rank, steps=1)
        try:
            if where == "forward":
                handle = model.blocks[1].register_forward_hook(_raise)
                try:
                    model(_inputs(rank, 5))
                finally:
                    handle.remove()
            else:
                out_ = model(_inputs(rank, 5))
                out_.register_hook(_raise)
                out_.pow(2).mean().backward()
        except Failing:
            pass
        model.reset_iter_state()
        optim.zero_grad()
        losses += _train(model, rank, steps=2)
        out[lib] = {"losses": losses, "params": _shards(model)}
    return out


def _raise(*unused):
    raise Failing()


def shared_comm_ctx(world_size: int, rank: int) -> dict:
    """Two roots (pipeline stages) sharing their communication context."""
    out = {}
    share = {"rs": fsdp_rs.share_comm_ctx, "torch": torch_share_comm_ctx}
    for lib in LIBS:
        mesh = _mesh(world_size, False)
        first, second = _sharded(lib, _net(), mesh), _sharded(lib, _net(seed=1), mesh)
        share[lib]([first, second])
        optim = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-2)
        losses = []
        for step in range(3):
            x = _inputs(rank, step)
            loss = _loss(first, x) + _loss(second, x)
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(first) | _shards(second)}
    return out


# ------------------------------------------------------------ mixed precision


def param_dtype_override(world_size: int, rank: int) -> dict:
    """MixedPrecisionPolicy.param_dtype_override_fn: the head computes in fp32
    while the rest computes in bf16 (torch >= 2.15 has the field; older torch
    runs fsdp-rs alone, with a policy subclass that adds it)."""
    fields = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
    policy_cls = MixedPrecisionPolicy
    libs = dict(LIBS)
    if "param_dtype_override_fn" not in fields:
        policy_cls = dataclasses.make_dataclass(
            "OverridePolicy",
            [("param_dtype_override_fn", Callable | None, dataclasses.field(default=None))],
            bases=(MixedPrecisionPolicy,),
            frozen=True,
        )
        libs.pop("torch")
    out = {}
    for lib in libs:
        model = _net()
        head = {id(p) for p in model.head.parameters()}

        def override(p: nn.Parameter, head=head) -> torch.dtype | None:
            return torch.float32 if id(p) in head else None

        policy = policy_cls(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            param_dtype_override_fn=override,
        )
        LIBS[lib](model, mesh=_mesh(world_size, False), mp_policy=policy)
        seen = {}

        def record(module, args, output, name, seen=seen):
            seen[name] = [str(module.weight.dtype), str(output.dtype)]

        model.head.register_forward_hook(functools.partial(record, name="head"))
        model.blocks[0].lin1.register_forward_hook(functools.partial(record, name="lin1"))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(model), "dtypes": seen}
    return out


# ------------------------------------------------ nothing left behind in a process


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("raised inside a sharded module's forward")


def second_model(world_size: int, rank: int, first: str = "checkpoint") -> dict:
    """A model trained after another one that used the composable checkpoint()
    on its blocks, or whose forward raised inside a sharded block: the second
    trains as under FSDP2, and the first trains again after its exception."""
    from torch.distributed._composable import checkpoint

    out = {}
    for lib in LIBS:
        losses = []
        model = _net()
        if first == "checkpoint":
            for block in model.blocks:
                checkpoint(block)
        else:
            model.blocks[1].lin2 = nn.Sequential(model.blocks[1].lin2, _Fails())
        _sharded(lib, model, _mesh(world_size, False))
        if first == "checkpoint":
            loss = _loss(model, _inputs(rank, 0))
            loss.backward()
            losses.append(loss.item())
        else:
            try:
                _loss(model, _inputs(rank, 0))
            except ValueError:
                pass
            model.blocks[1].lin2[1].forward = lambda x: x
            loss = _loss(model, _inputs(rank, 1))
            loss.backward()
            losses.append(loss.item())
        second = _sharded(lib, _net(), _mesh(world_size, False))
        optim = torch.optim.AdamW(second.parameters(), lr=1e-2)
        for step in range(2):
            loss = _loss(second, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "params": _shards(second)}
    return out


# ------------------------------------------------------- trainable set changes


def _form_kwargs(form: str) -> dict:
    """``fully_shard`` keyword arguments of a scenario form: "bf16" (bf16
    parameters, fp32 reduction), "keep" (reshard_after_forward=False),
    "reshard_2", "offload" (CPU offload); none for any other form."""
    if form == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return {"mp_policy": mp}
    if form == "offload":
        return {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    if form == "keep":
        return {"reshard_after_forward": False}
    if form == "reshard_2":
        return {"reshard_after_forward": 2}
    return {}


# step -> (parameters to freeze, parameters to unfreeze), by name prefix
_FREEZE_PLAN = {
    0: (["blocks.1.lin1.weight"], []),
    2: (["blocks.0.lin2.bias", "blocks.2."], ["blocks.1.lin1.weight"]),
    4: (["blocks.1.lin1.weight"], ["blocks.2."]),
}


def _apply_freeze_plan(model: nn.Module, step: int) -> None:
    freeze, unfreeze = _FREEZE_PLAN.get(step, ([], []))
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in freeze):
            p.requires_grad_(False)
        if any(name.startswith(u) for u in unfreeze):
            p.requires_grad_(True)


def trainable_set_changes(world_size: int, rank: int, form: str = "fp32", steps: int = 6) -> dict:
    """Parameters frozen and unfrozen between steps (a whole block too), after
    the first forward: which parameters get gradients, the losses and the
    trained shards follow ``requires_grad`` as under FSDP2 ([Note: Trainable set
    changes]). ``form``: "fp32", "bf16" (bf16 parameters, fp32 reduction),
    "keep" (reshard_after_forward=False), "keep_grads"
    (``zero_grad(set_to_none=False)``), "offload" (CPU offload), "accumulate"
    (two micro-steps, the first without sync), "flat" (fsdp-rs steps a
    ``FlatOptimizer``, FSDP2 the per-parameter AdamW), "flat_sgd" (the same
    with SGD and dampened momentum, a state without a step count), "keep_storage"
    (``set_keep_unsharded_storage(True)``, where the library has it: the
    unsharded parameters' storage seen in forward, per step, is recorded)."""
    kwargs = _form_kwargs(form)
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False), **kwargs)
        if form == "flat_sgd":  # momentum kept without a step count ([Note: Flat optimizer])
            sgd = {"lr": 1e-2, "momentum": 0.9, "dampening": 0.25}
            if lib == "rs":
                optim = FlatOptimizer(model.parameters(), torch.optim.SGD, **sgd)
            else:
                optim = torch.optim.SGD(model.parameters(), **sgd)
        elif form == "flat" and lib == "rs":
            optim = FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        else:
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, had, storages = [], [], []
        if form == "keep_storage" and hasattr(model, "set_keep_unsharded_storage"):
            model.set_keep_unsharded_storage(True)
            for block in model.blocks:
                block.register_forward_pre_hook(
                    lambda m, args, seen=storages: seen.append(
                        m.lin1.weight.untyped_storage().data_ptr()
                    )
                )
        for step in range(steps):
            _apply_freeze_plan(model, step)
            micro = 2 if form == "accumulate" else 1
            for m in range(micro):
                model.set_requires_gradient_sync(m == micro - 1)
                loss = _loss(model, _inputs(rank, step, m))
                loss.backward()
                losses.append(loss.item())
            had.append([p.grad is not None for p in model.parameters()])
            optim.step()
            optim.zero_grad(set_to_none=form != "keep_grads")
        out[lib] = {"losses": losses, "had": had, "params": _shards(model)}
        if lib == "rs":
            out["rs_storages"] = storages
    return out


def trainable_set_change_mid_accumulation(world_size: int, rank: int) -> dict:
    """fsdp-rs: freezing a parameter between a backward without sync and the
    synced one would lose the gradients kept so far, so it raises, naming it
    (relative to its module)."""
    model = _sharded("rs", _net(), _mesh(world_size, False))
    model.set_requires_gradient_sync(False)
    _loss(model, _inputs(rank, 0)).backward()
    model.blocks[0].lin1.weight.requires_grad_(False)
    model.set_requires_gradient_sync(True)
    try:
        _loss(model, _inputs(rank, 1)).backward()
    except RuntimeError as e:
        return {"raised": str(e)}
    return {"raised": None}


# step -> (parameters to freeze, to unfreeze) for trainable_set_after_eval: the
# root's head too, whose group an evaluation forward leaves unsharded
_EVAL_FREEZE_PLAN = {
    0: (["head.weight", "blocks.1.lin1.weight"], []),
    2: (["blocks.0.lin2.bias"], ["head.weight"]),
    4: ([], ["blocks.0.lin2.bias", "blocks.1.lin1.weight"]),
}


def trainable_set_after_eval(
    world_size: int, rank: int, keep: bool = False, steps: int = 6
) -> dict:
    """``requires_grad`` changed through ``model.named_parameters()`` after an
    evaluation forward under ``torch.no_grad()``: the root (and, with ``keep``,
    every module: reshard_after_forward=False) is still unsharded, so the
    parameters changed are the unsharded ones ([Note: Trainable set changes]).
    FSDP2 follows such a change one step late; it follows one made on the
    sharded parameters, so its run reshards before each change, as does a second
    fsdp-rs run ("rs_reshard"): the three train the same parameters, bit for
    bit."""
    kwargs = {"reshard_after_forward": False} if keep else {}
    out = {}
    for key, lib, reshard_first in (
        ("rs", "rs", False),
        ("torch", "torch", True),
        ("rs_reshard", "rs", True),
    ):
        model = _sharded(lib, _net(), _mesh(world_size, False), **kwargs)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, had, evaluated, unsharded_at_change = [], [], [], []
        for step in range(steps):
            freeze, unfreeze = _EVAL_FREEZE_PLAN.get(step, ([], []))
            if freeze or unfreeze:
                unsharded_at_change.append(not isinstance(model.head.weight, DTensor))
                if reshard_first:
                    reshard_all(model)
                for name, p in model.named_parameters():
                    if any(name.startswith(f) for f in freeze):
                        p.requires_grad_(False)
                    if any(name.startswith(u) for u in unfreeze):
                        p.requires_grad_(True)
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            had.append([p.grad is not None for p in optim.param_groups[0]["params"]])
            optim.step()
            optim.zero_grad()
            with torch.no_grad():
                evaluated.append(_loss(model, _inputs(rank, step, 7)).item())
        reshard_all(model)
        out[key] = {
            "losses": losses,
            "had": had,
            "evaluated": evaluated,
            "params": _shards(model),
            "requires_grad": [p.requires_grad for p in model.parameters()],
        }
        out[f"{key}_unsharded_at_change"] = unsharded_at_change
    return out


def trainable_set_change_with_pending_graph(world_size: int, rank: int) -> dict:
    """fsdp-rs: a change met by a second forward while the first forward's
    graph still holds the unsharded parameters (they would be made again under
    it) raises, naming the parameter; after ``reset_iter_state`` training goes on."""
    model = _sharded("rs", _net(), _mesh(world_size, False), reshard_after_forward=False)
    first = _loss(model, _inputs(rank, 0))
    model.head.weight.requires_grad_(False)
    try:
        _loss(model, _inputs(rank, 1))
        raised = None
    except RuntimeError as e:
        raised = str(e)
    del first
    model.reset_iter_state()
    loss = _loss(model, _inputs(rank, 2))
    loss.backward()
    return {"raised": raised, "head_grad": model.head.weight.grad is not None, "loss": loss.item()}


def inference_first(world_size: int, rank: int, form: str = "fp32", steps: int = 4) -> dict:
    """An evaluation forward before training and between steps (as a
    validation sanity pass does): fsdp-rs under ``torch.inference_mode()``,
    FSDP2 under ``torch.no_grad()`` (its buffers made in inference mode would
    fail the training forward; [Note: Made outside inference mode]). The
    evaluation outputs, losses and trained shards are the same bits. ``form``:
    "fp32", "bf16", "keep" (reshard_after_forward=False), "reshard_2" (W = 4),
    "offload"."""
    kwargs = _form_kwargs(form)
    out = {}
    for lib in LIBS:
        model = _sharded(lib, _net(), _mesh(world_size, False), **kwargs)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        evaluated, losses = [], []
        for step in range(steps):
            if step % 2 == 0:
                model.eval()
                with torch.inference_mode() if lib == "rs" else torch.no_grad():
                    evaluated.append(_loss(model, _inputs(rank, step, 7)).item())
                model.train()
            loss = _loss(model, _inputs(rank, step))
            loss.backward()
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        out[lib] = {"evaluated": evaluated, "losses": losses, "params": _shards(model)}
    return out


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "hook_counts": (post_acc_hook_counts, {}),
    "hook_counts_hsdp": (post_acc_hook_counts, {"hsdp": True, "min_world": 4}),
    "hook_optim": (post_acc_hook_optim, {}),
    "hook_optim_offload": (post_acc_hook_optim, {"offload": True}),
    "hook_optim_bf16": (post_acc_hook_optim, {"mp": True}),
    "hook_optim_accumulate": (post_acc_hook_optim, {"accumulate": True}),
    "hook_optim_hsdp": (post_acc_hook_optim, {"hsdp": True, "min_world": 4}),
    "to_float64": (to_float64, {}),
    "to_float64_no_swap": (to_float64, {"swap": False}),
    "state_dict_after_forward": (state_dict_after_forward, {}),
    "load_assign": (load_assign, {}),
    "param_dtype_override": (param_dtype_override, {}),
    "meta_init": (meta_init, {}),
    "chunked_loss": (chunked_loss, {}),
    "group_of_two": (group_of_two, {}),
    "called_twice": (called_twice, {"hsdp": False}),
    "called_twice_hsdp": (called_twice, {"hsdp": True}),
    "called_twice_group_hsdp": (called_twice, {"hsdp": True, "group": True}),
    "custom_comms": (api_setting, {"setting": "custom_comms"}),
    "divide_factor": (api_setting, {"setting": "divide_factor"}),
    "separate_rs_group": (api_setting, {"setting": "separate_rs_group"}),
    "pg_alloc": (api_setting, {"setting": "pg_alloc"}),
    "unused_params": (unused_params, {}),
    "reset_in_forward": (reset_iter_state, {"where": "forward"}),
    "reset_in_backward": (reset_iter_state, {"where": "backward"}),
    "share_comm_ctx": (shared_comm_ctx, {}),
    "symm_mem_cpu": (symm_mem_on_cpu, {}),
    "checkpoint_wrapper": (checkpoint_wrapped, {}),
    "jvp": (forward_ad, {}),
    "jvp_reshard": (forward_ad, {"reshard_after_forward": True}),
    "jvp_outside_input": (jvp_of_outside_input, {}),
    "containers": (containers, {}),
    "containers_bf16": (containers, {"mp": True}),
    "after_checkpoint": (second_model, {}),
    "after_exception": (second_model, {"first": "exception"}),
    "trainable_set": (trainable_set_changes, {}),
    "trainable_set_after_eval": (trainable_set_after_eval, {}),
    "trainable_set_after_eval_keep": (trainable_set_after_eval, {"keep": True}),
    "trainable_set_pending_graph": (trainable_set_change_with_pending_graph, {}),
    "trainable_set_bf16": (trainable_set_changes, {"form": "bf16"}),
    "trainable_set_keep": (trainable_set_changes, {"form": "keep"}),
    "trainable_set_keep_grads": (trainable_set_changes, {"form": "keep_grads"}),
    "trainable_set_offload": (trainable_set_changes, {"form": "offload"}),
    "trainable_set_accumulate": (trainable_set_changes, {"form": "accumulate"}),
    "trainable_set_flat": (trainable_set_changes, {"form": "flat"}),
    "trainable_set_flat_sgd": (trainable_set_changes, {"form": "flat_sgd"}),
    "trainable_set_keep_storage": (trainable_set_changes, {"form": "keep_storage"}),
    "trainable_set_mid_accumulation": (trainable_set_change_mid_accumulation, {}),
    "inference_first": (inference_first, {}),
    "inference_first_bf16": (inference_first, {"form": "bf16"}),
    "inference_first_keep": (inference_first, {"form": "keep"}),
    "inference_first_reshard_2": (inference_first, {"form": "reshard_2", "min_world": 4}),
    "inference_first_offload": (inference_first, {"form": "offload"}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
