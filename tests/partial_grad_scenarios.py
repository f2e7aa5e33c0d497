"""Parameters that get a gradient on some ranks only, trained under real gloo
collectives by spawned processes.

A small mixture-of-experts model whose layers run only the experts their tokens
were routed to (as Hugging Face's Mixtral and Qwen3-MoE blocks do), with top-1
routing steered by rank-dependent inputs, so that the set of expert parameters
that get a gradient differs per rank:

- expert 0: every rank, every step;
- expert 1: rank 0 only;
- expert 2: every rank but rank 0;
- expert 3: one rank per step (``step % W``), and with gradient accumulation
  only in the first micro-step;
- expert 4: no rank, ever.

Each scenario trains it with fsdp-rs and, in the same process, an unsharded
reference on all ranks' data (the mean of the per-rank mean losses, missing
gradients counting as zero) and, for some, ``DistributedDataParallel(
find_unused_parameters=True)``. After every backward it records the largest
gradient difference and which parameters have no ``.grad``; at the end, the
largest parameter difference.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from spawned import finish, write_results

STEPS = 5
DIM, HIDDEN, EXPERTS, TOKENS = 8, 12, 5, 8
HINT = 4.0  # added to the chosen expert's router logit: top-1 follows the data
UNUSED = 4  # the expert no rank routes to


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
            for _ in range(EXPERTS)
        )
        with torch.no_grad():
            self.router.weight.mul_(0.1)  # |logits| << HINT: the hint decides top-1

    def forward(self, x: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        probs = (self.router(x) + hint).softmax(-1)
        weight, expert = probs.max(-1)
        out = torch.zeros_like(x)
        for e in expert.unique().tolist():  # only the experts that got tokens
            idx = (expert == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, weight[idx, None] * self.experts[e](x[idx]))
        return x + out


class Net(nn.Module):
    def __init__(self, aux: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([MoE(), MoE()])
        self.aux_at = aux  # the aux module reads the input of layer aux_at (2: the output)
        self.aux = nn.Linear(DIM, DIM) if aux is not None else None
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, hint: torch.Tensor, use_aux: bool = False):
        h = self.inp(x)
        a = None
        for i, layer in enumerate(self.layers):
            if i == self.aux_at:
                a = self.aux(h)  # runs on every rank
            h = layer(h, hint)
        if self.aux_at == len(self.layers):
            a = self.aux(h)
        loss = self.out(h).pow(2).mean()
        if use_aux:  # ... but reaches the loss on some ranks only
            loss = loss + a.pow(2).mean()
        return loss


def experts_of(rank: int, world_size: int, step: int, micro: int) -> list[int]:
    used = [0, 1 if rank == 0 else 2]
    if rank == step % world_size and micro == 0:
        used.append(3)
    return used


def data(rank: int, world_size: int, step: int, micro: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(TOKENS, DIM, generator=g)
    used = experts_of(rank, world_size, step, micro)
    choice = torch.tensor([used[t % len(used)] for t in range(TOKENS)])
    hint = nn.functional.one_hot(choice, EXPERTS).float() * HINT
    return x, hint


SCENARIOS: dict[str, dict] = {
    "fp32": {"ddp": True},
    "list_path": {"list_path": True},  # the per-gradient path (the accelerator default)
    "no_reshard": {"kwargs": {"reshard_after_forward": False}},
    "reshard_int": {"kwargs": {"reshard_after_forward": 2}, "min_world": 4},
    "accumulate": {"micro": 4},
    "accumulate_list_path": {"micro": 4, "list_path": True},
    "hsdp": {"hsdp": True, "min_world": 4},
    "hsdp_accumulate_no_all_reduce": {"hsdp": True, "micro": 4, "no_all_reduce": True,
                                      "min_world": 4},
    "bf16": {"mp": True},
    "offload": {"offload": True},
    # a fully_shard module whose output reaches the loss on rank 0 only, placed
    # between the layers, before the first and after the last
    "unused_output": {"aux": 1},
    "unused_output_first": {"aux": 0},
    "unused_output_last": {"aux": 2},
    "unused_output_no_reshard": {"aux": 1, "kwargs": {"reshard_after_forward": False}},
    "unused_output_list_path": {"aux": 1, "list_path": True},
    "unused_output_accumulate": {"aux": 1, "micro": 4},
}  # fmt: skip


def _build(spec: dict) -> Net:
    torch.manual_seed(0)
    return Net(aux=spec.get("aux"))


def _shard(model: Net, spec: dict, world_size: int) -> None:
    import fsdp_rs
    from fsdp_rs import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = dict(spec.get("kwargs", {}))
    if spec.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if spec.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    # An explicit CPU mesh: the default one is on the GPU whenever one is present.
    if spec.get("hsdp"):
        kwargs["mesh"] = init_device_mesh(
            "cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")
        )
    else:
        kwargs["mesh"] = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fsdp_rs.fully_shard(layer, **kwargs)
    if model.aux is not None:
        fsdp_rs.fully_shard(model.aux, **kwargs)
    fsdp_rs.fully_shard(model, **kwargs)
    if spec.get("list_path"):
        for module in model.modules():
            state = getattr(module, "_fsdp_rs_state", None)
            if state is not None and state.group is not None:
                state.group.preplace_grads = False


def _reference_grads(ref: Net, spec: dict, world_size: int, step: int) -> None:
    """Unsharded gradients of the mean over ranks of their losses, summed over
    micro-steps; with ``mp``, each rank's gradients are computed by a bf16 copy,
    cast to fp32 and averaged in fp32 (FSDP2's mixed precision)."""
    micro = spec.get("micro", 1)
    for r in range(world_size):
        for k in range(micro):
            x, hint = data(r, world_size, step, k)
            use_aux = spec.get("aux") is not None and r == 0
            if not spec.get("mp"):
                (ref(x, hint, use_aux) / world_size).backward()
                continue
            low = _build(spec)
            low.load_state_dict(ref.state_dict())
            low.to(torch.bfloat16)
            low(x.bfloat16(), hint.bfloat16(), use_aux).backward()
            for p, q in zip(ref.parameters(), low.parameters(), strict=True):
                if q.grad is not None:
                    g = q.grad.float() / world_size
                    p.grad = g if p.grad is None else p.grad + g


def _local(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's shard of ``full`` as ``like`` (a DTensor) holds it; no collective
    (the .grad sets may differ between ranks when the code under test is wrong)."""
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, like.device_mesh, like.placements
    )
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


def _max_diff(grads: dict, expected: dict) -> float:
    diff = 0.0
    for n, g in grads.items():
        if g is not None and expected[n] is not None:
            local = g.to_local()
            want = _local(expected[n], g).to(local.device)
            diff = max(diff, (local - want).abs().max().item() if local.numel() else 0.0)
    return diff


def run(spec: dict, world_size: int, rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model, ref = _build(spec), _build(spec)
    names = [n for n, _ in ref.named_parameters()]
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    _shard(model, spec, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ddp = ddp_opt = None
    if spec.get("ddp"):
        ddp = DistributedDataParallel(_build(spec), find_unused_parameters=True)
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    micro = spec.get("micro", 1)
    record: dict = {"grad_diff": [], "ddp_grad_diff": [], "no_grad": [], "ref_no_grad": []}
    for step in range(STEPS):
        for k in range(micro):
            last = k == micro - 1
            if spec.get("no_all_reduce"):
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            x, hint = data(rank, world_size, step, k)
            use_aux = spec.get("aux") is not None and rank == 0
            model(x, hint, use_aux).backward()
            if ddp is not None:
                ddp(x, hint, use_aux).backward()
        _reference_grads(ref, spec, world_size, step)
        grads = {n: p.grad for n, p in model.named_parameters()}
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        record["no_grad"].append([n for n in names if grads[n] is None])
        record["ref_no_grad"].append([n for n in names if ref_grads[n] is None])
        record["grad_diff"].append(_max_diff(grads, ref_grads))
        if ddp is not None:
            ddp_grads = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
            record.setdefault("ddp_no_grad", []).append([n for n in names if ddp_grads[n] is None])
            record["ddp_grad_diff"].append(_max_diff(grads, ddp_grads))
            ddp_opt.step()
            ddp_opt.zero_grad()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    final = {n: p.full_tensor() for n, p in model.named_parameters()}
    ref_final = dict(ref.named_parameters())
    record["param_diff"] = max((final[n] - ref_final[n]).abs().max().item() for n in names)
    record["unused_unchanged"] = [
        torch.equal(final[n], initial[n]) for n in names if f"experts.{UNUSED}." in n
    ]
    if ddp is not None:
        ddp_final = {n.removeprefix("module."): p for n, p in ddp.named_parameters()}
        record["ddp_param_diff"] = max((final[n] - ddp_final[n]).abs().max().item() for n in names)
    return record


def worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A bounded timeout: a collective paired wrongly across ranks fails, never hangs.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for name in names:
        try:
            results[name] = run(SCENARIOS[name], world_size, rank)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            write_results(out_dir, rank, results)
            raise  # the other ranks may be waiting in a collective: end the spawn
        dist.barrier()
    finish(out_dir, rank, results)


__all__: list[Callable | str] = ["SCENARIOS", "run", "worker"]
