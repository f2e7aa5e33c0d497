"""Property tests: the Rust planner equals the pure-Python reference, and both
satisfy the layout invariants and reject bad input with the spec's exceptions.

The reference itself is checked against torch in ``test_planner_torch.py``.
Tests that need ``fsdp_rs._core`` are skipped until it is built.
"""

from __future__ import annotations

import gc
import math
import re
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_rs._core as core
from fsdp_rs.planning import reference as ref

INT64_MAX = 2**63 - 1
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["reference", "rust"])
def planner(request):
    return core if request.param == "rust" else ref


def tolist(table):
    return table.tolist() if hasattr(table, "tolist") else list(table)


def arrays(shapes):
    ndims = np.array([len(s) for s in shapes], dtype=np.int64)
    dims = np.array([d for s in shapes for d in s], dtype=np.int64)
    return ndims, dims


# ----------------------------------------------------------------------------- strategies

NUMEL_CAP = 200_000


def _cap(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shrink dim 0 so that the param stays small (tile tables stay small)."""
    inner = math.prod(shape[1:])
    if inner and shape[0] * inner > NUMEL_CAP:
        return (NUMEL_CAP // inner, *shape[1:])
    return shape


_dim0 = st.one_of(
    st.integers(0, 3), st.integers(0, 3000), st.sampled_from([17, 127, 128, 129, 257, 1024, 1025])
)
_inner_dim = st.one_of(st.integers(0, 6), st.sampled_from([17, 257, 1000]))
shapes_st = st.tuples(_dim0, st.lists(_inner_dim, max_size=3)).map(lambda t: _cap((t[0], *t[1])))
world_st = st.one_of(st.integers(1, 9), st.sampled_from([16, 31, 64, 127, 128, 1000, 1024]))
elem_st = st.sampled_from([1, 2, 4, 8])


@st.composite
def group_st(draw, max_params=40, max_world=1024, bulk=True):
    """A group: explicit (shrinkable) shapes, optionally plus thousands of seeded small ones."""
    shapes = draw(st.lists(shapes_st, max_size=max_params))
    if bulk and draw(st.booleans()):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        for _ in range(draw(st.integers(0, 3000))):
            ndim = int(rng.integers(1, 4))
            shapes.insert(
                int(rng.integers(0, len(shapes) + 1)),
                (int(rng.integers(0, 40)), *rng.integers(0, 8, ndim - 1).tolist()),
            )
    world = draw(world_st.filter(lambda w: w <= max_world))
    return shapes, world


@st.composite
def group_case_st(draw, **kwargs):
    shapes, world = draw(group_st(**kwargs))
    rank = draw(st.integers(0, world - 1))
    divisors = [f for f in range(1, world + 1) if world % f == 0]
    padded = sum(-(-s[0] // world) * math.prod(s[1:]) for s in shapes)
    lo = max(1, padded // 20_000)  # keep num_tiles <= ~20k
    tile = draw(st.one_of(st.integers(lo, lo + 64), st.sampled_from([1000, 65536, 2**31 - 1])))
    options = dict(
        orig_elem_size=draw(elem_st),
        param_elem_size=draw(st.none() | elem_st),
        reduce_elem_size=draw(st.none() | elem_st),
        alignment=draw(st.sampled_from([1, 2, 4, 8, 16, 64, 256])),
        post_forward_world_size=draw(st.none() | st.sampled_from(divisors)),
        tile_numel=max(tile, lo),
    )
    return shapes, world, rank, options


# ----------------------------------------------------------------------------- Rust == reference


@SETTINGS
@given(case=group_case_st())
def test_rust_group_plan_matches_reference(case):
    shapes, world, rank, options = case
    ndims, dims = arrays(shapes)
    ref.assert_plans_equal(
        core.plan_group(ndims, dims, world, rank, **options),
        ref.plan_group(ndims, dims, world, rank, **options),
    )


@SETTINGS
@given(
    case=group_case_st(),
    aligned_numel=st.one_of(st.just(0), st.sampled_from([1, 2, 4, 8, 16]), st.integers(0, 100)),
)
def test_rust_flat_plan_matches_reference(case, aligned_numel):
    shapes, world, rank, _ = case
    ndims, dims = arrays(shapes)
    ref.assert_plans_equal(
        core.plan_flat(ndims, dims, world, rank, aligned_numel=aligned_numel),
        ref.plan_flat(ndims, dims, world, rank, aligned_numel=aligned_numel),
    )


@pytest.mark.parametrize("world", [1, 3, 8])
def test_rust_empty_group_matches_reference(world):
    ndims, dims = arrays([])
    ref.assert_plans_equal(
        core.plan_group(ndims, dims, world, world - 1, post_forward_world_size=world),
        ref.plan_group(ndims, dims, world, world - 1, post_forward_world_size=world),
    )
    ref.assert_plans_equal(
        core.plan_flat(ndims, dims, world, 0, aligned_numel=4),
        ref.plan_flat(ndims, dims, world, 0, aligned_numel=4),
    )


@pytest.mark.parametrize(
    "shape",
    [(2**62, 0, 2**40), (0, 2**62), (3, 0, 2**40), (2**63 - 1, 0), (0, 2**31, 2**31 - 1)],
)
def test_rust_huge_but_valid_dims_match_reference(shape):
    # a zero dim keeps numel and every offset small; contiguous strides stay < 2**63
    ndims, dims = arrays([shape, (5,)])
    for world, rank in [(1, 0), (7, 6), (1024, 3)]:
        ref.assert_plans_equal(
            core.plan_group(ndims, dims, world, rank), ref.plan_group(ndims, dims, world, rank)
        )
        ref.assert_plans_equal(
            core.plan_flat(ndims, dims, world, rank), ref.plan_flat(ndims, dims, world, rank)
        )


_huge_dim = st.one_of(
    st.integers(0, 5),
    st.sampled_from(
        [2**k + d for k in (20, 31, 32, 40, 61, 62) for d in (-1, 0, 1)] + [2**63 - 2, 2**63 - 1]
    ),
)
_huge_pow2 = st.sampled_from([1, 2, 16, 256, 2**20, 2**40, 2**62])


def _estimated_tiles(shapes, world, align, tile_numel):
    tiles = 0
    for d0, *rest in shapes:
        n = -(-d0 // world) * math.prod(rest)
        tiles += -(-(-(-n // align) * align) // tile_numel)
    return tiles


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return ValueError


@SETTINGS
@given(
    shapes=st.lists(st.lists(_huge_dim, min_size=1, max_size=3).map(tuple), max_size=4),
    world=st.sampled_from([1, 2, 3, 8, 1024, 2**31, 2**62, 2**63 - 1]),
    rank_from_end=st.sampled_from([0, 1]),
    elem=st.sampled_from([1, 2, 4, 8]),
    alignment=_huge_pow2,
    tile_numel=st.sampled_from([1, 7, 65536, 2**31 - 1]),
    aligned_numel=st.one_of(_huge_pow2, st.just(0)),
)
def test_rust_matches_reference_on_huge_inputs(
    shapes, world, rank_from_end, elem, alignment, tile_numel, aligned_numel
):
    """Near the int64 limit both raise ValueError or both return the same plan."""
    rank = max(0, world - 1 - rank_from_end)
    ndims, dims = arrays(shapes)
    align = max(1, alignment // elem)
    tiles = _estimated_tiles(shapes, world, align, tile_numel)
    options = dict(orig_elem_size=elem, alignment=alignment, tile_numel=tile_numel)
    if tiles <= 100_000 or tiles > 2**31 - 1:  # otherwise a valid plan has a huge tile table
        want = _outcome(ref.plan_group, ndims, dims, world, rank, **options)
        got = _outcome(core.plan_group, ndims, dims, world, rank, **options)
        if want is ValueError or got is ValueError:
            assert got is want, (got, want)
        else:
            ref.assert_plans_equal(got, want)
    want = _outcome(ref.plan_flat, ndims, dims, world, rank, aligned_numel=aligned_numel)
    got = _outcome(core.plan_flat, ndims, dims, world, rank, aligned_numel=aligned_numel)
    if want is ValueError or got is ValueError:
        assert got is want, (got, want)
    else:
        ref.assert_plans_equal(got, want)


@SETTINGS
@given(
    groups=st.lists(
        st.tuples(*[st.sampled_from([0, 1, 2**61, 2**62, 2**63 - 1])] * 13, st.booleans()),
        max_size=4,
    ),
    prefetch=st.sampled_from([0, 1, 2**63 - 1]),
    flags=st.tuples(st.booleans(), st.booleans()),
    resident=st.sampled_from([0, 2**62, 2**63 - 1]),
)
def test_rust_peak_memory_overflow_matches_reference(groups, prefetch, flags, resident):
    args, kwargs = _memory_args(groups, prefetch, prefetch, flags, resident, resident)
    want = _outcome(ref.peak_memory, *args, **kwargs)
    got = _outcome(core.peak_memory, *args, **kwargs)
    assert (got if got is ValueError else dict(got)) == want


def test_rust_non_contiguous_input_is_read_correctly_or_rejected():
    ndims, dims = arrays([(17, 257), (5,), (3, 0, 2)])
    strided_ndims = np.repeat(ndims, 2)[::2]
    strided_dims = np.repeat(dims, 2)[::2]
    assert not strided_dims.flags.c_contiguous
    try:
        plan = core.plan_group(strided_ndims, strided_dims, 8, 3)
    except (TypeError, ValueError):
        return
    ref.assert_plans_equal(plan, ref.plan_group(ndims, dims, 8, 3))


# ----------------------------------------------------------------------------- invariants


def _check_layout(plan, shapes):
    world, align = plan.world_size, plan.align_numel
    n = tolist(plan.padded_sharded_numel)
    rows, split = tolist(plan.row_offsets), tolist(plan.split_sizes)
    unsharded = tolist(plan.unsharded_offsets)
    assert len(rows) == len(split) == len(unsharded) == len(shapes)
    assert sum(split) == plan.row_numel
    assert all(r % align == 0 for r in rows) and plan.row_numel % align == 0
    assert all(u % align == 0 for u in unsharded) and plan.unsharded_numel % align == 0
    ends = [*rows[1:], plan.row_numel]
    for p in range(len(shapes)):
        assert rows[p] + split[p] == ends[p]
        assert n[p] <= split[p] < n[p] + align  # padded shard plus alignment padding only
        unsharded_end = unsharded[p + 1] if p + 1 < len(shapes) else plan.unsharded_numel
        assert unsharded[p] + world * n[p] <= unsharded_end  # segments never overlap
        assert unsharded_end - unsharded[p] < world * n[p] + align
    # tiles cover [0, row_numel) exactly, in order, each within its param's segment
    tiles = zip(
        tolist(plan.tile_param), tolist(plan.tile_start), tolist(plan.tile_len), strict=True
    )
    pos = 0
    for p, start, length in tiles:
        assert 0 < length <= plan.tile_numel
        assert rows[p] + start == pos and start + length <= split[p]
        pos += length
    assert pos == plan.row_numel and plan.num_tiles == len(plan.tile_param)


def _check_metadata(plan, shapes):
    """Per-param sizes/strides restated from the spec, one shape at a time."""
    world, rank = plan.world_size, plan.rank
    offsets = tolist(plan.dim_offsets)
    tables = {
        name: tolist(getattr(plan, name))
        for name in (
            "sharded_sizes",
            "padded_sharded_sizes",
            "contiguous_strides",
            "sharded_rows",
            "chunk_rows",
            "numel",
            "sharded_numel",
            "padded_sharded_numel",
        )
    }
    assert offsets[-1] == len(tables["sharded_sizes"]) and len(offsets) == len(shapes) + 1
    for p, (d0, *rest) in enumerate(shapes):
        inner = math.prod(rest)
        c = -(-d0 // world)
        rows = max(0, min(c, d0 - rank * c)) if inner else 0
        dims = slice(offsets[p], offsets[p + 1])
        assert tables["sharded_sizes"][dims] == [rows, *rest]
        assert tables["padded_sharded_sizes"][dims] == [c, *rest]
        strides = [math.prod(max(d, 1) for d in rest[k:]) for k in range(len(rest) + 1)]
        assert tables["contiguous_strides"][dims] == strides
        assert (tables["chunk_rows"][p], tables["sharded_rows"][p]) == (c, rows)
        assert tables["numel"][p] == d0 * inner
        assert tables["sharded_numel"][p] == rows * inner
        assert tables["padded_sharded_numel"][p] == c * inner


@SETTINGS
@given(case=group_case_st())
def test_group_layout_invariants(planner, case):
    shapes, world, rank, options = case
    plan = planner.plan_group(*arrays(shapes), world, rank, **options)
    _check_layout(plan, shapes)
    _check_metadata(plan, shapes)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=group_st(max_params=30, max_world=128, bulk=False))
def test_rows_over_all_ranks_cover_dim0(planner, group):
    shapes, world = group
    ndims, dims = arrays(shapes)
    pf_world = max(f for f in (1, 2, 4, world) if world % f == 0)
    plans = [
        planner.plan_group(ndims, dims, world, r, post_forward_world_size=pf_world)
        for r in range(world)
    ]
    rows = np.array([np.asarray(plan.sharded_rows) for plan in plans])
    chunk = np.asarray(plans[0].chunk_rows)
    pf_rows = np.array(
        [np.asarray(plan.post_forward_sizes)[np.asarray(plan.dim_offsets)[:-1]] for plan in plans]
    )
    for p, shape in enumerate(shapes):
        d0, inner = shape[0], math.prod(shape[1:])
        want = d0 if inner > 0 else 0
        assert rows[:, p].sum() == want, (p, shape)
        assert pf_rows[:pf_world, p].sum() == want, (p, shape)
        assert (rows[:, p] <= chunk[p]).all()
        owners = np.flatnonzero(rows[:, p])  # rows are owned by a prefix of the ranks
        assert owners.tolist() == list(range(len(owners)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    group=group_st(max_params=30, max_world=128, bulk=False),
    aligned_numel=st.sampled_from([0, 1, 2, 4, 8, 16]),
)
def test_flat_shards_over_all_ranks_cover_every_param(planner, group, aligned_numel):
    shapes, world = group
    ndims, dims = arrays(shapes)
    covered = [0] * len(shapes)
    for rank in range(world):
        plan = planner.plan_flat(ndims, dims, world, rank, aligned_numel=aligned_numel)
        assert plan.shard_numel * world >= plan.flat_numel
        if aligned_numel:
            assert plan.flat_numel % world == 0
            assert all(o % aligned_numel == 0 for o in tolist(plan.flat_offsets))
        for p in range(len(shapes)):
            if plan.in_shard[p] and plan.numel_in_shard[p] > 0:
                covered[p] += int(plan.numel_in_shard[p])
                assert 0 <= plan.offset_in_shard[p] < plan.shard_numel
    assert covered == [math.prod(s) for s in shapes]


def test_reference_accepts_lists_and_numpy_alike():
    shapes = [(17, 257), (5,), (0, 3), (3, 0, 2)]
    ndims, dims = arrays(shapes)
    assert ref.plan_group(ndims, dims, 8, 3) == ref.plan_group(ndims.tolist(), dims.tolist(), 8, 3)
    assert ref.plan_flat(ndims, dims, 8, 3) == ref.plan_flat(list(ndims), list(dims), 8, 3)
    with pytest.raises(TypeError):
        ref.plan_group([1, 1], [2.0, 3.0], 8, 3)


# ----------------------------------------------------------------------------- bad input

GOOD = arrays([(17, 257), (5,), (3, 0, 2)])


def _bad_shapes(p, shape):
    shapes = [(3, 4)] * 10
    shapes[p] = shape
    return arrays(shapes)


def _raises_naming(exc, match_index, call):
    with pytest.raises(exc) as info:
        call()
    if match_index is not None:
        assert re.search(rf"\b{match_index}\b", str(info.value)), str(info.value)


BAD_GROUP_KWARGS = [
    ({"world_size": 0}, None),
    ({"world_size": -1, "rank": 0}, None),
    ({"rank": -1}, None),
    ({"rank": 8}, None),
    ({"alignment": 0}, None),
    ({"alignment": 3}, None),
    ({"alignment": 24}, None),
    ({"alignment": -16}, None),
    *[
        ({k: v}, None)
        for k in ("orig_elem_size", "param_elem_size", "reduce_elem_size")
        for v in (0, 3, 6, -4)
    ],
    ({"tile_numel": 0}, None),
    ({"tile_numel": -5}, None),
    ({"tile_numel": 2**31}, None),
    ({"post_forward_world_size": 0}, None),
    ({"post_forward_world_size": 3}, None),
    ({"post_forward_world_size": 16}, None),
    ({"post_forward_world_size": -8}, None),
]


@pytest.mark.parametrize(("kwargs", "index"), BAD_GROUP_KWARGS)
def test_group_rejects_bad_scalars(planner, kwargs, index):
    args = {"world_size": 8, "rank": 3, **kwargs}
    with pytest.raises(ValueError):
        planner.plan_group(*GOOD, args.pop("world_size"), args.pop("rank"), **args)


BAD_SHAPES = [
    ("0-dim", lambda: _bad_shapes(7, ())),
    ("dim < 0", lambda: _bad_shapes(7, (4, -1))),
    ("dim0 < 0", lambda: _bad_shapes(7, (-3,))),
    ("numel overflow", lambda: _bad_shapes(7, (2**32, 2**32))),
    ("numel overflow 3-D", lambda: _bad_shapes(7, (2**21, 2**21, 2**21))),
    ("numel overflow near max", lambda: _bad_shapes(7, (2**63 - 1, 2))),
]


@pytest.mark.parametrize(("what", "make"), BAD_SHAPES, ids=[b[0] for b in BAD_SHAPES])
def test_rejects_bad_shapes_naming_the_param(planner, what, make):
    ndims, dims = make()
    _raises_naming(ValueError, 7, lambda: planner.plan_group(ndims, dims, 8, 3))
    _raises_naming(ValueError, 7, lambda: planner.plan_flat(ndims, dims, 8, 3))


def test_rejects_negative_ndim_and_length_mismatch(planner):
    ndims, dims = _bad_shapes(7, (3,))
    bad_ndims = ndims.copy()
    bad_ndims[7] = -1
    for fn in (planner.plan_group, planner.plan_flat):
        _raises_naming(ValueError, 7, lambda fn=fn: fn(bad_ndims, dims, 8, 3))
        with pytest.raises(ValueError):
            fn(ndims, dims[:-1].copy(), 8, 3)
        with pytest.raises(ValueError):
            fn(ndims, np.append(dims, 5), 8, 3)
        with pytest.raises(ValueError):
            fn(ndims, dims, 0, 0)
        with pytest.raises(ValueError):
            fn(ndims, dims, 4, 4)
    with pytest.raises(ValueError):
        planner.plan_flat(ndims, dims, 8, 3, aligned_numel=-1)


HUGE_GROUPS = [
    # (shapes, world, options): every one overflows int64 somewhere the spec checks
    ([(2**63 - 1,)], 1, {}),  # row segment aligned up past 2**63 - 1
    ([(2**63 - 1,)], 2, {"orig_elem_size": 1, "alignment": 1}),  # W * S elements
    ([(2**63 - 1,)], 3, {"orig_elem_size": 1, "alignment": 1}),  # ceil(d0 / 3) * 3 > max
    ([(2**62,), (2**62,)], 1, {"orig_elem_size": 1, "alignment": 1}),  # second row offset
    ([(2**61,)], 1, {"orig_elem_size": 8}),  # sharded bytes
    ([(2**60,)], 1, {"orig_elem_size": 1, "param_elem_size": 8, "alignment": 1}),  # AG bytes
    ([(2**60,)], 16, {"orig_elem_size": 1, "reduce_elem_size": 8, "alignment": 1}),  # RS bytes
    ([(2**62,), (1,)], 1, {"orig_elem_size": 1, "alignment": 2**62}),  # aligned offset
    ([(1, 2**62, 4)], 1, {}),  # contiguous stride 2**64 (numel overflows too)
    ([(0, 2**40, 2**40)], 1, {}),  # numel 0 but contiguous stride 2**80
    ([(2**62, 2**62)], 1024, {}),
    ([(2**40, 2**40, 0)], 8, {}),  # numel 0, but a partial product overflows (torch rejects it)
    # more than 2**31 - 1 tiles (not in the spec; Rust rejects it, so the reference does)
    ([(2**40,)], 1, {"orig_elem_size": 1, "alignment": 1, "tile_numel": 1}),
]


@pytest.mark.parametrize(("shapes", "world", "options"), HUGE_GROUPS)
def test_group_huge_dims_raise_value_error(planner, shapes, world, options):
    with pytest.raises(ValueError):
        planner.plan_group(*arrays(shapes), world, world - 1, **options)


@pytest.mark.parametrize(
    ("shapes", "world"),
    [
        ([(2**62,), (2**62,)], 1),
        ([(2**63 - 1,), (1,)], 4),
        ([(2**40, 2**40)], 2),
        ([(2**40, 2**40, 0)], 2),  # partial product overflows
        ([(2**63 - 1,)], 2),  # end = c * (rank + 1) - 1 with c * W = 2**63
    ],
)
def test_flat_huge_dims_raise_value_error(planner, shapes, world):
    with pytest.raises(ValueError):
        planner.plan_flat(*arrays(shapes), world, world - 1, aligned_numel=0)


@pytest.mark.parametrize(
    "convert",
    [
        lambda a: a.astype(np.float64),
        lambda a: a.astype(np.int32),
        lambda a: a.astype(np.uint64),
        lambda a: a.tolist(),
        lambda a: a.reshape(1, -1),
    ],
    ids=["float64", "int32", "uint64", "list", "2-D"],
)
def test_rust_rejects_non_int64_arrays_with_type_error(convert):
    ndims, dims = GOOD
    for args in ((convert(ndims), dims), (ndims, convert(dims))):
        with pytest.raises(TypeError):
            core.plan_group(*args, 8, 3)
        with pytest.raises(TypeError):
            core.plan_flat(*args, 8, 3)
    groups = [np.array([1, 2], dtype=np.int64)] * 5
    for i in range(5):
        bad = list(groups)
        bad[i] = convert(bad[i])
        with pytest.raises(TypeError):
            core.peak_memory(*bad)


# ----------------------------------------------------------------------------- zero copy


GROUP_TABLES = [f.name for f in fields(ref.RefGroupPlan) if f.type.startswith("list")]
FLAT_TABLES = [f.name for f in fields(ref.RefFlatPlan) if f.type.startswith("list")]
MEMORY_FIELDS = [
    "sharded_bytes",
    "all_gather_bytes",
    "unsharded_bytes",
    "reduce_scatter_input_bytes",
    "reduce_scatter_output_bytes",
]


def test_rust_tables_are_read_only_zero_copy_views():
    ndims, dims = arrays([(17, 257), (5,), (3, 0, 2)])
    group = core.plan_group(ndims, dims, 8, 3, post_forward_world_size=4, tile_numel=100)
    flat = core.plan_flat(ndims, dims, 8, 3, aligned_numel=4)
    for plan, names in ((group, GROUP_TABLES), (flat, FLAT_TABLES)):
        for name in names:
            a, b = getattr(plan, name), getattr(plan, name)
            assert isinstance(a, np.ndarray) and a.ndim == 1 and len(a) > 0, name
            assert np.shares_memory(a, b), name
            assert a.base is plan, name
            assert not a.flags.writeable, name
            with pytest.raises(ValueError):
                a[0] = a[0]
            with pytest.raises(ValueError):
                a.setflags(write=True)
    want = group.split_sizes.tolist()
    table = group.split_sizes
    del group
    gc.collect()
    assert table.tolist() == want  # the array keeps its plan alive


# ----------------------------------------------------------------------------- peak memory


OPTIONAL_MEMORY_FIELDS = [
    "gradient_bytes",
    "unsharded_gradient_bytes",
    "accumulated_gradient_bytes",
    "activation_bytes",
    "post_forward_bytes",
    "output_bytes",
    "backward_bytes",
    "reduce_scatter_kept_bytes",
]


def _memory_args(groups, prefetch, forward_prefetch, flags, resident, loss):
    """``peak_memory``'s arguments from per-group tuples (five required byte
    counts, eight optional ones, and reshard_after_forward) and the schedule
    (``flags``: accumulate, side streams)."""
    n = len(groups)
    columns = [np.array([g[i] for g in groups], dtype=np.int64) for i in range(13)]
    kwargs = dict(zip(OPTIONAL_MEMORY_FIELDS, columns[5:], strict=True))
    kwargs["reshard_after_forward"] = np.array([g[13] for g in groups], dtype=bool).reshape(n)
    kwargs.update(
        prefetch=prefetch,
        forward_prefetch=forward_prefetch,
        accumulate=flags[0],
        side_streams=flags[1],
        resident_bytes=resident,
        loss_bytes=loss,
    )
    return columns[:5], kwargs


@SETTINGS
@given(
    groups=st.lists(st.tuples(*[st.integers(0, 2**40)] * 13, st.booleans()), max_size=30),
    prefetch=st.one_of(st.integers(0, 4), st.integers(0, 2**63 - 1)),
    forward_prefetch=st.integers(0, 3),
    flags=st.tuples(st.booleans(), st.booleans()),
    resident=st.integers(0, 2**40),
)
def test_rust_peak_memory_matches_reference(groups, prefetch, forward_prefetch, flags, resident):
    args, kwargs = _memory_args(groups, prefetch, forward_prefetch, flags, resident, resident // 3)
    assert dict(core.peak_memory(*args, **kwargs)) == ref.peak_memory(*args, **kwargs)
    # The optional arrays' defaults.
    bare = {k: kwargs[k] for k in ("prefetch", "reshard_after_forward")}
    assert dict(core.peak_memory(*args, **bare)) == ref.peak_memory(*args, **bare)


def _example(**kwargs):
    """Three groups: the worked examples of [Note: Memory model]'s Rust tests."""
    columns = [[10, 20, 30], [80, 160, 240], [80, 160, 240], [160, 320, 480], [20, 40, 60]]
    return [np.array(c, dtype=np.int64) for c in columns], kwargs


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        # forward g=2: 240 + 240 (the previous all-gather output released before
        # this copy-out; this one kept through the compute); backward: g=1
        # computing (80 in flight + 160 + 160 + g=2's reduce-scatter input 480 + 60
        # reduced); g=2 reducing is 160 in flight + 480 + its gradients 240.
        ({}, (60, 480, 940)),
        # no side streams: each output freed at its copy-out, and g=1 gathers its
        # 160 bytes of gradients where g=2's reduce-scatter input was.
        ({"side_streams": False}, (60, 480, 880)),
        # g=2 a module of two groups whose second releases the first's input: g=1
        # computes beside the last one's 80 (540), so g=2 reducing is the peak.
        ({"reduce_scatter_kept_bytes": [160, 320, 80]}, (60, 480, 880)),
        # activations (5, 6, 7), outputs (1, 2, 3), g=0 kept unsharded: forward g=2
        # after its compute 11 + 80 + 7 + 3 + 240 + 240; backward g=2 reducing 11 +
        # 80 + 160 + 2 + 480 + 240.
        (
            {
                "activation_bytes": [5, 6, 7],
                "output_bytes": [1, 2, 3],
                "reshard_after_forward": [False, True, True],
            },
            (60, 581, 973),
        ),
        # ... accumulating: every unsharded gradient (480) through forward; a
        # micro-step without sync at g=2 adds fresh ones (240); 7 resident bytes.
        (
            {
                "activation_bytes": [5, 6, 7],
                "output_bytes": [1, 2, 3],
                "reshard_after_forward": [False, True, True],
                "accumulate": True,
                "resident_bytes": 7,
            },
            (67, 1061, 1223),
        ),
        # the loss: g=0 kept unsharded 80 + 1000 (the last all-gather output is
        # released at the root's post-forward); forward g=2: 80 + 240 + 240
        ({"loss_bytes": 1000, "reshard_after_forward": [False, True, True]}, (60, 560, 1080)),
        # resharded to a smaller world, each group keeps 40 bytes from forward:
        # forward g=1 40 + 160 + 160 + 240 prefetched; backward g=1 computing 40 + 80
        # + 160 + 160 + 480 + 60.
        ({"post_forward_bytes": [40, 40, 40], "forward_prefetch": 1}, (60, 600, 980)),
        # g=1's backward measured to hold 500 at once (a transient above its
        # gradients): computing g=1 is 80 in flight + 160 + 500 + 480 + 60.
        ({"backward_bytes": [0, 500, 0]}, (60, 480, 1280)),
        # measured below its own gradients (160): they still count.
        ({"backward_bytes": [0, 100, 0]}, (60, 480, 940)),
    ],
    ids=[
        "side-streams",
        "no-side-streams",
        "several-groups-kept",
        "activations",
        "accumulate",
        "loss",
        "post-forward",
        "backward-measured",
        "backward-below-gradients",
    ],
)
def test_peak_memory_worked_examples(planner, kwargs, want):
    args, kwargs = _example(**kwargs)
    for key in (
        "activation_bytes",
        "output_bytes",
        "post_forward_bytes",
        "backward_bytes",
        "reduce_scatter_kept_bytes",
    ):
        if key in kwargs:
            kwargs[key] = np.array(kwargs[key], dtype=np.int64)
    if isinstance(kwargs.get("reshard_after_forward"), list):
        kwargs["reshard_after_forward"] = np.array(kwargs["reshard_after_forward"])
    got = planner.peak_memory(*args, gradient_bytes=args[4], **kwargs)
    persistent, forward, backward = want
    assert dict(got) == {
        "persistent": persistent,
        "forward": forward,
        "backward": backward,
        "peak": persistent + max(forward, backward),
    }


