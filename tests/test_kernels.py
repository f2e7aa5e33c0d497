"""Triton kernels against their torch references and the naive oracle.

On a CPU-only machine the kernels run under ``TRITON_INTERPRET=1`` (set in
conftest.py), whose bf16 cast truncates where CUDA rounds to nearest even, and
whose division by a scalar divides where the CUDA kernel multiplies by the
reciprocal: casts and non-power-of-two divisions are compared within 1 ulp
there, everything else bit for bit. With CUDA, every comparison is exact.
"""

from __future__ import annotations

import re

import pytest
import torch

import fsdp_rs.ops  # noqa: F401  (registers torch.ops.fsdp_rs)
from copy_oracle import rows_of, unsharded_of
from fsdp_rs import plan_group
from fsdp_rs.kernels import (
    _cpu_index,
    _cpu_tiles,
    all_gather_copy_out,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_flat,
)
from fsdp_rs.kernels.all_gather_copy_in import triton_all_gather_copy_in
from fsdp_rs.kernels.all_gather_copy_out import triton_all_gather_copy_out
from fsdp_rs.kernels.post_reduce import triton_post_reduce
from fsdp_rs.kernels.reduce_scatter_copy_in import _copy_one, triton_reduce_scatter_copy_in
from fsdp_rs.kernels.reduce_scatter_copy_in_flat import (
    torch_reduce_scatter_copy_in_flat,
    triton_reduce_scatter_copy_in_flat,
)
from fsdp_rs.ops import GroupTables
from fsdp_rs.planning import shapes_to_arrays

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"

