"""The torch.library ops: schemas, opcheck, torch.compile (aot_eager and inductor,
fullgraph) against eager, ``set_`` under compile, and bad input."""

from __future__ import annotations

import pytest
import torch

import fsdp_rs.ops
from copy_oracle import rows_of, unsharded_of
from fsdp_rs import plan_group
from fsdp_rs.ops import GroupTables
from fsdp_rs.planning import shapes_to_arrays

OPS = torch.ops.fsdp_rs
SHAPES = [(17, 33), (5,), (0, 3), (7, 3, 5), (1,)]
WORLD_SIZE = 3


def make(rank=1, param=torch.bfloat16, reduce=torch.float32, world_size=WORLD_SIZE):
    size = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
    plan = plan_group(
        *shapes_to_arrays(SHAPES), world_size, rank,
        param_elem_size=size[param], reduce_elem_size=size[reduce], tile_numel=64,
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    return plan, GroupTables.from_plan(plan), params


def copy_in_args():
    plan, _, params = make()
    sharded = rows_of(params, plan, torch.float32)[plan.rank].clone()
    return (sharded, torch.zeros(WORLD_SIZE, plan.row_numel, dtype=torch.bfloat16), plan.rank)


def copy_out_args(per_param=False):
    plan, tables, params = make(param=torch.float32)
    ag = rows_of(params, plan, torch.float32)
    if per_param:
        out = [torch.zeros(WORLD_SIZE * n) for n in plan.padded_sharded_numel.tolist()]
    else:
        out = [torch.zeros(plan.unsharded_numel)]
    return (ag, out, *tables.copy_out_args())


def rs_copy_in_args():
    plan, tables, params = make(param=torch.float32, reduce=torch.bfloat16)
    grads = list(params)
    grads[1] = None
    rs = torch.zeros(WORLD_SIZE, plan.row_numel, dtype=torch.bfloat16)
    return (grads, rs, *tables.reduce_scatter_args(), 3.0)


def rs_copy_in_flat_args():
    plan, tables, params = make(param=torch.float32, reduce=torch.bfloat16)
    buffer = unsharded_of(params, plan, 0.0, torch.float32)
    rs = torch.zeros(WORLD_SIZE, plan.row_numel, dtype=torch.bfloat16)
    return (buffer, rs, *tables.reduce_scatter_flat_args(), 3.0)


def post_reduce_args(accumulate=True):
    return (torch.randn(300, dtype=torch.bfloat16), torch.randn(300), 3.0, accumulate)


SAMPLES = {
    "all_gather_copy_in": copy_in_args,
    "all_gather_copy_out": copy_out_args,
    "all_gather_copy_out_per_param": lambda: copy_out_args(per_param=True),
    "reduce_scatter_copy_in": rs_copy_in_args,
    "reduce_scatter_copy_in_flat": rs_copy_in_flat_args,
    "post_reduce": post_reduce_args,
}


def op_of(sample: str):
    return getattr(OPS, sample.removesuffix("_per_param")).default


def test_schemas_declare_mutations():
    for name, schema in fsdp_rs.ops.SCHEMAS.items():
        parsed = getattr(OPS, name).default._schema
        mutated = [a.name for a in parsed.arguments if a.alias_info and a.alias_info.is_write]
        assert mutated, name
        assert all(f"Tensor(a!){'[]' if m == 'out' else ''} {m}" in schema for m in mutated)
        assert parsed.returns == []


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, list):
        return [_to(t, device) for t in x]
    return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("sample", SAMPLES)
def test_opcheck(sample, device):
    args = tuple(_to(a, device) for a in SAMPLES[sample]())
    torch.library.opcheck(op_of(sample), args)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_clone(t) for t in x]
    return x


