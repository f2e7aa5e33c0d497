"""A prototype, not part of the package: ``reshard_after_forward=True`` under
``torch.compile(fullgraph=True)``, the all-gather and the copy-out recomputed in
backward instead of the unsharded parameters saved (issue 17, level 2; see
README.md). Two fully sharded ``nn.Linear`` groups, planned by fsdp-rs, on 2
gloo ranks:

    PYTHONPATH=python python tools/fullgraph_spike/recompute.py [inductor]

- ``unshard``: this rank's row -> ``funcol.all_gather_tensor_autograd`` (its
  backward is the reduce-scatter, a sum) -> ``fsdp_rs_spike::copy_out``, a
  functional op over ``torch.ops.fsdp_rs.all_gather_copy_out`` whose autograd
  formula is ``torch.ops.fsdp_rs.reduce_scatter_copy_in_flat`` (dividing by W
  before the sum).
- With ``reshard_after_forward``, ``unshard`` runs in ``torch.utils.checkpoint``
  with a selective policy: the all-gather, its wait and the copy-out
  ``MUST_RECOMPUTE``, everything else ``MUST_SAVE`` (SimpleFSDP's policy),
  partitioned by AOT's min-cut partitioner (``aot_eager``'s and inductor's).
- Checks, per setting: compiled equals the same code run eagerly, bit for
  bit, over 2 steps (with ``inductor``: within 1e-6, and no graph listing);
  the gradients match an unsharded model's; and the graphs:
  with resharding the backward re-runs the all-gather and the copy-out and the
  forward saves no unsharded weight, without it the forward saves them.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

W = 2


@torch.library.custom_op("fsdp_rs_spike::copy_out", mutates_args=())
def copy_out(
    ag: torch.Tensor,
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    unsharded_numel: int,
) -> torch.Tensor:
    out = ag.new_zeros(unsharded_numel)  # alignment gaps stay zero
    torch.ops.fsdp_rs.all_gather_copy_out(
        ag, [out], row_offsets, unsharded_offsets, padded, tile_param, tile_start, tile_len
    )
    return out


@copy_out.register_fake
def _(ag, row_offsets, unsharded_offsets, padded, tile_param, tile_start, tile_len, numel):
    return ag.new_empty(numel)


def _setup(ctx, inputs, output) -> None:
    ctx.tables = inputs[1:7]
    ctx.ag_shape = inputs[0].shape


def _backward(ctx, grad):
    rs_in = grad.new_empty(ctx.ag_shape)
    torch.ops.fsdp_rs.reduce_scatter_copy_in_flat(grad, rs_in, *ctx.tables, float(W))
    return (rs_in, *([None] * 7))


copy_out.register_autograd(_backward, setup_context=_setup)

RECOMPUTED = {
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops.fsdp_rs_spike.copy_out.default,
}


def _policy():
    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE if func in RECOMPUTED else CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


class Group:
    """One module's parameters, planned by fsdp-rs: a flat row per rank (the
    leaf the optimizer steps), unsharded for each forward by the hooks."""

    def __init__(self, module: nn.Module, pg, rank: int, reshard: bool) -> None:
        from fsdp_rs.planning import plan_group, shapes_to_arrays

        self.names = [n for n, _ in module.named_parameters()]
        full = [p.detach() for p in module.parameters()]
        self.shapes = [p.shape for p in full]
        plan = plan_group(*shapes_to_arrays(self.shapes), W, rank)
        tables = ("row_offsets", "unsharded_offsets", "padded_sharded_numel",
                  "tile_param", "tile_start", "tile_len")  # fmt: skip
        self.tables = [torch.from_numpy(np.array(getattr(plan, t))) for t in tables]
        self.unsharded_offsets = plan.unsharded_offsets.tolist()
        self.unsharded_numel = plan.unsharded_numel
        self.pg, self.reshard = pg, reshard
        # this rank's row: its chunk of each parameter at the planned offsets
        row = torch.zeros(plan.row_numel)
        for p, r, n in zip(full, plan.row_offsets.tolist(), plan.sharded_numel.tolist(),
                           strict=True):  # fmt: skip
            row[r : r + n] = p.reshape(p.shape[0], -1).chunk(W)[rank].reshape(-1)
        self.row = nn.Parameter(row)
        for name in self.names:
            del module._parameters[name]
        module.register_parameter("fsdp_row", self.row)
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward)

    def _unshard(self, row: torch.Tensor) -> torch.Tensor:
        ag = funcol.all_gather_tensor_autograd(row, 0, self.pg).view(W, -1)
        return copy_out(ag, *self.tables, self.unsharded_numel)

    def pre_forward(self, module, args) -> None:
        if self.reshard:
            flat = checkpoint(self._unshard, self.row, use_reentrant=False, context_fn=_policy)
        else:
            flat = self._unshard(self.row)
        for name, u, shape in zip(self.names, self.unsharded_offsets, self.shapes, strict=True):
            module._parameters[name] = flat[u : u + shape.numel()].view(shape)

    def post_forward(self, module, args, output) -> None:
        for name in self.names:
            del module._parameters[name]


def _backend(graphs: list):
    """aot_eager with the min-cut partitioner, recording per graph the
    collectives and copies it runs and the numels of the tensors the forward
    saves for backward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def record(kind):
        def compiler(gm, inputs):
            ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                   and any(k in str(n.target) for k in ("c10d", "fsdp_rs"))]  # fmt: skip
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            saved = [a.meta["val"].numel() for a in out if hasattr(a, "meta") and "val" in a.meta]
            graphs.append((kind, ops, saved))
            return gm

        return compiler

    return aot_autograd(
        fw_compiler=record("forward"),
        bw_compiler=record("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )


def _run(rank: int, reshard: bool, inductor: bool) -> bool:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.Linear(8, 5)]
    full = [[p.detach().clone() for p in layer.parameters()] for layer in layers]
    groups = [Group(layer, dist.group.WORLD, rank, reshard) for layer in layers]
    model = nn.Sequential(layers[0], nn.ReLU(), layers[1])
    torch.manual_seed(1)
    xs = [torch.randn(3, 6, requires_grad=True) for _ in range(W)]

    def step(fn):
        loss = fn(xs[rank]).sum()
        loss.backward()
        grads = [g.row.grad.clone() for g in groups]
        for g in groups:
            g.row.grad = None
        return loss.detach(), grads

    eager = step(model)
    graphs: list = []
    backend = "inductor" if inductor else _backend(graphs)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    runs = [step(compiled), step(compiled)]
    equal = (lambda a, b: torch.allclose(a, b, atol=1e-6)) if inductor else torch.equal
    same = all(equal(eager[0], r[0]) and all(map(equal, eager[1], r[1])) for r in runs)
    # unsharded reference: mean over ranks of the gradients, this rank's rows
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    with torch.no_grad():
        for p, f in zip(ref.parameters(), [t for ts in full for t in ts], strict=True):
            p.copy_(f)
    for x in xs:
        ref(x.detach()).sum().backward()
    close = True
    for group, layer in zip(groups, (ref[0], ref[2]), strict=True):
        grad = torch.zeros(group.unsharded_numel)
        for p, u in zip(layer.parameters(), group.unsharded_offsets, strict=True):
            grad[u : u + p.numel()] = p.grad.reshape(-1) / W
        rs_in = torch.empty(W, group.row.numel())
        torch.ops.fsdp_rs.reduce_scatter_copy_in_flat(grad, rs_in, *group.tables, 1.0)
        close &= torch.allclose(eager[1][groups.index(group)], rs_in[rank], atol=1e-6)
    if inductor:
        if rank == 0:
            print(f"inductor, reshard_after_forward={reshard}: compiled vs eager within 1e-6 "
                  f"(2 steps)={same}, vs unsharded allclose={close}")  # fmt: skip
        return same and close
    forward = next(g for g in graphs if g[0] == "forward")
    backward = next(g for g in graphs if g[0] == "backward")
    # the unsharded weights (48 and 40 elements; no activation here has as many)
    weights = {shape.numel() for g in groups for shape in g.shapes if len(shape) > 1}
    regathers = sum("all_gather" in op for op in backward[1])
    saves_unsharded = any(n in weights for n in forward[2])
    graphs_ok = (
        (regathers > 0 and not saves_unsharded) if reshard else (regathers == 0 and saves_unsharded)
    )
    if rank == 0:
        print(
            f"reshard_after_forward={reshard}: compiled vs eager bitwise (2 steps)={same}, "
            f"vs unsharded allclose={close}, all-gathers in backward={regathers}, "
            f"forward saves an unsharded weight={saves_unsharded}"
        )
        for kind, ops, saved in graphs:
            print(f"  {kind}: {ops}")
            if kind == "forward":
                print(f"    saved for backward (numels): {saved}")
    return same and close and graphs_ok


def _worker(rank: int, port: int, inductor: bool) -> None:
    import fsdp_rs.ops  # noqa: F401  (registers torch.ops.fsdp_rs)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=W)
    ok = all([_run(rank, reshard, inductor) for reshard in (True, False)])
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # past gloo's teardown ([Note: Leaving a spawned rank])


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_worker, args=(free, sys.argv[1:] == ["inductor"]), nprocs=W)