CASES = {
    "odd": [(17, 257), (13,), (7, 3, 5), (1,), (5, 1)],
    "primes": [(2,), (3, 3), (5, 7), (11, 13), (31,)],
    "empty": [(0,), (3,), (0, 4), (4, 0), (2, 2)],
    "1d": [(4099,)],
    "huge_and_tiny": [(61, 257)] + [(1 + i % 3, 2) for i in range(40)],
}
WORLD_SIZES = [1, 2, 3, 8]
# where the references look up a whole table set's cached index
WHOLE_INDEX_FUNCTIONS = [
    (all_gather_copy_out, "copy_out_index"),
    (reduce_scatter_copy_in_flat, "reduce_scatter_buffer_index"),
    (reduce_scatter_copy_in, "reduce_scatter_flat_index"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
# Small tiles so the big params span many tiles and the tiny ones leave blocks
# part-filled; the kernels' BLOCK (2048) also exceeds a tile here.
TILE_NUMEL = 512


# The CPU references' paths: a cached element index ([Note: Cached CPU
# indices]), and where the whole index is refused, the patterns of repeating
# runs of parameters ([Note: Repeating runs]), or the index built and dropped
# by runs ([Note: Tiled indices]), or, for a parameter over a run's size, one
# strided copy (forced for every parameter by a run size of 0). Runs of 40
# elements here, so that the test tables' runs cut between parameters and
# some parameters are over a run alone.
INDEX_MODES = ["cached_index", "repeating_runs", "tiled_index", "per_param_copies"]


def _index_mode(monkeypatch, mode: str) -> None:
    if mode == "repeating_runs":  # the whole indices refused, the patterns kept
        for module, name in WHOLE_INDEX_FUNCTIONS:
            monkeypatch.setattr(module, name, lambda *args, **kwargs: None)
    elif mode != "cached_index":
        monkeypatch.setattr(_cpu_index, "BUDGET", 0)
    if mode in ("repeating_runs", "tiled_index"):
        monkeypatch.setattr(_cpu_tiles, "TILE_BYTES", 40 * _cpu_tiles._BYTES_PER_ELEMENT)
    if mode == "per_param_copies":
        monkeypatch.setattr(_cpu_tiles, "TILE_BYTES", 0)


def dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def make_plan(shapes, world_size, rank, orig, param, reduce, tile_numel=TILE_NUMEL):
    ndims, dims = shapes_to_arrays(shapes)
    return plan_group(
        ndims, dims, world_size, rank,
        orig_elem_size=SIZE[orig], param_elem_size=SIZE[param],
        reduce_elem_size=SIZE[reduce], tile_numel=tile_numel,
    )  # fmt: skip


def make_params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def assert_close_1ulp(
    actual: torch.Tensor,
    expected: torch.Tensor,
    exact: bool,
    ulps: int = 1,
    scale: torch.Tensor | None = None,
    ulp_of: torch.dtype | None = None,
) -> None:
    """Bit-equal when ``exact``; else within ``ulps`` ulp of ``expected``'s dtype
    (one per rounding step the interpreter may take differently), measured at
    ``scale`` (default ``|expected|``; a sum's error scales with its terms) in
    the ulps of ``ulp_of`` (default ``expected.dtype``)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if exact:
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
        return
    a, e = actual.double(), expected.double()
    same = (a == e) | (a.isnan() & e.isnan())
    info = torch.finfo(ulp_of or expected.dtype)
    magnitude = e.abs() if scale is None else scale.double().abs()
    tol = ulps * (magnitude * info.eps + info.tiny)
    bad = ~same & ~((a - e).abs() <= tol)
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than 1 ulp"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("orig", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("param", DTYPES, ids=dtype_id)
def test_all_gather_copy_in(case, world_size, orig, param):
    shapes = CASES[case]
    rank = world_size - 1  # the last rank carries the most padding
    plan = make_plan(shapes, world_size, rank, orig, param, orig)
    sharded = rows_of(make_params(shapes, orig), plan, orig)[rank].to(DEVICE)
    expected = torch.full((world_size, plan.row_numel), float("nan"), dtype=param, device=DEVICE)
    actual = expected.clone()
    torch.ops.fsdp_rs.all_gather_copy_in(sharded, expected, rank)
    triton_all_gather_copy_in(sharded, actual, rank)
    # The reference against the oracle: only row `rank` changes, a plain cast.
    assert torch.equal(expected[rank], sharded.to(param))
    assert expected[:rank].isnan().all() and expected[rank + 1 :].isnan().all()
    assert_close_1ulp(actual, expected, exact=orig == param or not INTERPRETED)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_param", [False, True], ids=["group_buffer", "per_param"])
@pytest.mark.parametrize("index", INDEX_MODES)
def test_all_gather_copy_out(case, world_size, dtype, per_param, index, monkeypatch):
    _index_mode(monkeypatch, index)
    shapes = CASES[case]
    plan = make_plan(shapes, world_size, 0, torch.float32, dtype, torch.float32)
    tables = GroupTables.from_plan(plan, DEVICE)
    params = make_params(shapes, dtype, seed=1)
    all_gather_output = rows_of(params, plan, dtype).to(DEVICE)
    expected = unsharded_of(params, plan, fill=-7.0, dtype=dtype)

    def outputs():
        if not per_param:
            return [torch.full((plan.unsharded_numel,), -7.0, dtype=dtype, device=DEVICE)]
        n = plan.padded_sharded_numel.tolist()
        return [torch.full((world_size * k,), -7.0, dtype=dtype, device=DEVICE) for k in n]

    def flatten(out):
        if not per_param:
            return out[0].cpu()
        result = torch.full((plan.unsharded_numel,), -7.0, dtype=dtype)
        for t, off in zip(out, plan.unsharded_offsets.tolist(), strict=True):
            result[off : off + t.numel()] = t.cpu()
        return result

    ref, tri = outputs(), outputs()
    torch.ops.fsdp_rs.all_gather_copy_out(all_gather_output, ref, *tables.copy_out_args())
    triton_all_gather_copy_out(all_gather_output, tri, *tables.copy_out_args())
    assert torch.equal(flatten(ref), expected)
    assert torch.equal(flatten(tri), expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("grad", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("index", INDEX_MODES)
def test_reduce_scatter_copy_in(case, world_size, grad, reduce, index, monkeypatch):
    _index_mode(monkeypatch, index)
    shapes = CASES[case]
    plan = make_plan(shapes, world_size, 0, torch.float32, grad, reduce)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = make_params(shapes, grad, seed=2)
    grads[len(grads) // 2] = None  # a param without a gradient contributes zeros
    dense = [
        g if g is not None else torch.zeros(s, dtype=grad)
        for g, s in zip(grads, shapes, strict=True)
    ]
    expected = rows_of(dense, plan, reduce)
    on_device = [g.to(DEVICE) if g is not None else None for g in grads]
    ref = torch.full((world_size, plan.row_numel), float("nan"), dtype=reduce, device=DEVICE)
    tri = ref.clone()
    torch.ops.fsdp_rs.reduce_scatter_copy_in(on_device, ref, *tables.reduce_scatter_args())
    triton_reduce_scatter_copy_in(on_device, tri, *tables.reduce_scatter_args())
    assert torch.equal(ref.cpu(), expected)  # every element written: no NaN left
    assert_close_1ulp(tri, ref, exact=grad == reduce or not INTERPRETED)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("grad", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("reduce", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("index", INDEX_MODES)
def test_reduce_scatter_copy_in_flat(case, world_size, grad, reduce, index, monkeypatch):
    _index_mode(monkeypatch, index)
    shapes = CASES[case]
    plan = make_plan(shapes, world_size, 0, torch.float32, grad, reduce)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = make_params(shapes, grad, seed=4)
    # The buffer as autograd leaves it: gradients in place, zeros in the padding.
    buffer = unsharded_of(grads, plan, 0.0, grad).to(DEVICE)
    expected = rows_of(grads, plan, reduce)
    ref = torch.full((world_size, plan.row_numel), float("nan"), dtype=reduce, device=DEVICE)
    tri = ref.clone()
    args = tables.reduce_scatter_flat_args()
    torch.ops.fsdp_rs.reduce_scatter_copy_in_flat(buffer, ref, *args)
    triton_reduce_scatter_copy_in_flat(buffer, tri, *args)
    assert torch.equal(ref.cpu(), expected)  # every element written: no NaN left
    assert_close_1ulp(tri, ref, exact=grad == reduce or not INTERPRETED)


@pytest.mark.parametrize("divide_factor", [2.0, 3.0])
def test_reduce_scatter_copy_in_flat_predivide(divide_factor):
    shapes = CASES["odd"]
    plan = make_plan(shapes, 3, 0, torch.float32, torch.float32, torch.float16)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = make_params(shapes, torch.float32, seed=5)
    buffer = unsharded_of(grads, plan, 0.0, torch.float32).to(DEVICE)
    ref = torch.empty(3, plan.row_numel, dtype=torch.float16, device=DEVICE)
    tri = torch.empty_like(ref)
    args = tables.reduce_scatter_flat_args()
    torch.ops.fsdp_rs.reduce_scatter_copy_in_flat(buffer, ref, *args, divide_factor)
    triton_reduce_scatter_copy_in_flat(buffer, tri, *args, divide_factor)
    # Same rows, cast and division as the per-gradient copy-in.
    expected = torch.empty_like(ref)
    torch.ops.fsdp_rs.reduce_scatter_copy_in(
        [g.to(DEVICE) for g in grads], expected, *tables.reduce_scatter_args(), divide_factor
    )
    assert torch.equal(ref, expected)
    assert_close_1ulp(tri, ref, exact=not INTERPRETED, ulps=2)


@pytest.mark.parametrize("tables_from", ["group_tables", "plain_tensors"])
def test_reduce_scatter_copy_in_wrong_sized_gradient_raises(tables_from):
    """[Note: Gradient sizes] A gradient of another size than its param raises
    before the launch, in both implementations, instead of being read with
    zeros past its end or cut. With GroupTables' tables, by the params' exact
    numels; with tables made otherwise, by the padded chunks (a device table
    read back once, then kept on it until the table is written), where a
    gradient a row short whose chunk rounds to the plan's still passes."""
    shapes = CASES["odd"]
    plan = make_plan(shapes, 3, 0, torch.float32, torch.float32, torch.float32)
    args = list(GroupTables.from_plan(plan, DEVICE).reduce_scatter_args())
    exact = tables_from == "group_tables"
    if not exact:
        args = [t.clone() for t in args]
    grads = [g.to(DEVICE) for g in make_params(shapes, torch.float32, seed=3)]
    out = torch.empty(3, plan.row_numel, device=DEVICE)
    cases = [(0, grads[0][:-3]), (2, torch.zeros(10, 3, 5, device=DEVICE))]
    cases += [(0, grads[0][:-1])] if exact else []  # 16 rows of 17: the same chunk
    for i, bad in cases:
        wrong = list(grads)
        wrong[i] = bad
        for op in (torch.ops.fsdp_rs.reduce_scatter_copy_in, triton_reduce_scatter_copy_in):
            with pytest.raises(
                ValueError, match=re.escape(f"gradient {i} has shape {tuple(bad.shape)}")
            ):
                op(wrong, out, *args)
    wrong = list(grads)
    wrong[1] = None  # a missing gradient is not a wrong one
    triton_reduce_scatter_copy_in(wrong, out, *args)
    args[1].add_(0)  # written: the next call reads the table again
    triton_reduce_scatter_copy_in(grads, out, *args)


@pytest.mark.parametrize("per_param", [False, True], ids=["group_buffer", "per_param"])
def test_all_gather_copy_out_too_small_output_raises(per_param):
    """An output smaller than the plan's raises in both implementations,
    instead of the kernel's bounded writes silently leaving elements out."""
    shapes = CASES["odd"]
    plan = make_plan(shapes, 3, 0, torch.float32, torch.float32, torch.float32)
    tables = GroupTables.from_plan(plan, DEVICE)
    ag = torch.randn(3, plan.row_numel, device=DEVICE)
    padded = plan.padded_sharded_numel.tolist()
    if per_param:
        out = [torch.empty(3 * n, device=DEVICE) for n in padded]
        out[2] = out[2][:-1]
        words = "out\\[2\\] has"
    else:
        span = max(u + 3 * n for u, n in zip(plan.unsharded_offsets.tolist(), padded, strict=True))
        out = [torch.empty(span - 1, device=DEVICE)]
        words = "params span"
    for op in (torch.ops.fsdp_rs.all_gather_copy_out, triton_all_gather_copy_out):
        with pytest.raises(ValueError, match=words):
            op(ag, out, *tables.copy_out_args())


@pytest.mark.parametrize("divide_factor", [2.0, 3.0, 8.0])
@pytest.mark.parametrize("reduce", DTYPES, ids=dtype_id)
def test_reduce_scatter_copy_in_predivide(divide_factor, reduce):
    shapes = CASES["odd"]
    plan = make_plan(shapes, 3, 0, torch.float32, torch.float32, reduce)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = [g.to(DEVICE) for g in make_params(shapes, torch.float32, seed=3)]
    ref = torch.empty(3, plan.row_numel, dtype=reduce, device=DEVICE)
    tri = torch.empty_like(ref)
    args = tables.reduce_scatter_args()
    torch.ops.fsdp_rs.reduce_scatter_copy_in(grads, ref, *args, divide_factor=divide_factor)
    triton_reduce_scatter_copy_in(grads, tri, *args, divide_factor)
    # FSDP2 divides the reduce-dtype rows in place on their device, and torch
    # divides differently per device ([Note: Division by a scalar]): the
    # expectation is that same torch op where the op under test ran.
    expected = rows_of([g.cpu() for g in grads], plan, reduce).to(DEVICE).div_(divide_factor)
    assert torch.equal(ref, expected)
    power_of_two = divide_factor in (2.0, 8.0)
    exact = not INTERPRETED or (reduce == torch.float32 and power_of_two)
    # Interpreted: the cast to bf16/fp16 and the division each round once.
    assert_close_1ulp(tri, ref, exact=exact, ulps=2)


@pytest.mark.parametrize("numel", [0, 1, 17, 4097, 10_000])
@pytest.mark.parametrize("reduce", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("orig", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("divide_factor", [1.0, 4.0, 3.0])
@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
def test_post_reduce(numel, reduce, orig, divide_factor, accumulate):
    g = torch.Generator().manual_seed(numel)
    output = torch.randn(numel, generator=g).to(reduce).to(DEVICE)
    start = torch.randn(numel, generator=g).to(orig).to(DEVICE)
    ref, tri = start.clone(), start.clone()
    torch.ops.fsdp_rs.post_reduce(output, ref, divide_factor, accumulate)
    triton_post_reduce(output, tri, divide_factor, accumulate)
    # FSDP2's steps, each a torch op on DEVICE ([Note: Division by a scalar]):
    # divide in the reduce dtype, cast to the original dtype, then add.
    update = (output.clone().div_(divide_factor) if divide_factor != 1.0 else output).to(orig)
    expected = start + update if accumulate else update
    assert torch.equal(ref, expected)
    # Interpreted, a step rounds differently only where it narrows: a
    # non-power-of-two division, a cast down to bf16/fp16, a bf16/fp16 sum.
    narrows = orig != torch.float32 and (orig != reduce or accumulate)
    exact = not INTERPRETED or (divide_factor in (1.0, 4.0) and not narrows)
    scale = start.abs() + update.abs() if accumulate else None
    coarsest = max(reduce, orig, key=lambda d: torch.finfo(d).eps)
    # divide, cast, add: three roundings, the first two at most in the coarser dtype
    assert_close_1ulp(tri, ref, exact=exact, ulps=3, scale=scale, ulp_of=coarsest)


def test_post_reduce_accumulate_rounds_twice_on_cuda(monkeypatch):
    """FSDP2 accumulates ``grad += (output / factor).to(dtype)``: on CUDA a
    multiply by the reciprocal and an add, each rounded. Triton contracts a
    multiply feeding an add into one fma unless the launch disables it, which
    rounds once and differs in the last bit. Compiled here for an H100 (sm_90)
    with the options the kernel is launched with, so a CPU machine checks it."""
    import fsdp_rs.kernels.post_reduce as post_reduce

    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget")
    kernel = post_reduce._post_reduce_kernel
    launches: list[dict] = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(post_reduce, "_post_reduce_kernel", Launch())
    post_reduce.triton_post_reduce(torch.ones(8), torch.ones(8), 3.0, True)
    (options,) = launches
    constexprs = {name: options.pop(name) for name in ("HAS_DIV", "ACCUMULATE", "BLOCK")}
    signature = {"src": "*fp32", "dst": "*fp32", "numel": "i32", "inv_factor": "fp32"}
    signature |= dict.fromkeys(constexprs, "constexpr")
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # interpreted
    try:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # a Triton without the CUDA backend or this API
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    ptx = compiled.asm["ptx"]
    assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx
    assert "fma" not in ptx


def test_default_tile_size_single_tile_per_param():
    """The default 64 Ki-element tiles: one tile per small param, loop inside big ones."""
    shapes = [(3, 5000), (7,), (1, 3)]
    plan = make_plan(shapes, 2, 0, torch.float32, torch.float32, torch.float32, tile_numel=65536)
    assert plan.num_tiles == 3
    tables = GroupTables.from_plan(plan, DEVICE)
    params = make_params(shapes, torch.float32, seed=4)
    out = [torch.zeros(plan.unsharded_numel, device=DEVICE)]
    triton_all_gather_copy_out(rows_of(params, plan, torch.float32).to(DEVICE), out,
                               *tables.copy_out_args())  # fmt: skip
    assert torch.equal(out[0].cpu(), unsharded_of(params, plan, 0.0, torch.float32))


def test_cpu_index_cache_keeps_what_fits_and_refuses_the_rest(monkeypatch):
    """An index that fit the budget is served from the cache on every later call
    (its own bytes do not push its table set onto the per-parameter path), and
    one that does not fit is refused for as long as its tables live."""
    shapes = CASES[next(iter(CASES))]
    plan = make_plan(shapes, 2, 0, torch.float32, torch.float32, torch.float32)
    rows = 2 * plan.row_numel
    room = _cpu_index._held[0] + 4 * rows + 64 * 1024  # this index and a little
    monkeypatch.setattr(_cpu_index, "BUDGET", room)
    tables = GroupTables.from_plan(plan, torch.device("cpu"))
    row_offsets, unsharded_offsets, padded = tables.copy_out_args()[:3]

    def index():
        return _cpu_index.reduce_scatter_buffer_index(
            row_offsets, unsharded_offsets, padded, 2, plan.row_numel
        )

    first = index()
    assert first is not None
    assert index() is first
    monkeypatch.setattr(_cpu_index, "BUDGET", 0)
    other = GroupTables.from_plan(plan, torch.device("cpu"))
    args = other.copy_out_args()[:3]
    assert _cpu_index.reduce_scatter_buffer_index(*args, 2, plan.row_numel) is None
    assert index() is first  # a cached index stays served under a smaller budget


@pytest.mark.parametrize("index", INDEX_MODES)
def test_flat_copy_in_refuses_a_short_grad_buffer(monkeypatch, index):
    """A checked call names a gradient buffer shorter than the tables place
    gradients in, on every path (the tiled one reads the tables' extent only
    for this check)."""
    _index_mode(monkeypatch, index)
    plan = make_plan([(3,), (5,), (2, 4)], 2, 0, torch.float32, torch.float32, torch.float32)
    tables = GroupTables.from_plan(plan, torch.device("cpu"))
    rs_in = torch.empty(2, plan.row_numel)
    short = torch.zeros(plan.unsharded_numel - 1)
    with pytest.raises(ValueError, match=r"grad_buffer has \d+ elements but the tables place"):
        torch_reduce_scatter_copy_in_flat(short, rs_in, *tables.reduce_scatter_flat_args())


def test_cpu_index_trusted_hits_share_the_entry():
    """The runtime's trusted lookups ([Note: Trusted hits]) serve the entry a
    checked call built and skip only the version comparison: a checked call
    after the tables were written in place still gets a new index, which the
    trusted ones then serve."""
    plan = make_plan([(3,), (5,), (2, 4)], 2, 0, torch.float32, torch.float32, torch.float32)
    tables = GroupTables.from_plan(plan, torch.device("cpu"))
    args = tables.copy_out_args()[:3]

    def index(trusted):
        return _cpu_index.copy_out_index(
            *args, 2, plan.row_numel, plan.unsharded_numel, trusted=trusted
        )

    first = index(trusted=False)
    assert index(trusted=True) is first
    args[0].add_(0)  # written in place: a trusted hit does not look
    assert index(trusted=True) is first
    rebuilt = index(trusted=False)  # a checked call does
    assert rebuilt is not first
    assert index(trusted=True) is rebuilt
    for a, b in zip(rebuilt, first, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_cpu_index_cache_follows_its_tables():
    """An index is served only for the table objects it was built from, as they
    are: tables written in place get a new one, a table's death drops its
    entries at once (the hit path relies on it: a key's ids are then of live
    tables), and new tables made where dead ones lived (CPython reuses
    addresses, so ids) never get a dead table set's index ([Note: Cached CPU
    indices])."""
    # the same sizes (so the same cache key but for the ids), other layouts
    plans = [
        make_plan(shapes, 2, 0, torch.float32, torch.float32, torch.float32)
        for shapes in ([(3,), (5,), (2, 4)], [(5,), (2, 4), (3,)])
    ]
    assert plans[0].row_numel == plans[1].row_numel
    assert plans[0].unsharded_numel == plans[1].unsharded_numel

    def index(plan, args):
        return _cpu_index.copy_out_index(*args, 2, plan.row_numel, plan.unsharded_numel)

    def fresh(plan):
        tables = GroupTables.from_plan(plan, torch.device("cpu"))
        return tables, tables.copy_out_args()[:3]

    expected = []
    for plan in plans:
        tables, args = fresh(plan)
        built = index(plan, args)
        expected.append(tuple(None if t is None else t.clone() for t in built))
        del tables, args, built
    tables, args = fresh(plans[0])
    first = index(plans[0], args)
    assert index(plans[0], args) is first
    args[0].add_(0)  # written in place (the same values): built again
    assert index(plans[0], args) is not first
    ids = tuple(map(id, args))
    assert any(key[:3] == ids for key in _cpu_index._CACHE)
    del tables, args, first
    assert not any(key[:3] == ids for key in _cpu_index._CACHE)  # gone with its tables
    for i in range(40):
        plan = plans[i % 2]
        tables, args = fresh(plan)
        got = index(plan, args)
        for a, b in zip(got, expected[i % 2], strict=True):
            assert (a is None and b is None) or torch.equal(a, b), i
        del tables, args, got


def test_cpu_index_cache_counts_its_bytes_under_threads():
    """Ranks may be threads of one process: threads filling and dropping the
    cache at once leave its byte count equal to what it holds, and back where
    it started once their tables are gone."""
    import gc
    import sys
    import threading

    shapes = CASES[next(iter(CASES))]
    plan = make_plan(shapes, 2, 0, torch.float32, torch.float32, torch.float32)
    gc.collect()
    start = _cpu_index._held[0]
    barrier = threading.Barrier(4)
    errors = []

    def rank() -> None:
        try:
            barrier.wait()
            for _ in range(50):
                tables = GroupTables.from_plan(plan, torch.device("cpu"))
                args = tables.copy_out_args()[:3]
                assert _cpu_index.reduce_scatter_buffer_index(*args, 2, plan.row_numel) is not None
                del tables, args
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between bytecodes as often as it can
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    gc.collect()
    assert not errors, errors
    held = sum(_cpu_index._nbytes(entry[2]) for entry in _cpu_index._CACHE.values())
    assert _cpu_index._held[0] == held
    assert _cpu_index._held[0] == start


def test_reduce_scatter_copy_in_triton_reads_strided_and_refuses_bad_gradients():
    """The Triton path's gradient checks are C-level maps over the list ([Note:
    Pointer tables]): a strided gradient is read through a contiguous copy, and
    a gradient of another dtype or device is named by its index."""
    shapes = [(6, 4), (5,), (3, 2)]
    plan = make_plan(shapes, 2, 0, torch.float32, torch.float32, torch.float32)
    tables = GroupTables.from_plan(plan, DEVICE)
    args = tables.reduce_scatter_args()
    grads = [g.to(DEVICE) for g in make_params(shapes, torch.float32, seed=5)]
    grads[0] = grads[0].t().contiguous().t()  # same values, column-major
    assert not grads[0].is_contiguous()
    ref = torch.empty(2, plan.row_numel, device=DEVICE)
    tri = torch.full_like(ref, float("nan"))
    torch.ops.fsdp_rs.reduce_scatter_copy_in(grads, ref, *args)
    triton_reduce_scatter_copy_in(grads, tri, *args)
    assert torch.equal(tri, ref)
    wrong_dtype = [grads[0], grads[1].double(), grads[2]]
    with pytest.raises(TypeError, match=r"gradient 1 has dtype torch\.float64"):
        triton_reduce_scatter_copy_in(wrong_dtype, tri, *args)
    other = "cpu" if DEVICE.type == "cuda" else "meta"
    wrong_device = [grads[0], None, grads[2].to(other)]
    with pytest.raises(ValueError, match=f"gradient 2 is on {other}"):
        triton_reduce_scatter_copy_in(wrong_device, tri, *args)


def _periodic_tables(world_size: int, gapped: bool):
    """A head over a run's size, a body of one block repeated and a tail: the
    rows back to back with a 2-element gap after each block, the buffer in
    order or (``gapped``) with a gap of 3 before every parameter."""
    block = [5, 2, 3]  # padded chunk elements of the body's parameters
    padded = [50] + block * 12 + [7]
    rows, outs, r, u = [], [], 0, 0
    for p, n in enumerate(padded):
        u += 3 if gapped else 0
        rows.append(r)
        outs.append(u)
        r += n + (2 if p % 3 == 0 else 0)
        u += world_size * n
    rows, outs, padded = (torch.tensor(xs, dtype=torch.int64) for xs in (rows, outs, padded))
    return rows, outs, padded, r, u


@pytest.mark.parametrize("gapped", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_repeating_runs_copy_each_element_once(monkeypatch, world_size, gapped):
    """[Note: Repeating runs]: a table set whose body repeats is copied by its
    runs' patterns (a head, the body's, a tail), element for element what the
    tables say, both ways, with the buffer's gaps left alone."""
    monkeypatch.setattr(_cpu_tiles, "TILE_BYTES", 40 * _cpu_tiles._BYTES_PER_ELEMENT)
    rows, outs, padded, row_numel, out_numel = _periodic_tables(world_size, gapped)
    for kind in ("copy_out", "copy_in"):
        found = _cpu_tiles.repeating_runs(kind, rows, outs, padded, world_size, row_numel)
        assert found is not None, kind
        run_list, patterns = found
        assert len(patterns) <= 3 < len(run_list) and run_list[0][3] == -1  # the head alone
    ag = torch.randn(world_size, row_numel)
    out = torch.full((out_numel,), -1.0)
    _cpu_tiles.copy_out_tiled(ag, out, rows, outs, padded)
    expected = torch.full((out_numel,), -1.0)
    for r, u, n in zip(rows.tolist(), outs.tolist(), padded.tolist(), strict=True):
        expected[u : u + world_size * n] = ag[:, r : r + n].reshape(-1)
    assert torch.equal(out, expected)
    buffer = torch.randn(out_numel)
    rs_in = torch.full((world_size, row_numel), -1.0)
    _cpu_tiles.copy_in_flat_tiled(buffer, rs_in, rows, outs, padded)
    expected = torch.zeros(world_size, row_numel)  # the gaps: zeros
    for r, u, n in zip(rows.tolist(), outs.tolist(), padded.tolist(), strict=True):
        expected[:, r : r + n] = buffer[u : u + world_size * n].view(world_size, n)
    assert torch.equal(rs_in, expected)
    # from separate gradients: one short of its padded size each, one missing
    numels = world_size * padded.numpy() - 1
    grads = [torch.randn(int(k)) for k in numels]
    grads[7] = None
    assert _cpu_tiles.repeating_list_runs(rows, padded, numels, world_size, row_numel) is not None
    rs_in.fill_(-1.0)
    _cpu_tiles.copy_in_tiled(grads, rs_in, rows, padded, numels, torch.float32, _copy_one)
    expected.zero_()
    for g, r, n in zip(grads, rows.tolist(), padded.tolist(), strict=True):
        if g is not None:
            expected[:, r : r + n] = torch.cat([g, g.new_zeros(1)]).view(world_size, n)
    assert torch.equal(rs_in, expected)


def test_repeating_runs_refuse_tables_that_do_not_repeat(monkeypatch):
    """Distinct parameters all the way: no patterns kept (the tiles copy it)."""
    monkeypatch.setattr(_cpu_tiles, "TILE_BYTES", 40 * _cpu_tiles._BYTES_PER_ELEMENT)
    padded = torch.arange(1, 30, dtype=torch.int64)
    offsets = torch.cumsum(padded, 0) - padded
    rows = int(padded.sum())
    assert _cpu_tiles.repeating_runs("copy_out", offsets, 2 * offsets, padded, 2, rows) is None