def _run(fn, args):
    args = _clone(args)
    result = fn(*args)
    return result, args


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _functions():
    """One function per op: the op on a fresh buffer, plus a mutated graph input,
    plus arithmetic around it, so the compiled graph must keep the op's effect."""

    def copy_in(sharded, ag, rank):
        fresh = torch.zeros_like(ag)
        OPS.all_gather_copy_in(sharded * 2, fresh, rank)
        OPS.all_gather_copy_in(sharded, ag, rank)  # mutates a graph input
        return fresh + 1

    def copy_out(ag, out, *tables):
        fresh = [torch.zeros_like(t) for t in out]
        OPS.all_gather_copy_out(ag + 1, fresh, *tables)
        OPS.all_gather_copy_out(ag, out, *tables)  # mutates a list of graph inputs
        return [t * 2 for t in fresh]

    def rs_copy_in(grads, rs, *tables_and_factor):
        fresh = torch.zeros_like(rs)
        OPS.reduce_scatter_copy_in([g if g is None else g * 3 for g in grads], fresh,
                                   *tables_and_factor)  # fmt: skip
        OPS.reduce_scatter_copy_in(grads, rs, *tables_and_factor)
        return fresh - 1

    def rs_copy_in_flat(buffer, rs, *tables_and_factor):
        fresh = torch.zeros_like(rs)
        OPS.reduce_scatter_copy_in_flat(buffer * 3, fresh, *tables_and_factor)
        OPS.reduce_scatter_copy_in_flat(buffer, rs, *tables_and_factor)
        return fresh - 1

    def post(output, grad, factor, accumulate):
        fresh = torch.ones_like(grad)
        OPS.post_reduce(output + 1, fresh, factor, accumulate)
        OPS.post_reduce(output, grad, factor, accumulate)
        return fresh * 2

    return {
        "all_gather_copy_in": copy_in,
        "all_gather_copy_out": copy_out,
        "all_gather_copy_out_per_param": copy_out,
        "reduce_scatter_copy_in": rs_copy_in,
        "reduce_scatter_copy_in_flat": rs_copy_in_flat,
        "post_reduce": post,
    }


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("sample", SAMPLES)
def test_compile_matches_eager(sample, backend):
    torch._dynamo.reset()
    fn = _functions()[sample]
    args = SAMPLES[sample]()
    expected, expected_args = _run(fn, args)
    actual, actual_args = _run(torch.compile(fn, backend=backend, fullgraph=True), args)
    _assert_same(actual, expected)
    _assert_same(actual_args, expected_args)  # input mutations applied too


def test_compile_auto_functionalizes_mutable_list():
    """The copy-out's ``Tensor(a!)[]`` goes through auto-functionalization."""
    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    fn = _functions()["all_gather_copy_out"]
    args = copy_out_args()
    torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(*_clone(args))
    code = "\n".join(g.code for g in graphs)
    assert "auto_functionalized" in code and "fsdp_rs.all_gather_copy_out" in code


# [Note: set_ is not functionalized] in fsdp_rs/ops/set_.py


def test_set_eager():
    param = torch.nn.Parameter(torch.empty(0))
    data = torch.arange(6.0)
    OPS.set_(param, data)
    assert param.data_ptr() == data.data_ptr() and param.shape == (6,)
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    with pytest.raises(ValueError, match="dtype"):
        OPS.set_(param, torch.zeros(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_set_under_compile_is_kept_and_not_functionalized(backend):
    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm.code)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    target = torch.zeros(0)

    def fn(x):
        fresh = x * 2 + 1  # a fresh buffer, like a per-all-gather output
        OPS.set_(target, fresh)
        return target.sum() + 0

    torch._dynamo.reset()
    x = torch.arange(5.0)
    compiled = (
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
        if backend == "aot_eager"
        else torch.compile(fn, backend="inductor", fullgraph=True)
    )
    result = compiled(x)
    assert torch.equal(target, x * 2 + 1)
    assert result.item() == (x * 2 + 1).sum().item()
    if graphs:
        code = "\n".join(graphs)
        assert "aten.set_" in code and "auto_functionalized" not in code


def test_set_survives_dead_code_elimination():
    from torch.fx.node import _side_effectful_functions

    assert OPS.set_.default in _side_effectful_functions


# bad input: clear exceptions from the CPU impls and the fake impls alike


def test_copy_in_bad_input():
    sharded, ag, rank = copy_in_args()
    with pytest.raises(ValueError, match="out of range"):
        OPS.all_gather_copy_in(sharded, ag, WORLD_SIZE)
    with pytest.raises(ValueError, match="row_numel"):
        OPS.all_gather_copy_in(sharded[1:], ag, rank)
    with pytest.raises(TypeError, match=r"dtype torch\.int64"):
        OPS.all_gather_copy_in(sharded.long(), ag, rank)
    with pytest.raises(ValueError, match="contiguous"):
        OPS.all_gather_copy_in(sharded, ag.t().contiguous().t(), rank)
    with pytest.raises(ValueError, match="2-D"):
        OPS.all_gather_copy_in(sharded, ag.view(-1), rank)
    with pytest.raises(ValueError, match="row_numel"):
        OPS.all_gather_copy_in(sharded.to("meta")[1:], ag.to("meta"), rank)  # fake impl


def test_copy_out_bad_input():
    ag, out, *tables = copy_out_args()
    with pytest.raises(ValueError, match="1 tensor"):
        OPS.all_gather_copy_out(ag, out * 2, *tables)
    with pytest.raises(ValueError, match="does not cast"):
        OPS.all_gather_copy_out(ag, [out[0].bfloat16()], *tables)
    with pytest.raises(TypeError, match=r"expected torch\.int64"):
        OPS.all_gather_copy_out(ag, out, tables[0].int(), *tables[1:])
    with pytest.raises(ValueError, match=r"4 entries, got shape \(5,\)"):
        OPS.all_gather_copy_out(ag, out, tables[0][1:], *tables[1:])
    with pytest.raises(ValueError, match="on meta"):
        OPS.all_gather_copy_out(ag, out, tables[0].to("meta"), *tables[1:])


def test_rs_copy_in_bad_input():
    grads, rs, *tables, factor = rs_copy_in_args()
    with pytest.raises(ValueError, match="one entry per param"):
        OPS.reduce_scatter_copy_in(grads[1:], rs, *tables, factor)
    bad = list(grads)
    bad[0] = bad[0][:, :-1]
    with pytest.raises(ValueError, match=r"gradient 0 has shape \(17, 32\)"):
        OPS.reduce_scatter_copy_in(bad, rs, *tables, factor)
    bad[0] = grads[0].double()
    with pytest.raises(TypeError, match="float64"):
        OPS.reduce_scatter_copy_in(bad, rs, *tables, factor)
    bad[0] = grads[0].bfloat16()
    with pytest.raises(TypeError, match=r"gradient 2 has dtype torch\.float32"):
        OPS.reduce_scatter_copy_in(bad, rs, *tables, factor)
    for factor in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="divide_factor"):
            OPS.reduce_scatter_copy_in(grads, rs, *tables, factor)


