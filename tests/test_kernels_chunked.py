"""The copies of parameters sharded on a dim > 0 ([Note: Chunked copies]):
``all_gather_copy_out`` and ``reduce_scatter_copy_in`` with a ``chunk_numel``
table, the Triton kernels (``TRITON_INTERPRET=1`` on CPU) and the torch
references, against an oracle built from ``torch.chunk`` on the shard dim, as
FSDP2 shards: stacked-expert shapes on dims 1 and 2, a dim-0 parameter in the
same group (its run is its whole shard), empty parameters, world sizes 1 to 4,
gradients missing, mixed dtypes and pre-division."""

from __future__ import annotations

import math

import pytest
import torch

import fsdp_rs.ops  # noqa: F401  (registers torch.ops.fsdp_rs)
from fsdp_rs import plan_group
from fsdp_rs.kernels.all_gather_copy_out import triton_all_gather_copy_out
from fsdp_rs.kernels.reduce_scatter_copy_in import triton_reduce_scatter_copy_in
from fsdp_rs.ops import GroupTables
from fsdp_rs.planning import shapes_to_arrays
from test_kernels import DEVICE, INTERPRETED, SIZE, assert_close_1ulp, dtype_id

# (shape, shard dim); every sharded dim divisible by 4 (FSDP2 refuses uneven d > 0)
CASES = {
    "experts": [((3, 8, 5), 1), ((2, 4, 4, 3), 2), ((6, 16), 1), ((8, 3), 0), ((1, 4), 1)],
    "with_empty": [((0, 8), 1), ((5, 4, 7), 1), ((3, 0, 4), 2), ((4, 12), 1)],
    "long_runs": [((2, 4, 700), 1), ((9, 8), 1)],
}
WORLD_SIZES = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]
TILE_NUMEL = 512  # big params span tiles, and tiles end inside runs


def _plan(case, world, param, reduce):
    """The group planned as ShardDimGroup plans it: ``(W, numel / W)`` each."""
    planned = [(world, math.prod(s) // world) for s, _ in case]
    ndims, dims = shapes_to_arrays(planned)
    plan = plan_group(
        ndims, dims, world, 0,
        orig_elem_size=4, param_elem_size=SIZE[param],
        reduce_elem_size=SIZE[reduce], tile_numel=TILE_NUMEL,
    )  # fmt: skip
    runs = [
        s[d] // world * math.prod(s[d + 1 :]) if math.prod(s) else 0 for s, d in case
    ]  # fmt: skip
    return plan, GroupTables.from_plan(plan, DEVICE), torch.tensor(runs).to(DEVICE)


def _values(case, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s, _ in case]


def _rows(tensors, case, plan, world, dtype, fill):
    """Each rank's row: at ``row_offsets[p]``, ``chunk(W, d)[r]`` flattened."""
    rows = torch.full((world, plan.row_numel), fill, dtype=dtype)
    for t, (_, d), r0 in zip(tensors, case, plan.row_offsets.tolist(), strict=True):
        if t is None:
            t = torch.zeros(0)
        for r, piece in enumerate(t.chunk(world, d) if t.numel() else []):
            flat = piece.reshape(-1).to(dtype)
            rows[r, r0 : r0 + flat.numel()] = flat
    return rows


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_param", [False, True], ids=["group_buffer", "per_param"])
def test_copy_out_chunked(case, world, dtype, per_param):
    shapes = CASES[case]
    plan, tables, runs = _plan(shapes, world, dtype, dtype)
    params = _values(shapes, dtype, seed=1)
    output = _rows(params, shapes, plan, world, dtype, 0.0).to(DEVICE)
    expected = torch.full((plan.unsharded_numel,), -7.0, dtype=dtype)
    for p, u in zip(params, plan.unsharded_offsets.tolist(), strict=True):
        expected[u : u + p.numel()] = p.reshape(-1)

    def outputs():
        if not per_param:
            return [torch.full((plan.unsharded_numel,), -7.0, dtype=dtype, device=DEVICE)]
        return [torch.full((p.numel(),), -7.0, dtype=dtype, device=DEVICE) for p in params]

    def flatten(out):
        if not per_param:
            return out[0].cpu()
        result = torch.full((plan.unsharded_numel,), -7.0, dtype=dtype)
        for t, u in zip(out, plan.unsharded_offsets.tolist(), strict=True):
            result[u : u + t.numel()] = t.cpu()
        return result

    ref, tri = outputs(), outputs()
    torch.ops.fsdp_rs.all_gather_copy_out(output, ref, *tables.copy_out_args(), runs)
    triton_all_gather_copy_out(output, tri, *tables.copy_out_args(), runs)
    assert torch.equal(flatten(ref), expected)
    assert torch.equal(flatten(tri), expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("grad", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", [torch.float32], ids=dtype_id)
@pytest.mark.parametrize("divide_factor", [1.0, 4.0])
def test_copy_in_chunked(case, world, grad, reduce, divide_factor):
    shapes = CASES[case]
    plan, tables, runs = _plan(shapes, world, grad, reduce)
    grads = _values(shapes, grad, seed=2)
    grads[1] = None  # a param without a gradient contributes zeros
    expected = _rows(grads, shapes, plan, world, reduce, 0.0) / divide_factor
    planned = [None if g is None else g.reshape(world, -1).to(DEVICE) for g in grads]
    ref = torch.full((world, plan.row_numel), float("nan"), dtype=reduce, device=DEVICE)
    tri = ref.clone()
    args = tables.reduce_scatter_args()
    torch.ops.fsdp_rs.reduce_scatter_copy_in(planned, ref, *args, divide_factor, runs)
    triton_reduce_scatter_copy_in(planned, tri, *args, divide_factor, runs)
    assert torch.equal(ref.cpu(), expected)  # every element written: no NaN left
    assert_close_1ulp(tri.cpu(), expected, exact=not INTERPRETED or divide_factor == 1.0)


def test_chunk_table_checked():
    """A table of the wrong length or a run that does not divide the shard is a
    ValueError naming ``chunk_numel``, before anything is copied."""
    shapes = CASES["experts"]
    plan, tables, runs = _plan(shapes, 2, torch.float32, torch.float32)
    output = torch.zeros(2, plan.row_numel, device=DEVICE)
    out = [torch.zeros(plan.unsharded_numel, device=DEVICE)]
    with pytest.raises(ValueError, match="chunk_numel"):
        torch.ops.fsdp_rs.all_gather_copy_out(output, out, *tables.copy_out_args(), runs[:-1])
    bad = runs.clone()
    bad[0] = 7
    if DEVICE.type == "cpu":  # the reference reads the table; the kernel cannot check it
        with pytest.raises(ValueError, match=r"chunk_numel\[0\] = 7"):
            torch.ops.fsdp_rs.all_gather_copy_out(output, out, *tables.copy_out_args(), bad)
