"""Misuse that torch FSDP2 lets pass silently, run on spawned gloo ranks: what
fsdp-rs raises (each rank's message, to compare across ranks), and where it
trains, fsdp-rs and FSDP2 side by side on the same data (``test_misuse.py``).

- an optimizer built before ``fully_shard`` holds the replaced parameters;
- a backward that raised midway, then normal steps without ``reset_iter_state``;
- setters and ``fully_shard`` arguments of the wrong type;
- a ``MixedPrecisionPolicy`` whose dtypes cannot be computed in;
- complex parameters (trained), complex and real ones in one group (refused);
- the root sharded before its children.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_rs
from fsdp_rs.optim import FlatOptimizer
from scenario_common import DIM, LIBS, _inputs, _mesh
from spawned import run_named

STEPS = 3


def _net(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 2 * DIM, dtype=dtype), nn.Tanh(), nn.Linear(2 * DIM, DIM, dtype=dtype)
    )


def _sharded(lib: str, model: nn.Sequential, mesh, **kwargs) -> nn.Sequential:
    LIBS[lib](model[0], mesh=mesh, **kwargs)
    LIBS[lib](model[2], mesh=mesh, **kwargs)
    return LIBS[lib](model, mesh=mesh, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _values(t: torch.Tensor) -> list[float]:
    """``t``'s local shard as floats (a complex one as its real and imaginary
    parts): JSON keeps every float bit for bit."""
    t = _local(t).detach()
    return (torch.view_as_real(t) if t.is_complex() else t).flatten().tolist()


def _shards(model: nn.Module) -> dict[str, list[float]]:
    return {n: _values(p) for n, p in model.named_parameters()}


def _grads(named: dict[str, torch.Tensor]) -> dict[str, list[float] | None]:
    return {n: None if p.grad is None else _values(p.grad) for n, p in named.items()}


def _error(fn) -> str | None:
    """``fn()``'s exception as ``"Type: message"``, or None."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------- 1: optimizers


def optimizer_before_shard(world_size: int, rank: int) -> dict:
    """An optimizer (torch's AdamW, fsdp-rs's FlatOptimizer) built before
    ``fully_shard``: its first step raises, and its second again; one built
    after steps, and so does one that has nothing to do with fsdp-rs."""
    mesh = _mesh(world_size, False)
    out: dict = {}
    for kind in ("adamw", "flat"):
        model = _net()
        if kind == "adamw":
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            optim = FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        _sharded("rs", model, mesh)
        before = _shards(model)
        model(_inputs(rank, 0)).pow(2).mean().backward()
        out[f"{kind}_first"] = _error(optim.step)
        out[f"{kind}_second"] = _error(optim.step)
        out[f"{kind}_unchanged"] = _shards(model) == before
    model = _sharded("rs", _net(), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _shards(model)
    model(_inputs(rank, 0)).pow(2).mean().backward()
    out["after"] = _error(optim.step)
    out["after_changed"] = _shards(model) != before
    # [Note: Optimizers built before fully_shard] checked once: marked
    out["after_marked"] = bool(vars(optim).get("_fsdp_rs_checked"))
    plain = nn.Linear(3, 3)
    other = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.ones(1, 3)).sum().backward()
    out["unrelated"] = _error(other.step)
    return out


# --------------------------------------------------- 2: a backward that raised


