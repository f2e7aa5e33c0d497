"""Pure-Python reference planner: the oracle for ``fsdp_rs._core``.

This module implements ``plan_group``, ``plan_flat`` and ``peak_memory`` exactly
as written in the planner spec, one parameter at a time with plain Python ints.
It exists for two reasons:

* it is the test oracle: the Rust planner must produce the same tables, the same
  scalars and the same exception types (``tests/test_planner_reference.py``), and
  the reference itself is checked against torch's own FSDP2 ``FSDPParam`` and
  FSDP1 ``FlatParamHandle`` metadata (``tests/test_planner_torch.py``);
* it is the benchmark baseline: the per-parameter Python loop the Rust planner
  replaces.

Keep it obviously correct rather than clever: no vectorization, exact integer
arithmetic, and an explicit check wherever the Rust side works in int64.
Inputs may be any sequences of ints (NumPy arrays are converted with
``.tolist()``); tables come back as Python lists in frozen dataclasses whose
attribute names match ``fsdp_rs._core.GroupPlan`` / ``FlatPlan``.
``plan_differences`` / ``assert_plans_equal`` compare a Rust plan with a
reference plan field by field.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_right
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "RefFlatPlan",
    "RefGroupPlan",
    "assert_plans_equal",
    "peak_memory",
    "plan_differences",
    "plan_flat",
    "plan_group",
]

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RefGroupPlan:
    """Reference twin of ``fsdp_rs._core.GroupPlan`` (tables are lists)."""

    num_params: int
    world_size: int
    rank: int
    post_forward_world_size: int | None
    post_forward_rank: int | None
    orig_elem_size: int
    param_elem_size: int
    reduce_elem_size: int
    alignment: int
    align_numel: int
    tile_numel: int
    row_numel: int
    unsharded_numel: int
    num_tiles: int
    dim_offsets: list[int]
    numel: list[int]
    chunk_rows: list[int]
    sharded_rows: list[int]
    sharded_numel: list[int]
    padded_sharded_numel: list[int]
    sharded_sizes: list[int]
    padded_sharded_sizes: list[int]
    contiguous_strides: list[int]
    post_forward_sizes: list[int] | None
    row_offsets: list[int]
    split_sizes: list[int]
    unsharded_offsets: list[int]
    tile_param: list[int]
    tile_start: list[int]
    tile_len: list[int]
    sharded_bytes: int
    all_gather_bytes: int
    unsharded_bytes: int
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    plan_bytes: int


@dataclass(frozen=True)
class RefFlatPlan:
    """Reference twin of ``fsdp_rs._core.FlatPlan`` (tables are lists)."""

    num_params: int
    world_size: int
    rank: int
    aligned_numel: int
    flat_numel: int
    shard_numel: int
    shard_numel_padded: int
    flat_offsets: list[int]
    numel: list[int]
    in_shard: list[bool]
    offset_in_shard: list[int]
    numel_in_shard: list[int]
    intra_param_start: list[int]
    intra_param_end: list[int]
    plan_bytes: int


# Element type of each table on the Rust side; everything else is int64.
TABLE_DTYPES = {"tile_param": "int32", "tile_len": "int32", "in_shard": "bool"}


# ----------------------------------------------------------------------------- validation


def _int(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _int_list(values: Any, name: str) -> list[int]:
    if hasattr(values, "tolist"):  # NumPy array (or scalar, rejected below)
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = list(values)
    if not all(type(v) is int for v in out):
        out = [_int(v, f"{name} entries") for v in out]
    return out


def _pow2(value: Any, name: str) -> int:
    value = _int(value, name)
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {value}")
    return value


def _check_world(world_size: Any, rank: Any) -> tuple[int, int]:
    world_size, rank = _int(world_size, "world_size"), _int(rank, "rank")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return world_size, rank


def _check_shapes(ndims: list[int], dims: list[int]) -> list[int]:
    """Validate the flat shape arrays; return ``dim_offsets`` (P + 1 prefix sums)."""
    if len(ndims) > INT32_MAX:
        raise ValueError(f"at most {INT32_MAX} params per group, got {len(ndims)}")
    if ndims and min(ndims) < 1:
        p = next(p for p, k in enumerate(ndims) if k < 1)
        what = "is 0-dim (scalars cannot be sharded on dim 0)" if ndims[p] == 0 else "ndim < 0"
        raise ValueError(f"param {p} {what}: ndims[{p}] = {ndims[p]}")
    dim_offsets = [0] * (len(ndims) + 1)
    total = 0
    for p, k in enumerate(ndims):
        total += k
        dim_offsets[p + 1] = total
    if total != len(dims):
        raise ValueError(f"len(dims) = {len(dims)} but sum(ndims) = {total}")
    if dims and (min(dims) < 0 or max(dims) > INT64_MAX):
        i = next(i for i, d in enumerate(dims) if d < 0 or d > INT64_MAX)
        p = bisect_right(dim_offsets, i) - 1
        shape = tuple(dims[dim_offsets[p] : dim_offsets[p + 1]])
        raise ValueError(f"param {p} has a dim outside [0, int64 max]: shape {shape}")
    return dim_offsets


def _overflow(what: str, value: int) -> ValueError:
    return ValueError(f"{what} = {value} overflows int64 (max {INT64_MAX})")


def _check_numel(p: int, shape: list[int], numel: int) -> None:
    """Numel overflows if any left-to-right partial product does (as in torch and Rust):
    ``(2**40, 2**40, 0)`` is rejected although its numel is 0."""
    if numel > INT64_MAX:
        raise _overflow(f"param {p} numel of shape {tuple(shape)}", numel)
    if numel == 0:
        partial = 1
        for d in shape:
            partial *= d
            if partial > INT64_MAX:
                raise _overflow(f"param {p} partial numel of shape {tuple(shape)}", partial)


# ----------------------------------------------------------------------------- FSDP2 group


def plan_group(
    ndims: Any,
    dims: Any,
    world_size: int,
    rank: int,
    *,
    orig_elem_size: int = 4,
    param_elem_size: int | None = None,
    reduce_elem_size: int | None = None,
    alignment: int = 16,
    post_forward_world_size: int | None = None,
    tile_numel: int = 65536,
) -> RefGroupPlan:
    """Plan one FSDP2 parameter group (see ``fsdp_rs._core.plan_group``)."""
    ndims, dims = _int_list(ndims, "ndims"), _int_list(dims, "dims")
    world, rank = _check_world(world_size, rank)
    orig = _pow2(orig_elem_size, "orig_elem_size")
    param = orig if param_elem_size is None else _pow2(param_elem_size, "param_elem_size")
    reduce = orig if reduce_elem_size is None else _pow2(reduce_elem_size, "reduce_elem_size")
    alignment = _pow2(alignment, "alignment")
    tile_numel = _int(tile_numel, "tile_numel")
    if not 1 <= tile_numel <= INT32_MAX:
        raise ValueError(f"tile_numel must be in [1, {INT32_MAX}], got {tile_numel}")
    pf_world = pf_rank = None
    if post_forward_world_size is not None:
        pf_world = _int(post_forward_world_size, "post_forward_world_size")
        if not 1 <= pf_world <= world or world % pf_world:
            raise ValueError(
                f"post_forward_world_size must divide world_size {world}, got {pf_world}"
            )
        pf_rank = rank % pf_world
    dim_offsets = _check_shapes(ndims, dims)
    num_params = len(ndims)
    align = max(1, alignment // min(orig, param, reduce))

    numel = [0] * num_params
    chunk_rows = [0] * num_params
    sharded_rows = [0] * num_params
    sharded_numel = [0] * num_params
    padded_numel = [0] * num_params
    row_offsets = [0] * num_params
    split_sizes = [0] * num_params
    unsharded_offsets = [0] * num_params
    sharded_sizes = list(dims)
    padded_sizes = list(dims)
    pf_sizes = list(dims) if pf_world is not None else None
    strides = [1] * len(dims)
    row = unsharded = 0
    for p in range(num_params):
        lo, hi = dim_offsets[p], dim_offsets[p + 1]
        # contiguous strides (torch make_contiguous_strides_for) and inner numel
        stride = inner = 1
        for k in range(hi - 1, lo, -1):
            strides[k] = stride
            d = dims[k]
            stride *= d if d > 1 else 1
            inner *= d
        strides[lo] = stride
        d0 = dims[lo]
        if stride > INT64_MAX:
            raise _overflow(f"param {p} stride of shape {tuple(dims[lo:hi])}", stride)
        numel[p] = n_total = d0 * inner
        if n_total > INT64_MAX or n_total == 0:
            _check_numel(p, dims[lo:hi], n_total)
        # dim-0 chunking (torch.chunk + _get_dim_chunked_size)
        c = -(-d0 // world)
        rows = max(0, min(c, d0 - rank * c)) if inner else 0
        n = c * inner
        chunk_rows[p] = c
        sharded_rows[p] = rows
        sharded_numel[p] = rows * inner
        padded_numel[p] = n
        sharded_sizes[lo] = rows
        padded_sizes[lo] = c
        if pf_sizes is not None:
            cf = -(-d0 // pf_world)
            pf_sizes[lo] = max(0, min(cf, d0 - pf_rank * cf)) if inner else 0
        # row layout and unsharded layout, each segment aligned to `align` elements
        row_offsets[p] = row
        end = -(-(row + n) // align) * align
        if end > INT64_MAX:
            raise _overflow(f"param {p} row offset", end)
        split_sizes[p] = end - row
        row = end
        unsharded_offsets[p] = unsharded
        unsharded = -(-(unsharded + world * n) // align) * align
        if unsharded > INT64_MAX:
            raise _overflow(f"param {p} unsharded offset", unsharded)

    memory = {
        "sharded_bytes": row * orig,
        "all_gather_bytes": world * row * param,
        "unsharded_bytes": unsharded * param,
        "reduce_scatter_input_bytes": world * row * reduce,
        "reduce_scatter_output_bytes": row * reduce,
    }
    for name, value in memory.items():
        if value > INT64_MAX:
            raise _overflow(name, value)

    num_tiles = sum(-(-seg // tile_numel) for seg in split_sizes)
    if num_tiles > INT32_MAX:  # a CUDA grid dimension; not in the spec, but Rust checks it
        raise ValueError(f"{num_tiles} tiles of {tile_numel} elements; raise tile_numel")
    tile_param: list[int] = []
    tile_start: list[int] = []
    tile_len: list[int] = []
    for p, seg in enumerate(split_sizes):
        if seg <= tile_numel:
            if seg:
                tile_param.append(p)
                tile_start.append(0)
                tile_len.append(seg)
            continue
        full, rest = divmod(seg, tile_numel)
        tile_param.extend([p] * (full + (rest > 0)))
        tile_start.extend(range(0, seg, tile_numel))
        tile_len.extend([tile_numel] * full)
        if rest:
            tile_len.append(rest)

    num_dims = len(dims) * (4 if pf_sizes is not None else 3)
    # int64 tables: dim_offsets, 8 per-param tables, 3 or 4 per-dim tables; tiles 4 + 8 + 4 bytes
    plan_bytes = 8 * (num_params + 1 + 8 * num_params + num_dims) + 16 * num_tiles
    return RefGroupPlan(
        num_params=num_params,
        world_size=world,
        rank=rank,
        post_forward_world_size=pf_world,
        post_forward_rank=pf_rank,
        orig_elem_size=orig,
        param_elem_size=param,
        reduce_elem_size=reduce,
        alignment=alignment,
        align_numel=align,
        tile_numel=tile_numel,
        row_numel=row,
        unsharded_numel=unsharded,
        num_tiles=num_tiles,
        dim_offsets=dim_offsets,
        numel=numel,
        chunk_rows=chunk_rows,
        sharded_rows=sharded_rows,
        sharded_numel=sharded_numel,
        padded_sharded_numel=padded_numel,
        sharded_sizes=sharded_sizes,
        padded_sharded_sizes=padded_sizes,
        contiguous_strides=strides,
        post_forward_sizes=pf_sizes,
        row_offsets=row_offsets,
        split_sizes=split_sizes,
        unsharded_offsets=unsharded_offsets,
        tile_param=tile_param,
        tile_start=tile_start,
        tile_len=tile_len,
        plan_bytes=plan_bytes,
        **memory,
    )


# ----------------------------------------------------------------------------- FSDP1 flat


def plan_flat(
    ndims: Any, dims: Any, world_size: int, rank: int, *, aligned_numel: int = 0
) -> RefFlatPlan:
    """FSDP1 ``FlatParamHandle`` metadata (see ``fsdp_rs._core.plan_flat``)."""
    ndims, dims = _int_list(ndims, "ndims"), _int_list(dims, "dims")
    world, rank = _check_world(world_size, rank)
    aligned = _int(aligned_numel, "aligned_numel")
    if aligned < 0:
        raise ValueError(f"aligned_numel must be >= 0, got {aligned}")
    dim_offsets = _check_shapes(ndims, dims)
    num_params = len(ndims)

    numel = [0] * num_params
    flat_offsets = [0] * num_params
    total = 0
    for p in range(num_params):
        shape = dims[dim_offsets[p] : dim_offsets[p + 1]]
        n = math.prod(shape)
        if n > INT64_MAX or n == 0:
            _check_numel(p, shape, n)
        if aligned > 0 and total % aligned:
            total += aligned - total % aligned
        numel[p] = n
        flat_offsets[p] = total
        total += n
        if total > INT64_MAX:
            raise _overflow(f"param {p} flat offset", total)
    if aligned > 0 and total % world:
        total += world - total % world
        if total > INT64_MAX:
            raise _overflow("flat numel", total)

    c = -(-total // world)
    padded = c - max(0, min(c, total - rank * c))
    start = c * rank
    end = c * (rank + 1) - 1  # inclusive
    if end + 1 > INT64_MAX:  # the spec checks the product c * (rank + 1)
        raise _overflow(f"rank {rank} shard end + 1", end + 1)
    in_shard = [False] * num_params
    offset_in_shard = [-1] * num_params
    numel_in_shard = [-1] * num_params
    intra_start = [-1] * num_params
    intra_end = [-1] * num_params
    for p in range(num_params):
        pstart = flat_offsets[p]
        pend = pstart + numel[p] - 1
        if start <= pend and end >= pstart:
            in_shard[p] = True
            if start <= pstart:
                first, offset_in_shard[p] = 0, pstart - start
            else:
                first, offset_in_shard[p] = start - pstart, 0
            last = min(pend, end) - pstart
            intra_start[p], intra_end[p] = first, last
            numel_in_shard[p] = last - first + 1
    return RefFlatPlan(
        num_params=num_params,
        world_size=world,
        rank=rank,
        aligned_numel=aligned,
        flat_numel=total,
        shard_numel=c,
        shard_numel_padded=padded,
        flat_offsets=flat_offsets,
        numel=numel,
        in_shard=in_shard,
        offset_in_shard=offset_in_shard,
        numel_in_shard=numel_in_shard,
        intra_param_start=intra_start,
        intra_param_end=intra_end,
        plan_bytes=49 * num_params,  # six int64 tables + one bool table
    )


# ----------------------------------------------------------------------------- memory


def peak_memory(
    sharded_bytes: Any,
    all_gather_bytes: Any,
    unsharded_bytes: Any,
    reduce_scatter_input_bytes: Any,
    reduce_scatter_output_bytes: Any,
    *,
    prefetch: int = 1,
    forward_prefetch: int = 0,
    reshard_after_forward: Any = True,
    gradient_bytes: Any = None,
    unsharded_gradient_bytes: Any = None,
    accumulated_gradient_bytes: Any = None,
    activation_bytes: Any = None,
    post_forward_bytes: Any = None,
    output_bytes: Any = None,
    backward_bytes: Any = None,
    reduce_scatter_kept_bytes: Any = None,
    resident_bytes: int = 0,
    loss_bytes: int = 0,
    accumulate: bool = False,
    side_streams: bool = True,
) -> dict[str, int]:
    """Peak bytes of one training step (see ``fsdp_rs._core.peak_memory`` and
    [Note: Memory model]): every moment of the step written out as the sum of
    what is live then, one group at a time."""
    named = {
        "sharded_bytes": sharded_bytes,
        "all_gather_bytes": all_gather_bytes,
        "unsharded_bytes": unsharded_bytes,
        "reduce_scatter_input_bytes": reduce_scatter_input_bytes,
        "reduce_scatter_output_bytes": reduce_scatter_output_bytes,
    }
    arrays = {k: _int_list(v, k) for k, v in named.items()}
    n = len(arrays["sharded_bytes"])

    def given_or(name: str, given: Any, default: list[int]) -> None:
        arrays[name] = default if given is None else _int_list(given, name)

    given_or("gradient_bytes", gradient_bytes, arrays["reduce_scatter_output_bytes"])
    given_or("unsharded_gradient_bytes", unsharded_gradient_bytes, arrays["unsharded_bytes"])
    given_or(
        "accumulated_gradient_bytes",
        accumulated_gradient_bytes,
        arrays["unsharded_gradient_bytes"],
    )
    given_or(
        "reduce_scatter_kept_bytes",
        reduce_scatter_kept_bytes,
        arrays["reduce_scatter_input_bytes"],
    )
    for name, given in (
        ("activation_bytes", activation_bytes),
        ("post_forward_bytes", post_forward_bytes),
        ("output_bytes", output_bytes),
        ("backward_bytes", backward_bytes),
    ):
        given_or(name, given, [0] * n)
    counts = {
        "prefetch": prefetch,
        "forward_prefetch": forward_prefetch,
        "resident_bytes": resident_bytes,
        "loss_bytes": loss_bytes,
    }
    counts = {name: _int(value, name) for name, value in counts.items()}
    for name, flag in (("accumulate", accumulate), ("side_streams", side_streams)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if isinstance(reshard_after_forward, bool):
        resharded = [reshard_after_forward] * n
    else:
        if hasattr(reshard_after_forward, "tolist"):
            reshard_after_forward = reshard_after_forward.tolist()
        resharded = list(reshard_after_forward)
        if not all(isinstance(r, bool) for r in resharded):
            raise TypeError("reshard_after_forward must be a bool or a sequence of bools")
        if len(resharded) != n:
            raise ValueError(
                f"reshard_after_forward has {len(resharded)} groups, sharded_bytes has {n}"
            )
    for name, values in arrays.items():
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} groups, sharded_bytes has {n}")
        if values and min(values) < 0:
            g = next(g for g, v in enumerate(values) if v < 0)
            raise ValueError(f"{name}[{g}] = {values[g]} < 0")
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    k, kf, resident, loss = counts.values()
    sharded, ag, unsh = (
        arrays["sharded_bytes"],
        arrays["all_gather_bytes"],
        arrays["unsharded_bytes"],
    )
    rs_in, rs_out = arrays["reduce_scatter_input_bytes"], arrays["reduce_scatter_output_bytes"]
    grad, ugrad = arrays["gradient_bytes"], arrays["unsharded_gradient_bytes"]
    acc = arrays["accumulated_gradient_bytes"]
    act, post, out, measured = (
        arrays["activation_bytes"],
        arrays["post_forward_bytes"],
        arrays["output_bytes"],
        arrays["backward_bytes"],
    )
    held = [post[g] if resharded[g] else unsh[g] for g in range(n)]  # forward to backward

    def total(values: list[int], groups: range) -> int:
        return sum(values[j] for j in groups)

    accumulated = total(acc, range(n)) if accumulate else 0  # from earlier micro-steps
    forward = backward = 0
    for g in range(n):
        before = total(act, range(g)) + total(held, range(g))
        # With side streams an all-gather output lives through its group's compute,
        # until the next group waits for its own (before that one's copy-out).
        kept = ag[g] if side_streams else 0
        ahead = total(ag, range(g + 1, min(g + kf, n - 1) + 1))
        moments = [
            before + ag[g] + unsh[g] + ahead + accumulated,  # copy-out
            before + act[g] + out[g] + unsh[g] + kept + ahead + accumulated,  # after compute
        ]
        forward = max(forward, *moments)
    if n:  # the loss and the backward up to the first group: everything held
        # (the last all-gather output is released at the root's post-forward)
        backward = total(act, range(n)) + total(held, range(n)) + loss + accumulated
    for g in reversed(range(n)):
        live_acts = total(act, range(g + 1))
        earlier = total(held, range(g))
        in_flight = sum(ag[j] for j in range(max(g - k, 0), g) if resharded[j])
        reduced = total(grad, range(g + 1, n))
        previous_rs = arrays["reduce_scatter_kept_bytes"][g + 1] if g + 1 < n else 0
        if not side_streams:
            # The last reduce-scatter input is freed after its collective; a group
            # whose gradients fit in it gathers them into a buffer there, while
            # autograd computes each (at most the group's gradients again).
            previous_rs = ugrad[g] if ugrad[g] <= previous_rs else 0
        synced_acc = total(acc, range(g + 1)) if accumulate else 0
        # the gradients reduced: autograd's, or those accumulated so far
        reducing = acc[g] if accumulate else ugrad[g]
        # the gradient flowing in (the size of this group's output) and out
        flowing_out = out[g - 1] if g else 0
        flowing = out[g] + flowing_out
        # what this group's backward holds besides its parameters: as measured
        # (at least its gradients and the one flowing out), else its
        # activations, gradients and those flowing
        if measured[g]:
            holds = max(measured[g], ugrad[g] + flowing_out)
        else:
            holds = act[g] + ugrad[g] + flowing
        moments = [
            # computing this group's gradients, synchronized step
            live_acts
            - act[g]
            + earlier
            + unsh[g]
            + holds
            + in_flight
            + previous_rs
            + reduced
            + synced_acc,
            # reducing them: this group resharded, the last reduce-scatter input
            # freed; the gradients are dropped after the copy-in, before the output
            live_acts
            - act[g]
            + earlier
            + rs_in[g]
            + max(reducing, rs_out[g])
            + in_flight
            + reduced
            + (total(acc, range(g)) if accumulate else 0)  # the earlier groups'
            + flowing
            - out[g],
        ]
        if accumulate:  # a micro-step without synchronization: nothing reduced yet
            moments.append(live_acts - act[g] + earlier + unsh[g] + holds + in_flight + accumulated)
        backward = max(backward, *moments)
    persistent = total(sharded, range(n)) + resident
    peak = persistent + max(forward, backward)
    if peak > INT64_MAX:
        raise _overflow("peak bytes", peak)
    return {"persistent": persistent, "forward": forward, "backward": backward, "peak": peak}


# ----------------------------------------------------------------------------- comparison


def plan_differences(plan: Any, ref: RefGroupPlan | RefFlatPlan) -> list[str]:
    """Every field where ``plan`` (a Rust plan) differs from ``ref``; [] when equal.

    Tables are compared by value (``tolist()``) and by dtype; each message names
    the field and, for tables, the first mismatching index.
    """
    out = []
    for field in fields(ref):
        name = field.name
        want = getattr(ref, name)
        try:
            got = getattr(plan, name)
        except AttributeError:
            out.append(f"{name}: missing")
            continue
        if not isinstance(want, list) or got is None:
            if type(got) is not type(want) or got != want:
                out.append(f"{name}: got {got!r}, want {want!r}")
            continue
        dtype = getattr(getattr(got, "dtype", None), "name", type(got).__name__)
        if dtype != TABLE_DTYPES.get(name, "int64"):
            out.append(f"{name}: dtype {dtype}, want {TABLE_DTYPES.get(name, 'int64')}")
        got_list = got.tolist() if hasattr(got, "tolist") else list(got)
        if got_list != want:
            if len(got_list) != len(want):
                out.append(f"{name}: length {len(got_list)}, want {len(want)}")
            else:
                i = next(i for i, (a, b) in enumerate(zip(got_list, want, strict=True)) if a != b)
                out.append(f"{name}[{i}]: got {got_list[i]!r}, want {want[i]!r}")
    return out


def assert_plans_equal(plan: Any, ref: RefGroupPlan | RefFlatPlan) -> None:
    """Raise AssertionError listing every field where ``plan`` differs from ``ref``."""
    diffs = plan_differences(plan, ref)
    if diffs:
        raise AssertionError("plan differs from the reference:\n  " + "\n  ".join(diffs))
