"""Copies of any dtype ([Note: Raw copies] in ``fsdp_rs/kernels/_dtypes.py``).

The copies that only move bytes (all-gather copy-in into the same dtype,
copy-out, the reduce-scatter copy-ins and the post-reduce without cast,
division or accumulation) take every dtype: the Triton kernels (interpreted on
a CPU-only machine) against the torch references, and both against the naive
oracle of ``copy_oracle.py``, bit for bit. The steps that do arithmetic refuse
other dtypes with a TypeError naming the argument. The ops dispatch, run fake
and pass ``opcheck`` for such dtypes; a group of mixed dtypes planned in bytes
copies through the same ops. Last, the kernels' loop bounds in the interpreter
([Note: Loop bounds in the interpreter] in ``fsdp_rs/kernels/_triton.py``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import fsdp_rs.ops  # noqa: F401  (registers torch.ops.fsdp_rs)
from copy_oracle import rows_of, unsharded_of
from fsdp_rs import plan_group
from fsdp_rs.kernels import _cpu_index
from fsdp_rs.kernels._triton import _loop_bound_interpreted, loop_bound
from fsdp_rs.kernels.all_gather_copy_in import (
    torch_all_gather_copy_in,
    triton_all_gather_copy_in,
)
from fsdp_rs.kernels.all_gather_copy_out import triton_all_gather_copy_out
from fsdp_rs.kernels.post_reduce import triton_post_reduce
from fsdp_rs.kernels.reduce_scatter_copy_in import triton_reduce_scatter_copy_in
from fsdp_rs.kernels.reduce_scatter_copy_in_flat import triton_reduce_scatter_copy_in_flat
from fsdp_rs.ops import GroupTables
from fsdp_rs.planning import shapes_to_arrays

OPS = torch.ops.fsdp_rs
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"

# No arithmetic in Triton or torch for most of these; every width 1 to 16 bytes.
RAW_DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.uint16,  # no CPU index_select: the references need the integer view
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.complex64,
    torch.complex128,  # 16 bytes: two int64 words per element in the kernels
]
CASES = {
    "odd": [(17, 257), (13,), (7, 3, 5), (1,), (5, 1)],
    "empty": [(0,), (3,), (0, 4), (4, 0), (2, 2)],
    "huge_and_tiny": [(61, 33)] + [(1 + i % 3, 2) for i in range(20)],
}
WORLD_SIZES = [1, 3, 8]
TILE_NUMEL = 512  # big params span several tiles, as in test_kernels.py
INDEX_MODES = ["cached_index", "per_param_copies"]  # [Note: Cached CPU indices]
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _index_mode(monkeypatch, mode: str) -> None:
    if mode == "per_param_copies":
        monkeypatch.setattr(_cpu_index, "BUDGET", 0)


def raw_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the oracle computes in: the same-width integer (complex128 as itself)."""
    return _INTS.get(dtype.itemsize, dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(raw_dtype(t.dtype))


def make_plan(shapes, world_size, rank, dtype, tile_numel=TILE_NUMEL):
    size = dtype.itemsize
    return plan_group(
        *shapes_to_arrays(shapes), world_size, rank,
        orig_elem_size=size, param_elem_size=size, reduce_elem_size=size,
        tile_numel=tile_numel,
    )  # fmt: skip


def random_bits(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern (NaNs and all), except that a bool is 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def make_params(shapes, dtype, seed):
    return [random_bits(s, dtype, seed + i) for i, s in enumerate(shapes)]


def rows(params, plan, dtype):
    """The oracle's ``[W, S]`` rows, in ``dtype``."""
    return rows_of(list(map(raw, params)), plan, raw_dtype(dtype)).view(dtype)


def unsharded(params, plan, fill, dtype):
    return unsharded_of(list(map(raw, params)), plan, fill, raw_dtype(dtype)).view(dtype)


def filled(shape, dtype, value=-7) -> torch.Tensor:
    """A buffer of a recognizable bit pattern, to show what a copy left alone
    (for bool, True: torch normalizes other bytes of a bool as it copies)."""
    value = 1 if dtype == torch.bool else value
    return torch.full(shape, value, dtype=raw_dtype(dtype), device=DEVICE).view(dtype)


def assert_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.cpu().view(torch.uint8), expected.cpu().view(torch.uint8)
    assert torch.equal(a, e), f"{int((a != e).sum())} bytes differ"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", RAW_DTYPES, ids=dtype_id)
def test_all_gather_copy_in_raw(case, world_size, dtype):
    shapes = CASES[case]
    rank = world_size - 1
    plan = make_plan(shapes, world_size, rank, dtype)
    all_rows = rows(make_params(shapes, dtype, seed=0), plan, dtype)
    sharded = all_rows[rank].to(DEVICE)
    ref = filled((world_size, plan.row_numel), dtype)
    tri = ref.clone()
    OPS.all_gather_copy_in(sharded, ref, rank)
    triton_all_gather_copy_in(sharded, tri, rank)
    expected = filled((world_size, plan.row_numel), dtype).cpu()
    raw(expected)[rank] = raw(all_rows[rank])
    assert_bits(ref, expected)
    assert_bits(tri, expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", RAW_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_param", [False, True], ids=["group_buffer", "per_param"])
@pytest.mark.parametrize("index", INDEX_MODES)
def test_all_gather_copy_out_raw(case, world_size, dtype, per_param, index, monkeypatch):
    _index_mode(monkeypatch, index)
    shapes = CASES[case]
    plan = make_plan(shapes, world_size, 0, dtype)
    tables = GroupTables.from_plan(plan, DEVICE)
    params = make_params(shapes, dtype, seed=1)
    all_gather_output = rows(params, plan, dtype).to(DEVICE)
    expected = unsharded(params, plan, 1 if dtype == torch.bool else -7, dtype)

    def outputs():
        if not per_param:
            return [filled((plan.unsharded_numel,), dtype)]
        return [filled((world_size * n,), dtype) for n in plan.padded_sharded_numel.tolist()]

    def flatten(out):
        if not per_param:
            return out[0]
        result = filled((plan.unsharded_numel,), dtype).cpu()
        for t, off in zip(out, plan.unsharded_offsets.tolist(), strict=True):
            raw(result)[off : off + t.numel()] = raw(t.cpu())
        return result

    ref, tri = outputs(), outputs()
    OPS.all_gather_copy_out(all_gather_output, ref, *tables.copy_out_args())
    triton_all_gather_copy_out(all_gather_output, tri, *tables.copy_out_args())
    assert_bits(flatten(ref), expected)
    assert_bits(flatten(tri), expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", RAW_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("index", INDEX_MODES)
def test_reduce_scatter_copy_in_raw(case, world_size, dtype, index, monkeypatch):
    _index_mode(monkeypatch, index)
    shapes = CASES[case]
    plan = make_plan(shapes, world_size, 0, dtype)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = make_params(shapes, dtype, seed=2)
    grads[len(grads) // 2] = None  # contributes zeros: all zero bits
    dense = [
        g if g is not None else torch.zeros(s, dtype=dtype)
        for g, s in zip(grads, shapes, strict=True)
    ]
    expected = rows(dense, plan, dtype)
    on_device = [g.to(DEVICE) if g is not None else None for g in grads]
    ref = filled((world_size, plan.row_numel), dtype)
    tri = ref.clone()
    OPS.reduce_scatter_copy_in(on_device, ref, *tables.reduce_scatter_args())
    triton_reduce_scatter_copy_in(on_device, tri, *tables.reduce_scatter_args())
    assert_bits(ref, expected)  # every element written, gaps and padding zero
    assert_bits(tri, expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", RAW_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("index", INDEX_MODES)
def test_reduce_scatter_copy_in_flat_raw(case, world_size, dtype, index, monkeypatch):
    _index_mode(monkeypatch, index)
    shapes = CASES[case]
    plan = make_plan(shapes, world_size, 0, dtype)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = make_params(shapes, dtype, seed=4)
    buffer = unsharded(grads, plan, 0, dtype).to(DEVICE)
    expected = rows(grads, plan, dtype)
    ref = filled((world_size, plan.row_numel), dtype)
    tri = ref.clone()
    args = tables.reduce_scatter_flat_args()
    OPS.reduce_scatter_copy_in_flat(buffer, ref, *args)
    triton_reduce_scatter_copy_in_flat(buffer, tri, *args)
    assert_bits(ref, expected)
    assert_bits(tri, expected)


@pytest.mark.parametrize("numel", [0, 1, 17, 4097, 10_000])
@pytest.mark.parametrize("dtype", RAW_DTYPES, ids=dtype_id)
def test_post_reduce_raw(numel, dtype):
    output = random_bits((numel,), dtype, seed=numel).to(DEVICE)
    ref = filled((numel,), dtype)
    tri = ref.clone()
    OPS.post_reduce(output, ref)
    triton_post_reduce(output, tri)
    assert_bits(ref, output)
    assert_bits(tri, output)


@pytest.mark.parametrize("factor", [2.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=dtype_id)
def test_complex_division_and_accumulation_are_torchs(dtype, factor):
    """[Note: Complex gradients] complex gradients are divided (copy-ins,
    post-reduce) and accumulated (post-reduce) by torch's own complex ops, as
    FSDP2 does: the torch and Triton impls give those ops' bits exactly."""
    shapes, world_size = CASES["odd"], 3
    plan = make_plan(shapes, world_size, 0, dtype)
    tables = GroupTables.from_plan(plan, DEVICE)
    grads = [
        torch.randn(s, dtype=dtype, generator=torch.Generator().manual_seed(9)) for s in shapes
    ]
    grads[0].view(-1)[:2] = torch.tensor([complex(-0.0, 0.0), complex(0.0, -0.0)], dtype=dtype)
    expected = rows(grads, plan, dtype).to(DEVICE).div_(factor)
    on_device = [g.to(DEVICE) for g in grads]
    buffer = unsharded(grads, plan, 0, dtype).to(DEVICE)
    for copy_in, inputs, args in (
        (OPS.reduce_scatter_copy_in, on_device, tables.reduce_scatter_args()),
        (triton_reduce_scatter_copy_in, on_device, tables.reduce_scatter_args()),
        (OPS.reduce_scatter_copy_in_flat, buffer, tables.reduce_scatter_flat_args()),
        (triton_reduce_scatter_copy_in_flat, buffer, tables.reduce_scatter_flat_args()),
    ):
        out = filled((world_size, plan.row_numel), dtype)
        copy_in(inputs, out, *args, factor)
        assert_bits(out, expected)
    output, acc = expected[0].clone(), expected[1].clone()
    for accumulate in (False, True):
        want = acc.clone()
        if accumulate:
            want += output / factor
        else:
            want.copy_(output / factor)
        for post_reduce in (OPS.post_reduce, triton_post_reduce):
            got = acc.clone()
            post_reduce(output, got, factor, accumulate)
            assert_bits(got, want)


def test_float_copies_unchanged_by_raw_support():
    """A raw copy of a float dtype is the float copy: NaN payloads and -0.0 kept."""
    bits = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x3F800000], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).to(DEVICE)
    out = torch.zeros(2, 4, device=DEVICE)
    triton_all_gather_copy_in(x, out, 1)
    assert_bits(out[1], x)


# Arithmetic stays with the float dtypes: clear errors, from the CPU impls and the
# fake impls (meta tensors) alike.


def _copy_in(src_dtype, dst_dtype, device="cpu"):
    return (torch.zeros(4, dtype=src_dtype, device=device),
            torch.zeros(2, 4, dtype=dst_dtype, device=device), 0)  # fmt: skip


REFUSED = {
    "copy_in_float8_to_bf16": (
        lambda d: OPS.all_gather_copy_in(*_copy_in(torch.float8_e4m3fn, torch.bfloat16, d)),
        r"sharded has dtype torch\.float8_e4m3fn, but this call casts torch\.float8_e4m3fn to "
        r"torch\.bfloat16, which is supported for float32, bfloat16, float16 and float64",
    ),
    "copy_in_int64_to_float32": (
        lambda d: OPS.all_gather_copy_in(*_copy_in(torch.int64, torch.float32, d)),
        r"sharded has dtype torch\.int64, but this call casts torch\.int64 to torch\.float32"
        r".*allocate all_gather_output in the sharded buffer's dtype",
    ),
    "copy_in_float32_to_int32": (
        lambda d: OPS.all_gather_copy_in(*_copy_in(torch.float32, torch.int32, d)),
        r"all_gather_output has dtype torch\.int32",
    ),
    "post_reduce_divide_int64": (
        lambda d: OPS.post_reduce(
            torch.zeros(4, dtype=torch.int64, device=d),
            torch.zeros(4, dtype=torch.int64, device=d),
            2.0,
        ),
        r"reduce_scatter_output has dtype torch\.int64, but this call divides by divide_factor",
    ),
    "post_reduce_accumulate_float8": (
        lambda d: OPS.post_reduce(
            torch.zeros(4, dtype=torch.float8_e5m2, device=d),
            torch.zeros(4, dtype=torch.float8_e5m2, device=d),
            1.0,
            True,
        ),
        r"float8_e5m2, but this call accumulates.*accumulate=False",
    ),
    "post_reduce_cast_complex": (
        lambda d: OPS.post_reduce(
            torch.zeros(4, dtype=torch.complex64, device=d), torch.zeros(4, device=d)
        ),
        r"casts torch\.complex64 to torch\.float32",
    ),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", REFUSED)
def test_arithmetic_on_other_dtypes_is_refused(case, device):
    call, match = REFUSED[case]
    with pytest.raises(TypeError, match=match):
        call(device)


def _small_plan(dtype, world_size=2):
    return make_plan([(5, 3), (2,), (3, 1)], world_size, 0, dtype, tile_numel=4)


def test_reduce_scatter_copy_ins_refuse_arithmetic_on_other_dtypes():
    plan = _small_plan(torch.int64)
    tables = GroupTables.from_plan(plan)
    grads = [torch.zeros(s, dtype=torch.int64) for s in [(5, 3), (2,), (3, 1)]]
    rs = torch.zeros(2, plan.row_numel, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"each gradient has dtype torch\.int64, but this call "
                       r"divides by divide_factor"):  # fmt: skip
        OPS.reduce_scatter_copy_in(grads, rs, *tables.reduce_scatter_args(), 2.0)
    with pytest.raises(TypeError, match=r"casts torch\.int64 to torch\.float32"):
        OPS.reduce_scatter_copy_in(grads, rs.float(), *tables.reduce_scatter_args())
    buffer = torch.zeros(plan.unsharded_numel, dtype=torch.bool)
    rs = torch.zeros(2, plan.row_numel, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"grad_buffer has dtype torch\.bool.*divide_factor=1\.0"):
        OPS.reduce_scatter_copy_in_flat(buffer, rs, *tables.reduce_scatter_flat_args(), 3.0)


def test_quantized_tensors_are_refused():
    """The dispatcher has no quantized impl to pick; the checks say why anyway."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.zeros(4), 1.0, 0, torch.qint8)
    with pytest.raises(TypeError, match=r"sharded has dtype torch\.qint8, which is not plain"):
        torch_all_gather_copy_in(q, torch.zeros(2, 4, dtype=torch.int8), 0)


# The torch.library ops for these dtypes: opcheck (schema, fake impl, AOT
# dispatch) and torch.compile.


def _samples(dtype):
    plan = _small_plan(dtype, world_size=3)
    tables = GroupTables.from_plan(plan)
    shapes = [(5, 3), (2,), (3, 1)]
    params = make_params(shapes, dtype, seed=7)
    all_rows = rows(params, plan, dtype)
    grads = list(params)
    grads[1] = None
    return {
        "all_gather_copy_in": (
            all_rows[0].clone(), filled((3, plan.row_numel), dtype).cpu(), 0),
        "all_gather_copy_out": (
            all_rows, [filled((plan.unsharded_numel,), dtype).cpu()], *tables.copy_out_args()),
        "reduce_scatter_copy_in": (
            grads, filled((3, plan.row_numel), dtype).cpu(), *tables.reduce_scatter_args()),
        "reduce_scatter_copy_in_flat": (
            unsharded(params, plan, 0, dtype), filled((3, plan.row_numel), dtype).cpu(),
            *tables.reduce_scatter_flat_args()),
        "post_reduce": (all_rows[1].clone(), filled((plan.row_numel,), dtype).cpu()),
    }  # fmt: skip


OPCHECK_DTYPES = [torch.float8_e4m3fn, torch.bool, torch.uint16, torch.complex128]


@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", list(_samples(torch.uint8)))
def test_opcheck_raw(op, dtype):
    # opcheck's schema check compares results with arithmetic float8 lacks on CPU
    skip = ("test_schema",) if dtype.is_floating_point and dtype.itemsize == 1 else ()
    utils = tuple(u for u in torch.library._OPCHECK_DEFAULT_UTILS if u not in skip)
    torch.library.opcheck(getattr(OPS, op).default, _samples(dtype)[op], test_utils=utils)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int64], ids=dtype_id)
def test_compile_copy_out_raw(dtype):
    """Under torch.compile the runtime copies out into fresh per-param outputs."""
    ag, _, *tables = _samples(dtype)["all_gather_copy_out"]
    numels = [3 * n for n in tables[2].tolist()]

    def fn(ag):
        fresh = [torch.empty(n, dtype=ag.dtype) for n in numels]
        OPS.all_gather_copy_out(ag, fresh, *tables)
        return fresh

    torch._dynamo.reset()
    expected = fn(ag)
    actual = torch.compile(fn, backend="aot_eager", fullgraph=True)(ag)
    for a, e in zip(actual, expected, strict=True):
        assert_bits(a, e)


def test_mixed_dtype_group_as_bytes():
    """One group of several dtypes (float32, a frozen float8, int64, bool,
    complex64), FSDP2-style one byte buffer: each parameter planned with its
    bytes as a last dim (dim 0, and so the chunking, unchanged), every element
    size 1. The 16-byte alignment keeps every segment viewable as its dtype."""
    world_size = 3
    specs = [
        ((17, 5), torch.float32),
        ((7,), torch.float8_e4m3fn),
        ((4, 3), torch.int64),
        ((2,), torch.bool),
        ((5, 2), torch.complex64),
    ]
    params = [random_bits(s, d, seed=i) for i, (s, d) in enumerate(specs)]
    byte_shapes = [(*s, d.itemsize) for s, d in specs]
    as_bytes = [p.unsqueeze(-1).view(torch.uint8) for p in params]
    plan = make_plan(byte_shapes, world_size, 1, torch.uint8)
    tables = GroupTables.from_plan(plan, DEVICE)
    all_rows = rows_of(as_bytes, plan, torch.uint8)
    ag = torch.zeros(world_size, plan.row_numel, dtype=torch.uint8, device=DEVICE)
    for rank in range(world_size):  # each rank's copy-in; the all-gather fills the rest
        triton_all_gather_copy_in(all_rows[rank].to(DEVICE), ag, rank)
    ref = [torch.zeros(plan.unsharded_numel, dtype=torch.uint8, device=DEVICE)]
    tri = [torch.zeros_like(ref[0])]
    OPS.all_gather_copy_out(ag, ref, *tables.copy_out_args())
    triton_all_gather_copy_out(ag, tri, *tables.copy_out_args())
    assert_bits(tri[0], ref[0])
    offsets = plan.unsharded_offsets.tolist()
    for p, off, (shape, dtype) in zip(params, offsets, specs, strict=True):
        assert off % 16 == 0
        unsharded_param = ref[0][off : off + p.numel() * dtype.itemsize].view(dtype).view(shape)
        assert_bits(unsharded_param, p)
    for off, n, (_, dtype) in zip(
        plan.row_offsets.tolist(), plan.sharded_numel.tolist(), specs, strict=True
    ):
        assert off % 16 == 0
        ag[1, off : off + n].view(dtype)  # a sharded parameter: a view of its dtype


def test_loop_bound_in_the_interpreter():
    """A shape-(1,) scalar (how the interpreter holds one) becomes a Python int,
    which Triton before 3.7 cannot make of it under NumPy 2.4."""

    class Handle:
        data = np.array([4099], dtype=np.int64)

    class Scalar:
        handle = Handle()

    bound = _loop_bound_interpreted(Scalar())
    assert bound == 4099 and type(bound) is int
    assert _loop_bound_interpreted(7) == 7
    if INTERPRETED:
        assert loop_bound is _loop_bound_interpreted
    else:
        assert loop_bound is not _loop_bound_interpreted  # the inlined identity
