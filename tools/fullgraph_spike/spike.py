"""A prototype, not part of the package: one fully sharded ``nn.Linear`` trained
under ``torch.compile(model, fullgraph=True)`` with its all-gather and
reduce-scatter in the graph as functional collectives and its copies as
``torch.ops.fsdp_rs`` ops (issue 17, level 2). See README.md for what it shows
and what the runtime still lacks.

    PYTHONPATH=python python tools/fullgraph_spike/spike.py      # 2 gloo ranks
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

W = 2


class Unshard(torch.autograd.Function):
    """Sharded locals -> unsharded parameters; backward: gradients -> reduced
    sharded gradients (sum, then divided by W, as FSDP2's default mean)."""

    @staticmethod
    def forward(ctx, group, *locals_):
        ctx.group = group
        # this rank's row as planned (the runtime's sharded buffer already is one)
        ag_in = locals_[0].new_zeros(group.row_numel)
        for t, r in zip(locals_, group.row_offsets, strict=True):
            ag_in[r : r + t.numel()] = t.reshape(-1)
        ag = funcol.all_gather_tensor(ag_in, 0, group.pg).view(W, group.row_numel)
        out = ag_in.new_empty(group.unsharded_numel)
        torch.ops.fsdp_rs.all_gather_copy_out(ag, [out], *group.copy_out)
        return tuple(
            out[u : u + numel].view(shape)
            for u, numel, shape in zip(
                group.unsharded_offsets, group.numels, group.shapes, strict=True
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        g = ctx.group
        rs_in = grads[0].new_empty(W, g.row_numel)
        row_offsets, _, padded, tile_param, tile_start, tile_len = g.copy_out
        torch.ops.fsdp_rs.reduce_scatter_copy_in(
            list(grads), rs_in, row_offsets, padded, tile_param, tile_start, tile_len, 1.0
        )
        rs = funcol.reduce_scatter_tensor(rs_in.view(-1), "sum", 0, g.pg)
        out = torch.empty_like(rs)
        torch.ops.fsdp_rs.post_reduce(rs, out, float(W), False)
        shards = [s.chunk(W)[g.rank] for s in map(torch.empty, g.shapes)]
        pairs = zip(g.row_offsets, shards, strict=True)
        views = (out[r : r + s.numel()].view(s.shape) for r, s in pairs)
        return (None, *views)


class Group:
    """The plan of one module's parameters, as the traced hooks read it."""

    def __init__(self, module: nn.Module, mesh, rank: int) -> None:
        from fsdp_rs.planning import plan_group, shapes_to_arrays

        self.names = [n for n, _ in module.named_parameters()]
        full = [p.detach() for p in module.parameters()]
        self.shapes = [p.shape for p in full]
        self.numels = [p.numel() for p in full]
        plan = plan_group(*shapes_to_arrays(self.shapes), W, rank, orig_elem_size=4,
                          param_elem_size=4, reduce_elem_size=4)  # fmt: skip
        tables = ("row_offsets", "unsharded_offsets", "padded_sharded_numel",
                  "tile_param", "tile_start", "tile_len")  # fmt: skip
        self.copy_out = [torch.from_numpy(np.array(getattr(plan, t))) for t in tables]
        self.row_offsets = plan.row_offsets.tolist()
        self.unsharded_offsets = plan.unsharded_offsets.tolist()
        self.row_numel, self.unsharded_numel = plan.row_numel, plan.unsharded_numel
        self.pg, self.rank = mesh.get_group(), rank
        self.sharded = [
            nn.Parameter(DTensor.from_local(p.chunk(W)[rank].clone(), mesh, [Shard(0)]))
            for p in full
        ]
        for name, param in zip(self.names, self.sharded, strict=True):
            module._parameters[name] = param
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward)

    def pre_forward(self, module, args) -> None:
        unsharded = Unshard.apply(self, *(p.to_local() for p in self.sharded))
        for name, tensor in zip(self.names, unsharded, strict=True):
            module._parameters[name] = tensor

    def post_forward(self, module, args, output) -> None:
        for name, param in zip(self.names, self.sharded, strict=True):
            module._parameters[name] = param


def _graph_ops(graphs: list):
    """A backend that records, per captured forward and backward graph, its
    collectives and the fsdp_rs ops (auto-functionalized ones by their op)."""
    from torch._dynamo.backends.common import aot_autograd

    def record(kind):
        def compiler(gm, _inputs):
            ops = []
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
                if "fsdp_rs" in str(target) or "c10d" in str(target):
                    ops.append(str(target))
            graphs.append((kind, ops))
            return gm

        return compiler

    return aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))


def _worker(rank: int, port: int) -> None:
    import fsdp_rs.ops  # noqa: F401  (registers torch.ops.fsdp_rs)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=W)
    mesh = init_device_mesh("cpu", (W,))
    torch.manual_seed(0)
    layer = nn.Linear(4, 8)
    full = [p.detach().clone() for p in layer.parameters()]
    group = Group(layer, mesh, rank)
    model = nn.Sequential(layer, nn.ReLU())
    torch.manual_seed(1)
    xs = [torch.randn(3, 4) for _ in range(W)]

    def step(fn):
        loss = fn(xs[rank]).sum()
        loss.backward()
        grads = [p.grad.to_local().clone() for p in group.sharded]
        for p in group.sharded:
            p.grad = None
        return loss.detach(), grads

    # the unsharded reference: each rank's gradient, averaged, this rank's rows
    ref = nn.Linear(4, 8)
    with torch.no_grad():
        for p, f in zip(ref.parameters(), full, strict=True):
            p.copy_(f)
    total = [torch.zeros_like(f) for f in full]
    for x in xs:
        ref.zero_grad()
        torch.relu(ref(x)).sum().backward()
        for acc, p in zip(total, ref.parameters(), strict=True):
            acc += p.grad
    expected = [(acc / W).chunk(W)[rank] for acc in total]

    eager = step(model)
    graphs: list = []
    compiled = torch.compile(model, fullgraph=True, backend=_graph_ops(graphs))
    first, second = step(compiled), step(compiled)
    same = all(
        torch.equal(eager[0], run[0]) and all(map(torch.equal, eager[1], run[1]))
        for run in (first, second)
    )
    close = all(map(torch.allclose, eager[1], expected))
    back = all(a is b for a, b in zip(layer.parameters(), group.sharded, strict=True))
    print(
        f"rank {rank}: eager vs unsharded allclose={close}, compiled vs eager bitwise "
        f"(2 steps)={same}, sharded parameters restored={back}, graphs={len(graphs)}"
    )
    if rank == 0:
        for kind, ops in graphs:
            print(f"  {kind}: {ops}")
    dist.destroy_process_group()
    if not (close and same and back):
        sys.exit(1)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_worker, args=(free,), nprocs=W)