@SETTINGS
@given(cases=st.lists(group_case_st(max_params=8, bulk=False), min_size=1, max_size=6))
def test_peak_memory_of_planned_groups(planner, cases):
    plans = [planner.plan_group(*arrays(s), w, r, **o) for s, w, r, o in cases]
    columns = [np.array([getattr(p, k) for p in plans], dtype=np.int64) for k in MEMORY_FIELDS]
    for prefetch, reshard in [(0, True), (1, True), (2, False), (100, False)]:
        got = planner.peak_memory(*columns, prefetch=prefetch, reshard_after_forward=reshard)
        assert dict(got) == ref.peak_memory(
            *columns, prefetch=prefetch, reshard_after_forward=reshard
        )


def test_peak_memory_rejects_bad_input(planner):
    ok = [np.array([1, 2, 3], dtype=np.int64)] * 5
    with pytest.raises(ValueError, match="reduce_scatter_output_bytes has 2 groups"):
        planner.peak_memory(*ok[:4], np.array([1, 2], dtype=np.int64))
    for i in range(5):
        bad = list(ok)
        bad[i] = np.array([1, -2, 3], dtype=np.int64)
        with pytest.raises(ValueError):
            planner.peak_memory(*bad)
    for name in OPTIONAL_MEMORY_FIELDS:
        with pytest.raises(ValueError, match=name):
            planner.peak_memory(*ok, **{name: np.array([1, -2, 3], dtype=np.int64)})
        with pytest.raises(ValueError, match=name):
            planner.peak_memory(*ok, **{name: np.array([1], dtype=np.int64)})
    with pytest.raises(ValueError, match="reshard_after_forward"):
        planner.peak_memory(*ok, reshard_after_forward=np.array([True, False]))
    for name in ("prefetch", "forward_prefetch", "resident_bytes", "loss_bytes"):
        with pytest.raises(ValueError, match=name):
            planner.peak_memory(*ok, **{name: -1})
    huge = [np.array([2**62, 2**62], dtype=np.int64)] * 5
    with pytest.raises(ValueError):
        planner.peak_memory(*huge)


