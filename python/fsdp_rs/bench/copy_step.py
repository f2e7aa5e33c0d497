"""``bench copy --steps``: the copy ops with their collectives, as one training
step runs them, against FSDP2's sequence on the same group (issue 18 asks for
these at W = 1 on one GPU, and W = 2 where two are lent).

- ``unshard_step``: fsdp-rs as ``runtime/group/gather.py`` runs it (the cast fused
  into the copy-in, or the sharded row as the all-gather input where there is
  no cast), ``all_gather_into_tensor``, the copy-out into the unsharded buffer;
  FSDP2 as ``_fsdp_collectives`` runs it (``_foreach_copy_`` cast,
  ``fsdp.all_gather_copy_in``, the all-gather in place,
  ``fsdp.split_with_sizes_copy`` into per-parameter outputs).
- ``reduce_step``: from per-parameter gradients (both libraries' input),
  fsdp-rs's reduce-scatter copy-in, ``reduce_scatter_tensor``, and its
  post-reduce where the reduce output is not the gradient already (a cast or a
  division); FSDP2's ``fsdp.chunk_cat``, the reduce-scatter, and its post-reduce
  (division, cast, a view per parameter).

The collectives run on the default process group, which must have
``world_size`` ranks: ``ensure_process_group`` starts a one-rank group in this
process (gloo on CPU, NCCL on CUDA) where none is started. Averages are sums
here on gloo, which has no average; at W = 1 both are the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_rs.bench.copy import (
    Group,
    OpBench,
    _foreach_copy_into_row,
    _same,
    _segments,
    fsdp2_cast_inputs,
    fsdp2_divide_factors,
)

__all__ = ["STEPS", "STEP_BUILDERS", "ensure_process_group"]

STEPS = ("unshard_step", "reduce_step")


def ensure_process_group(device: torch.device, world_size: int) -> None:
    """A default process group of ``world_size`` ranks: started here (one rank,
    this process) where none is, else checked."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"--steps runs the collectives on the default process group, which has "
                f"{dist.get_world_size()} ranks, not the {world_size} of --world-size"
            )
        return
    if world_size != 1:
        raise ValueError(
            "--steps runs the collectives in this process: pass --world-size 1, or start "
            f"{world_size} ranks (torchrun) with the default process group initialized"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _average() -> Any:
    return dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM


def _unshard_step(g: Group, fsdp2: Any | None) -> OpBench:
    d, w, rows, rank = g.dtypes, g.world_size, g.plan.row_numel, g.rank
    sizes, total = g.sizes, g.total
    cast = d.param != d.orig
    sharded = g.random(rows, dtype=d.orig)
    ag = g.empty(w, rows, dtype=d.param)
    unsharded = g.empty(g.plan.unsharded_numel, dtype=d.param)
    tables = g.tables.copy_out_args()
    inputs = list(torch.split(g.packed(sharded), sizes))
    torch_ag = g.empty(w * total, dtype=d.param)
    torch_unsharded = g.empty(w * total, dtype=d.param)
    outs = [t.view(w, -1) for t in torch.split(torch_unsharded, [w * n for n in sizes])]
    copy_in = fsdp2.all_gather_copy_in if fsdp2 else _foreach_copy_into_row
    split_copy = fsdp2.split_with_sizes_copy if fsdp2 else torch.split_with_sizes_copy

    def run_fsdp_rs() -> None:
        source = sharded
        if cast:
            g.ops.all_gather_copy_in(sharded, ag, rank)
            source = ag[rank]
        dist.all_gather_into_tensor(ag.view(-1), source)
        g.ops.all_gather_copy_out(ag, [unsharded], *tables)

    def run_torch() -> None:
        sources = fsdp2_cast_inputs(inputs, sizes, d.param) if cast else inputs
        copy_in(sources, torch_ag, sizes, total, rank)
        dist.all_gather_into_tensor(torch_ag, torch_ag.narrow(0, total * rank, total))
        split_copy(torch_ag.view(w, total), sizes, dim=1, out=outs)

    def equal() -> bool:
        return _same(_segments(unsharded, g.plan.unsharded_offsets, w * g.n), torch_unsharded)

    impl = "foreach_copy_ + all_gather_copy_in + all_gather + split_with_sizes_copy"
    nbytes = rows * (d.orig.itemsize + d.param.itemsize) + 2 * w * rows * d.param.itemsize
    return OpBench(nbytes, run_fsdp_rs, run_torch, equal, impl)


def _reduce_step(g: Group, fsdp2: Any | None) -> OpBench:
    d, w, rows, total = g.dtypes, g.world_size, g.plan.row_numel, g.total
    pre, post = fsdp2_divide_factors(d.reduce, w)
    grads = [g.random(*s, dtype=d.param) for s in g.case.shapes]
    rs_tables = g.tables.reduce_scatter_args()
    rs_in = g.empty(w, rows, dtype=d.reduce)
    # the runtime reduce-scatters into the sharded gradient buffer itself where
    # the reduce output is the gradient (no cast, no division left)
    direct = d.reduce == d.orig and post == 1
    sharded_grad = g.empty(rows, dtype=d.orig)
    rs_out = sharded_grad if direct else g.empty(rows, dtype=d.reduce)
    torch_in = g.empty(w, total, dtype=d.reduce)
    torch_out = g.empty(total, dtype=d.reduce)
    views = g.sharded_views()
    chunk_cat = fsdp2.chunk_cat if fsdp2 else torch._chunk_cat
    last: dict[str, torch.Tensor] = {}

    def run_fsdp_rs() -> None:
        g.ops.reduce_scatter_copy_in(grads, rs_in, *rs_tables, pre)
        dist.reduce_scatter_tensor(rs_out, rs_in.view(-1), op=_average())
        if not direct:
            g.ops.post_reduce(rs_out, sharded_grad, post, False)

    def run_torch() -> None:
        chunk_cat(grads, 0, w, out=torch_in)
        if pre != 1:
            torch_in.div_(pre)
        dist.reduce_scatter_tensor(torch_out, torch_in.view(-1), op=_average())
        out = torch_out
        if post != 1:
            out = out.div_(post)
        out = out.to(d.orig)
        last["grads"] = [torch.as_strided(out, *v) for v in views]
        last["out"] = out

    def equal() -> bool:
        valid = g.plan.sharded_numel
        mine = _segments(sharded_grad, g.plan.row_offsets, valid)
        return _same(mine, _segments(last["out"], g.packed_offsets, valid))

    impl = "chunk_cat + reduce_scatter + div_/to(orig) + as_strided per param"
    nbytes = sum(t.numel() for t in grads) * d.param.itemsize + w * rows * d.reduce.itemsize
    return OpBench(nbytes, run_fsdp_rs, run_torch, equal, impl, pre)


STEP_BUILDERS = {"unshard_step": _unshard_step, "reduce_step": _reduce_step}