def test_rs_copy_in_flat_bad_input():
    buffer, rs, *tables, factor = rs_copy_in_flat_args()
    with pytest.raises(ValueError, match=r"grad_buffer has \d+ elements"):
        OPS.reduce_scatter_copy_in_flat(buffer[: buffer.numel() // 2], rs, *tables, factor)
    with pytest.raises(ValueError, match="grad_buffer must be 1-D"):
        OPS.reduce_scatter_copy_in_flat(buffer.view(1, -1), rs, *tables, factor)
    with pytest.raises(TypeError, match=r"table unsharded_offsets has dtype torch\.int32"):
        OPS.reduce_scatter_copy_in_flat(buffer, rs, tables[0], tables[1].int(), *tables[2:])
    with pytest.raises(ValueError, match="divide_factor"):
        OPS.reduce_scatter_copy_in_flat(buffer, rs, *tables, 0.0)
    with pytest.raises(ValueError, match="on meta"):
        OPS.reduce_scatter_copy_in_flat(buffer.to("meta"), rs, *tables, factor)


def test_post_reduce_bad_input():
    output, grad, _, _ = post_reduce_args()
    with pytest.raises(ValueError, match="300 elements"):
        OPS.post_reduce(output, grad[1:], 1.0, False)
    with pytest.raises(ValueError, match="divide_factor"):
        OPS.post_reduce(output, grad, 0.0, False)
    with pytest.raises(TypeError, match="int32"):
        OPS.post_reduce(output, grad.int(), 1.0, False)


def test_tables_share_plan_memory():
    plan, tables, _ = make()
    assert tables.tile_start.data_ptr() == plan.tile_start.ctypes.data
    assert tables.padded_numel.tolist() == plan.padded_sharded_numel.tolist()


def test_round_trip_through_ops():
    """Every rank's copy-in into one all-gather buffer, then copy-out, gives the
    params back bit for bit; per-rank reduce-scatter copy-in + a simulated
    reduce-scatter + post-reduce gives each rank its shard of the mean gradient."""
    plans = [make(rank=r, param=torch.float32)[0] for r in range(WORLD_SIZE)]
    _, tables, params = make(param=torch.float32)
    sharded = [rows_of(params, p, torch.float32)[p.rank].clone() for p in plans]
    ag = torch.empty(WORLD_SIZE, plans[0].row_numel)
    for r in range(WORLD_SIZE):
        OPS.all_gather_copy_in(sharded[r], ag, r)
    out = torch.full((plans[0].unsharded_numel,), 5.0)
    OPS.all_gather_copy_out(ag, [out], *tables.copy_out_args())
    assert torch.equal(out, unsharded_of(params, plans[0], 5.0, torch.float32))
    for t, off in zip(params, plans[0].unsharded_offsets.tolist(), strict=True):
        assert torch.equal(out[off : off + t.numel()].view(t.shape), t)

    g = torch.Generator().manual_seed(7)
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(WORLD_SIZE)]
    inputs = []
    for r in range(WORLD_SIZE):
        rs = torch.empty(WORLD_SIZE, plans[r].row_numel)
        OPS.reduce_scatter_copy_in(grads[r], rs, *tables.reduce_scatter_args())
        inputs.append(rs)
    for r in range(WORLD_SIZE):
        reduced = inputs[0][r].clone()
        for k in range(1, WORLD_SIZE):
            reduced += inputs[k][r]
        grad = torch.empty(plans[r].row_numel)
        OPS.post_reduce(reduced, grad, float(WORLD_SIZE), False)
        total = [sum(grads[k][p] for k in range(1, WORLD_SIZE)) for p in range(len(SHAPES))]
        full = [grads[0][p] + total[p] if WORLD_SIZE > 1 else grads[0][p] for p in range(5)]
        expected = rows_of([f / WORLD_SIZE for f in full], plans[r], torch.float32)[r]
        assert torch.allclose(grad, expected, rtol=1e-6, atol=1e-6)