class _Raise(nn.Module):
    """The identity, whose backward raises while ``armed`` (a user's hook or
    loss that raised mid-backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            x.register_hook(_raise)
        return x


def _raise(grad: torch.Tensor) -> None:
    raise ValueError("a hook raised during backward")


def _net_with_raise() -> nn.Sequential:
    model = _net()
    return nn.Sequential(model[0], model[1], _Raise(), model[2])


def aborted_backward(world_size: int, rank: int, how: str) -> dict:
    """At step 0 a backward raises midway and the caller catches it: ``how`` =
    "twice" (the step's second ``backward()``, through the freed graph: the
    step's gradients came from the first and are stepped), or "hook" (a hook
    between the two layers raises, after the last layer's group reduced: the
    caller zeroes the gradients and skips the step). Then normal steps, with no
    ``reset_iter_state()``. FSDP2's reference runs the same steps without the
    error (FSDP2 needs ``reset_iter_state()`` to recover)."""
    mesh = _mesh(world_size, False)
    out: dict = {}
    for lib in LIBS:
        model = _net_with_raise()
        LIBS[lib](model[0], mesh=mesh)
        LIBS[lib](model[3], mesh=mesh)
        LIBS[lib](model, mesh=mesh)
        sharded = dict(model.named_parameters())  # what the optimizer steps
        optim = torch.optim.AdamW(sharded.values(), lr=1e-2)
        losses, grads, raised = [], [], None
        for step in range(STEPS + 1):
            fails = lib == "rs" and step == 0
            model[2].armed = fails and how == "hook"
            # no saved tensor between the loss and the model's output: a second
            # backward() reaches the model before it fails
            loss = model(_inputs(rank, step)).mean()
            losses.append(loss.item())
            if fails and how == "hook":
                raised = _error(loss.backward)
                optim.zero_grad()
                continue
            if lib == "torch" and step == 0 and how == "hook":  # the same step, no error
                loss.backward()
                optim.zero_grad()
                continue
            loss.backward()
            if fails:
                raised = _error(loss.backward)
            grads.append(_grads(sharded))
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "grads": grads, "params": _shards(model), "raised": raised}
    return out


# ------------------------------------------------------- 3: argument types


def argument_types(world_size: int, rank: int) -> dict:
    """Each setter and ``fully_shard`` argument given a value of the wrong type:
    the error; then the values FSDP2 takes, which fsdp-rs must take too."""
    mesh = _mesh(world_size, False)
    model = _sharded("rs", _net(), mesh)
    calls = {
        "set_requires_gradient_sync": lambda: model.set_requires_gradient_sync("False"),
        "set_requires_gradient_sync_recurse": lambda: model.set_requires_gradient_sync(
            False, recurse=None
        ),
        "set_requires_all_reduce": lambda: model.set_requires_all_reduce(1),
        "set_reshard_after_forward": lambda: model.set_reshard_after_forward(2),
        "set_reshard_after_backward": lambda: model.set_reshard_after_backward("yes"),
        "set_is_last_backward": lambda: model.set_is_last_backward(0),
        "set_unshard_in_backward": lambda: model.set_unshard_in_backward(None),
        "set_force_sum_reduction_for_comms": lambda: model.set_force_sum_reduction_for_comms(1),
        "set_reduce_scatter_unused_params": lambda: model.set_reduce_scatter_unused_params("no"),
        "set_separate_reduce_scatter_group": lambda: model.set_separate_reduce_scatter_group("no"),
        "set_allocate_memory_from_process_group_for_comm": (
            lambda: model.set_allocate_memory_from_process_group_for_comm(1)
        ),
        "set_gradient_divide_factor": lambda: model.set_gradient_divide_factor("2"),
        "set_reduce_scatter_max_input_buffers": (
            lambda: model.set_reduce_scatter_max_input_buffers(2.0)
        ),
        "set_keep_unsharded_storage": lambda: model.set_keep_unsharded_storage(1),
        "set_manual_backward_finalization": lambda: model.set_manual_backward_finalization(1),
        "fully_shard_reshard_after_forward": lambda: fsdp_rs.fully_shard(
            _net(), mesh=mesh, reshard_after_forward="True"
        ),
        "fully_shard_reshard_after_forward_float": lambda: fsdp_rs.fully_shard(
            _net(), mesh=mesh, reshard_after_forward=2.0
        ),
        "fully_shard_mp_policy": lambda: fsdp_rs.fully_shard(
            _net(), mesh=mesh, mp_policy=torch.bfloat16
        ),
        "fully_shard_offload_policy": lambda: fsdp_rs.fully_shard(
            _net(), mesh=mesh, offload_policy="cpu"
        ),
        "fully_shard_pin_memory": lambda: fsdp_rs.fully_shard(
            _net(), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory="no")
        ),
        "fully_shard_cast_forward_inputs": lambda: fsdp_rs.fully_shard(
            _net(), mesh=mesh, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=1)
        ),
    }
    errors = {name: _error(call) for name, call in calls.items()}

    def accepted() -> None:
        m = _sharded("rs", _net(), mesh, reshard_after_forward=True)
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_requires_gradient_sync(True)
        m.set_requires_all_reduce(True)
        m.set_reshard_after_forward(False, recurse=True)
        m.set_reshard_after_backward(True)
        m.set_is_last_backward(True)
        m.set_unshard_in_backward(True)
        m.set_force_sum_reduction_for_comms(False)
        m.set_reduce_scatter_unused_params(False)
        m.set_gradient_divide_factor(2)
        m.set_gradient_divide_factor(float(world_size))
        m.set_reduce_scatter_max_input_buffers(2)
        fsdp_rs.fully_shard(_net(), mesh=mesh, reshard_after_forward=1)
        fsdp_rs.fully_shard(_net(), mesh=mesh, reshard_after_forward=None)
        fsdp_rs.fully_shard(_net(), mesh=mesh, offload_policy=None)  # FSDP2: no offload
        m(_inputs(rank, 0)).sum().backward()

    return {"errors": errors, "accepted": _error(accepted)}


# ------------------------------------------------ 4: mixed precision dtypes


def policy_dtypes(world_size: int, rank: int) -> dict:
    """A ``MixedPrecisionPolicy`` with a dtype fsdp-rs cannot compute or reduce
    in: the error ``fully_shard`` raises (before any forward)."""
    mesh = _mesh(world_size, False)
    policies = {
        "param_int64": MixedPrecisionPolicy(param_dtype=torch.int64),
        "param_str": MixedPrecisionPolicy(param_dtype="bfloat16"),
        "param_complex": MixedPrecisionPolicy(param_dtype=torch.complex64),
        "reduce_int32": MixedPrecisionPolicy(reduce_dtype=torch.int32),
        "reduce_bool": MixedPrecisionPolicy(torch.bfloat16, torch.bool),
        "output_int8": MixedPrecisionPolicy(output_dtype=torch.int8),
    }
    out = {}
    for name, policy in policies.items():
        model = _net()
        out[name] = _error(lambda p=policy, m=model: fsdp_rs.fully_shard(m, mesh=mesh, mp_policy=p))
    # a real reduce dtype cannot hold complex gradients
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = _Complex(torch.complex64)
    out["reduce_real_for_complex"] = _error(
        lambda: fsdp_rs.fully_shard(model, mesh=mesh, mp_policy=policy)
    )
    ok = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float16)
    model = _sharded("rs", _net(), mesh, mp_policy=ok)
    out["accepted"] = _error(lambda: model(_inputs(rank, 0)).float().sum().backward())
    return out


# ----------------------------------------------------------- 5: complex


class _Complex(nn.Module):
    """Complex64 layers (every parameter complex) with a real loss."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(DIM, 2 * DIM, dtype=dtype)
        self.outer = nn.Linear(2 * DIM, DIM, dtype=dtype)
        self.scale = nn.Parameter(torch.randn(DIM, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        h = h * torch.sigmoid(h.abs())
        return self.outer(h) * self.scale


def _complex_inputs(rank: int, step: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    real = _inputs(rank, step, micro)
    return torch.complex(real, real.flip(-1)).to(dtype)


def complex_params(
    world_size: int, rank: int, dtype=torch.complex64, micro: int = 1, factor=None
) -> dict:
    """A model whose parameters are all complex, trained by both libraries:
    ``micro`` backwards per step (the later ones accumulate into ``.grad``),
    ``factor`` a gradient divide factor (pre- and post-divides in the copy-in
    and the post-reduce)."""
    mesh = _mesh(world_size, False)
    out = {}
    for lib in LIBS:
        model = _Complex(dtype)
        LIBS[lib](model.inner, mesh=mesh)
        LIBS[lib](model.outer, mesh=mesh)
        LIBS[lib](model, mesh=mesh)
        if factor is not None:
            for m in (model, model.inner, model.outer):
                m.set_gradient_divide_factor(factor)
        sharded = dict(model.named_parameters())
        optim = torch.optim.AdamW(sharded.values(), lr=1e-2, foreach=False)
        losses, grads = [], []
        for step in range(STEPS):
            for k in range(micro):
                loss = model(_complex_inputs(rank, step, k, dtype)).abs().pow(2).mean()
                loss.backward()
                losses.append(loss.item())
            grads.append(_grads(sharded))
            optim.step()
            optim.zero_grad()
        out[lib] = {"losses": losses, "grads": grads, "params": _shards(model)}
    return out


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.real = nn.Linear(DIM, DIM)
        self.rot = nn.Parameter(torch.ones(DIM, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.real(x) * self.rot).abs()


def complex_with_real(world_size: int, rank: int) -> dict:
    """Complex and real trainable parameters in one ``fully_shard`` call: both
    libraries' errors (FSDP2 raises at the first forward), and the same module
    with the complex parameter frozen, which both take."""
    mesh = _mesh(world_size, False)
    out = {}
    for lib in LIBS:

        def run(frozen: bool, lib=lib) -> None:
            model = _Mixed()
            model.rot.requires_grad_(not frozen)
            LIBS[lib](model, mesh=mesh)
            model(_inputs(rank, 0)).sum().backward()

        out[lib] = _error(lambda run=run: run(False))
        out[f"{lib}_frozen"] = _error(lambda run=run: run(True))
    return out


# ------------------------------------------------------- 6: root first


def root_first(world_size: int, rank: int) -> dict:
    """``fully_shard(model)`` then ``fully_shard(model[0])``: the error."""
    mesh = _mesh(world_size, False)
    model = _net()
    fsdp_rs.fully_shard(model, mesh=mesh)
    return {"message": _error(lambda: fsdp_rs.fully_shard(model[0], mesh=mesh))}


SCENARIOS = {
    "optimizer_before_shard": (optimizer_before_shard, {}),
    "aborted_backward_twice": (aborted_backward, {"how": "twice"}),
    "aborted_backward_hook": (aborted_backward, {"how": "hook"}),
    "argument_types": (argument_types, {}),
    "policy_dtypes": (policy_dtypes, {}),
    "complex_with_real": (complex_with_real, {}),
    "root_first": (root_first, {}),
    # last: a rank that raises ends the spawn, and these raised before issue 53
    "complex": (complex_params, {}),
    "complex_accumulate": (complex_params, {"micro": 2}),
    "complex_divide_factor": (complex_params, {"factor": 3.0}),
    "complex128": (complex_params, {"dtype": torch.complex128}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