def test_rust_peak_memory_rejects_wrong_types():
    ok = [np.array([1, 2, 3], dtype=np.int64)] * 5
    with pytest.raises(TypeError, match="reshard_after_forward"):
        core.peak_memory(*ok, reshard_after_forward=np.array([1, 0, 1]))
    with pytest.raises(TypeError, match="activation_bytes"):
        core.peak_memory(*ok, activation_bytes=[1, 2, 3])


@pytest.mark.parametrize(
    ("column", "prefetch", "reshard"),
    [(2, 1, True), (1, 0, True), (1, 0, False)],
    ids=["unsharded-reshard", "all_gather-prefetch0", "all_gather-no-reshard"],
)
def test_peak_memory_no_spurious_overflow(planner, column, prefetch, reshard):
    """Sums the model never takes (e.g. all groups' unsharded bytes when resharding
    after forward) must not overflow: only the reported quantities are checked."""
    columns = [np.zeros(2, dtype=np.int64) for _ in range(5)]
    columns[column] = np.array([2**62, 2**62], dtype=np.int64)
    kwargs = dict(prefetch=prefetch, reshard_after_forward=reshard, side_streams=False)
    kwargs["unsharded_gradient_bytes"] = np.zeros(2, dtype=np.int64)
    got = planner.peak_memory(*columns, **kwargs)
    assert dict(got)["peak"] == 2**62
    assert dict(got) == ref.peak_memory(*columns, **kwargs)
