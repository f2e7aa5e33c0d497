"""``copy`` benchmark: the fsdp-rs group copies against the torch copies FSDP2 runs.

For each parameter group in ``CASES`` and each op registered by ``fsdp_rs.ops``
(``OPS``; ``post_reduce`` is timed assigning and accumulating), one record holds:

- ``fsdp_rs_s``: the fsdp-rs op on the planner's group buffers, called as the
  runtime calls it (``EagerOps``: the impl the dispatcher would pick, without
  the dispatcher; [Note: Eager op calls] in ``fsdp_rs/ops/copies.py``);
- ``torch_s``: the same step as FSDP2 does it in torch 2.13
  (``torch.distributed.fsdp._fully_shard._fsdp_collectives``), on FSDP2's own
  layout: padded shards back to back, no alignment gaps. Every list of views
  FSDP2 caches per group is built outside the timed region;
- ``copy_s``: one contiguous ``dst.copy_(src)`` of ``bytes / 2`` bytes, i.e.
  reading and writing as many bytes as the op moves: the device's measured copy
  bandwidth for that traffic (``frac_of_copy = copy_s / fsdp_rs_s``).
- ``fsdp_rs_host_s`` / ``torch_host_s``: host seconds per call ([Note: Host
  cost]); ``fsdp_rs_dispatch_host_s``: the same op called through
  ``torch.ops.fsdp_rs`` (what a user calling the op pays: the dispatcher boxes
  and unboxes each tensor of a list);
- ``aliases``: the runtime runs no op for this step (post-reduce that neither
  casts nor divides: the gradients are views of the reduce output, as FSDP2's
  are); fsdp-rs is then not timed and the table prints ``alias``.

``bytes`` is what the op must read plus write at least, with ``S = row_numel``:
copy-in ``S`` elements in orig dtype read, ``S`` in param dtype written;
copy-out ``W * S`` param-dtype elements read and written; reduce-scatter
copy-in every gradient read (param dtype) and ``W * S`` reduce-dtype elements
written; post-reduce ``S`` reduce-dtype elements read and ``S`` orig-dtype
elements written, plus read when accumulating.

The torch side of each op, as FSDP2 runs it:

- ``all_gather_copy_in``: with mixed precision, ``_foreach_copy_`` casts the
  per-param shards into a freshly allocated param-dtype buffer, then
  ``torch.ops.fsdp.all_gather_copy_in`` ``_foreach_copy_``-s those into this
  rank's slice of the all-gather output (one copy when the dtypes match);
- ``all_gather_copy_out``: ``torch.ops.fsdp.split_with_sizes_copy`` along dim 1
  into the per-param ``[W, n]`` outputs;
- ``reduce_scatter_copy_in``: ``torch.ops.fsdp.chunk_cat`` of the gradients
  into the ``[W, -1]`` input (the cast to the reduce dtype happens inside it),
  then ``div_`` by the pre-divide factor if there is one;
- ``post_reduce``: ``div_`` by the post-divide factor if there is one, cast to
  the orig dtype, then one ``as_strided`` view per param, assigned or added to
  the param's gradient (FSDP2 also wraps each new gradient in a DTensor, which
  is not timed here).

FSDP2 divides by the world size through NCCL's average for float32 and bfloat16
reductions; for float16 it splits the factor into a pre- and a post-divide
(``fsdp2_divide_factors``), which both sides then apply. The ``torch.ops.fsdp``
ops are registered by importing ``torch.distributed.fsdp``; without
``torch.distributed`` the plain torch functions they wrap are timed instead.

Before timing, each op runs once on both sides from the same inputs and the
results are compared bit for bit (``outputs_equal``).

On CUDA, times are medians of CUDA-event-timed calls with the L2 cache flushed
before each (``fsdp_rs.bench.timing.time_cuda``). On CPU they are medians of
wall-clock calls, and the fsdp-rs ops run their plain-torch CPU impls (the test
references), not the Triton kernels: CPU figures measure the CPU path only.
"""

from __future__ import annotations

import importlib
import math
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import fsdp_rs
import fsdp_rs.ops  # registers torch.ops.fsdp_rs
from fsdp_rs.bench.timing import Timing, time_call, time_cuda
from fsdp_rs.ops import EagerOps, GroupTables
from fsdp_rs.planning import shapes_to_arrays

__all__ = [
    "CASES",
    "CPU_DEFAULT_SCALE",
    "OPS",
    "Case",
    "Dtypes",
    "bench_case",
    "divides",
    "fsdp2_divide_factors",
    "make_case",
]

OPS = (
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "post_reduce",
    "post_reduce_accumulate",
)
CPU_DEFAULT_SCALE = 1 / 32
"""CPU default ``--scale``: buffers of at most ~70 MB each, the run ~5 s on 2 idle cores."""
MIN_PARAMS = 100
"""Cases (c) and (d) scale their parameter count, never below this."""
CUDA_WARMUP = 3


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...] = ()  # the dim FSDP shards per param; () = all 0

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def _rows(d0: int, scale: float) -> int:
    return max(1, round(d0 * scale))


def _count(n: int, scale: float, minimum: int) -> int:
    return max(min(n, minimum), round(n * scale))


_LLAMA_7B_LAYER = (
    (4096,),  # input norm
    (4096, 4096),  # q
    (4096, 4096),  # k
    (4096, 4096),  # v
    (4096, 4096),  # o
    (4096,),  # post-attention norm
    (11008, 4096),  # gate
    (11008, 4096),  # up
    (4096, 11008),  # down
)
_EXPERT = ((64, 256), (64, 256), (256, 64))  # gate, up, down


def _few_large(scale: float) -> list[tuple[int, ...]]:
    return [(_rows(8192, scale), 8192)] * 8


def _transformer(scale: float) -> list[tuple[int, ...]]:
    return [(_rows(s[0], scale), *s[1:]) for s in _LLAMA_7B_LAYER]


def _many_small(scale: float) -> list[tuple[int, ...]]:
    return [(4096,)] * _count(10_000, scale, MIN_PARAMS)


def _moe(scale: float) -> list[tuple[int, ...]]:
    experts = _count(2_000, scale, -(-MIN_PARAMS // len(_EXPERT)))
    return list(_EXPERT) * experts


def _stacked_experts(scale: float) -> list[tuple[int, ...]]:
    # dim 1 a multiple of 64, so that any W <= 64 divides it (Shard(1) is even)
    return [(8, max(64, round(2048 * scale / 64) * 64), 1024)] * 3


CASES: dict[str, tuple[str, Callable[[float], list[tuple[int, ...]]]]] = {
    "a": ("few large: 8 x (8192, 8192)", _few_large),
    "b": ("7B layer: q,k,v,o (4096, 4096), gate/up/down 11008x4096, 2 norms", _transformer),
    "c": ("many small: 10,000 x (4096,)", _many_small),
    "d": ("MoE: 2,000 experts x (64,256),(64,256),(256,64)", _moe),
    "e": ("stacked experts on Shard(1): 3 x (8, 2048, 1024)", _stacked_experts),
}
_SHARD_DIM = {"e": 1}  # cases whose params FSDP shards on another dim


def divides(case: Case, world_size: int) -> bool:
    """Whether ``world_size`` splits every ``Shard(d > 0)`` dim of ``case`` evenly
    (FSDP2 refuses an uneven one)."""
    pairs = zip(case.shapes, case.dims, strict=True) if case.dims else ()
    return all(s[d] % world_size == 0 for s, d in pairs)


def make_case(key: str, scale: float = 1.0) -> Case:
    """Case ``key`` with dim 0 (cases a, b) or the parameter count (c, d) scaled."""
    if key not in CASES:
        raise ValueError(f"unknown case {key!r}; choose from {', '.join(CASES)}")
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    name, make = CASES[key]
    shapes = tuple(make(scale))
    dim = _SHARD_DIM.get(key)
    return Case(key, name, shapes, () if dim is None else (dim,) * len(shapes))


# ----------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class Dtypes:
    orig: torch.dtype
    param: torch.dtype
    reduce: torch.dtype

    @classmethod
    def from_names(cls, names: Sequence[str]) -> Dtypes:
        """From torch attribute names, e.g. ``("float32", "bfloat16", "float32")``."""
        orig, param, reduce = (getattr(torch, n) for n in names)
        return cls(orig, param, reduce)

    def __str__(self) -> str:
        return f"orig {_name(self.orig)}, param {_name(self.param)}, reduce {_name(self.reduce)}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fsdp2_divide_factors(reduce_dtype: torch.dtype, world_size: int) -> tuple[float, float]:
    """FSDP2's (pre, post) gradient divide factors for a plain FSDP group.

    float32 and bfloat16 reductions divide inside NCCL (average): ``(1, 1)``.
    float16 ones, to keep the sum in range, divide by ``p`` before the
    reduce-scatter and by ``W / p`` after, where ``p`` starts at 1 and doubles
    while it divides ``W`` and ``p * p < W`` (``p = 4, W / p = 2`` for ``W = 8``).
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0, 1.0
    pre = 1
    while world_size % pre == 0 and world_size > pre * pre:
        pre *= 2
    return float(pre), world_size / pre


# ----------------------------------------------------------------------------- torch's FSDP2 ops


def _fsdp2_ops() -> Any | None:
    """``torch.ops.fsdp`` (registered by importing ``torch.distributed.fsdp``), or None."""
    if not torch.distributed.is_available():
        return None
    importlib.import_module("torch.distributed.fsdp")
    ops = torch.ops.fsdp
    names = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")
    return ops if all(hasattr(ops, n) for n in names) else None


def fsdp2_cast_inputs(
    inputs: list[torch.Tensor], sizes: list[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    """FSDP2's all-gather inputs under mixed precision: the shards cast by one
    ``_foreach_copy_`` into a freshly allocated ``dtype`` buffer."""
    flat = torch.empty(sum(sizes), dtype=dtype, device=inputs[0].device)
    sources = list(torch.split(flat, sizes))
    torch._foreach_copy_(sources, inputs)
    return sources


def _foreach_copy_into_row(
    inputs: Sequence[torch.Tensor],
    output: torch.Tensor,
    sizes: list[int],
    total: int,
    rank: int,
) -> None:
    """What ``torch.ops.fsdp.all_gather_copy_in`` does, for torch without it."""
    row = output.narrow(0, total * rank, total)
    torch._foreach_copy_(list(torch.split(row, sizes)), list(inputs))


# ----------------------------------------------------------------------------- group


def _segments(x: torch.Tensor, starts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """``x[..., s : s + n]`` for each segment, concatenated along the last dim.

    A view when the segments already lie back to back from 0, else a gather."""
    lengths = np.asarray(lengths, dtype=np.int64)
    packed = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    if np.array_equal(np.asarray(starts), packed):
        return x[..., :total]
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - packed, lengths)
    index = torch.arange(total, dtype=torch.int64) + torch.from_numpy(shift)
    return x[..., index.to(x.device)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b)


@dataclass
class Group:
    """One planned parameter group and the layouts both sides use."""

    case: Case
    dtypes: Dtypes
    world_size: int
    rank: int
    device: torch.device
    plan: Any
    tables: GroupTables
    generator: torch.Generator
    ops: Any = None  # what the fsdp-rs side calls: EagerOps, or torch.ops.fsdp_rs

    def __post_init__(self) -> None:
        if self.ops is None:
            self.ops = EagerOps(self.device)

    @classmethod
    def build(
        cls, case: Case, dtypes: Dtypes, world_size: int, rank: int, device: torch.device
    ) -> Group:
        shapes = case.shapes
        if case.dims:  # planned as (W, numel / W) rows: [Note: Sharding on another dim]
            shapes = tuple((world_size, math.prod(s) // world_size) for s in shapes)
        ndims, dims = shapes_to_arrays(shapes)
        plan = fsdp_rs.plan_group(
            ndims,
            dims,
            world_size,
            rank,
            orig_elem_size=dtypes.orig.itemsize,
            param_elem_size=dtypes.param.itemsize,
            reduce_elem_size=dtypes.reduce.itemsize,
        )
        generator = torch.Generator(device).manual_seed(0)
        tables = GroupTables.from_plan(plan, device)
        return cls(case, dtypes, world_size, rank, device, plan, tables, generator)

    @property
    def n(self) -> np.ndarray:
        """Padded shard numel per param: FSDP2's split sizes."""
        return self.plan.padded_sharded_numel

    @property
    def sizes(self) -> list[int]:
        return self.n.tolist()

    @property
    def total(self) -> int:
        """Elements in one FSDP2 row (no alignment gaps)."""
        return int(self.n.sum())

    @property
    def packed_offsets(self) -> np.ndarray:
        return np.cumsum(self.n) - self.n

    def random(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, device=self.device, dtype=dtype)

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, device=self.device, dtype=dtype)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """A group-layout row (or rows) in FSDP2's layout, as a new tensor."""
        return _segments(x, self.plan.row_offsets, self.n).clone()

    def sharded_views(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """``(sharded_size, contiguous_stride, offset)`` per param in FSDP2's layout."""
        plan = self.plan
        bounds = plan.dim_offsets.tolist()
        sizes, strides = plan.sharded_sizes.tolist(), plan.contiguous_strides.tolist()
        offsets = self.packed_offsets.tolist()
        return [
            (tuple(sizes[a:b]), tuple(strides[a:b]), offset)
            for a, b, offset in zip(bounds[:-1], bounds[1:], offsets, strict=True)
        ]


# ----------------------------------------------------------------------------- ops


@dataclass
class OpBench:
    """Both sides of one op, closed over their buffers, and the bytes it moves."""

    nbytes: int
    fsdp_rs: Callable[[], None]
    torch: Callable[[], None]
    outputs_equal: Callable[[], bool]
    torch_impl: str
    divide_factor: float = 1.0
    aliases: bool = False
    """fsdp-rs's runtime runs no op here: the gradients alias the reduce output
    (the reduce-scatter writes the sharded gradient buffer), so nothing is timed
    for it; torch is timed making its views."""


def _all_gather_copy_in(g: Group, fsdp2: Any | None) -> OpBench:
    d, w, rows, rank = g.dtypes, g.world_size, g.plan.row_numel, g.rank
    sizes, total = g.sizes, g.total
    sharded = g.random(rows, dtype=d.orig)
    output = g.empty(w, rows, dtype=d.param)
    inputs = list(torch.split(g.packed(sharded), sizes))
    torch_output = g.empty(w * total, dtype=d.param)
    copy_in = fsdp2.all_gather_copy_in if fsdp2 else _foreach_copy_into_row
    cast = d.param != d.orig

    def run_fsdp_rs() -> None:
        g.ops.all_gather_copy_in(sharded, output, rank)

    def run_torch() -> None:
        sources = fsdp2_cast_inputs(inputs, sizes, d.param) if cast else inputs
        copy_in(sources, torch_output, sizes, total, rank)

    def equal() -> bool:
        return _same(g.packed(output[rank]), torch_output.view(w, total)[rank])

    impl = "fsdp.all_gather_copy_in" if fsdp2 else "_foreach_copy_ into the row"
    if cast:
        impl = "_foreach_copy_ cast to a new buffer + " + impl
    nbytes = rows * (d.orig.itemsize + d.param.itemsize)
    return OpBench(nbytes, run_fsdp_rs, run_torch, equal, impl)


def _all_gather_copy_out(g: Group, fsdp2: Any | None) -> OpBench:
    d, w, rows = g.dtypes, g.world_size, g.plan.row_numel
    sizes, total = g.sizes, g.total
    output = g.random(w, rows, dtype=d.param)
    unsharded = g.empty(g.plan.unsharded_numel, dtype=d.param)
    torch_output = g.packed(output)
    torch_unsharded = g.empty(w * total, dtype=d.param)
    outs = [t.view(w, -1) for t in torch.split(torch_unsharded, [w * n for n in sizes])]
    split_copy = fsdp2.split_with_sizes_copy if fsdp2 else torch.split_with_sizes_copy
    tables = g.tables.copy_out_args()

    def run_fsdp_rs() -> None:
        g.ops.all_gather_copy_out(output, [unsharded], *tables)

    def run_torch() -> None:
        split_copy(torch_output, sizes, dim=1, out=outs)

    def equal() -> bool:
        mine = _segments(unsharded, g.plan.unsharded_offsets, w * g.n)
        return _same(mine, torch_unsharded)

    impl = ("fsdp." if fsdp2 else "") + "split_with_sizes_copy(dim=1)"
    return OpBench(2 * w * rows * d.param.itemsize, run_fsdp_rs, run_torch, equal, impl)


def _reduce_scatter_copy_in(g: Group, fsdp2: Any | None) -> OpBench:
    d, w, rows, total = g.dtypes, g.world_size, g.plan.row_numel, g.total
    numels = [math.prod(s) for s in g.case.shapes]
    flat = g.random(sum(numels), dtype=d.param)
    grads = [t.view(s) for t, s in zip(torch.split(flat, numels), g.case.shapes, strict=True)]
    rs_input = g.empty(w, rows, dtype=d.reduce)
    torch_input = g.empty(w, total, dtype=d.reduce)
    pre, _ = fsdp2_divide_factors(d.reduce, w)
    chunk_cat = fsdp2.chunk_cat if fsdp2 else torch._chunk_cat
    tables = g.tables.reduce_scatter_args()

    def run_fsdp_rs() -> None:
        g.ops.reduce_scatter_copy_in(grads, rs_input, *tables, pre)

    def run_torch() -> None:
        chunk_cat(grads, 0, w, out=torch_input)
        if pre != 1:
            torch_input.div_(pre)

    def equal() -> bool:
        return _same(g.packed(rs_input), torch_input)

    impl = ("fsdp." if fsdp2 else "_") + "chunk_cat" + (" + div_" if pre != 1 else "")
    nbytes = sum(numels) * d.param.itemsize + w * rows * d.reduce.itemsize
    return OpBench(nbytes, run_fsdp_rs, run_torch, equal, impl, pre)


def _post_reduce(g: Group, accumulate: bool) -> OpBench:
    d, rows = g.dtypes, g.plan.row_numel
    _, post = fsdp2_divide_factors(d.reduce, g.world_size)
    rs_output = g.random(rows, dtype=d.reduce)
    sharded_grad = g.random(rows, dtype=d.orig)
    torch_output = g.packed(rs_output)
    torch_grad = g.packed(sharded_grad)
    views = g.sharded_views()
    grads: list[torch.Tensor | None] = [None] * len(views)
    if accumulate:
        grads = [torch.as_strided(torch_grad, *v) for v in views]
    last = {}

    def run_fsdp_rs() -> None:
        g.ops.post_reduce(rs_output, sharded_grad, post, accumulate)

    def run_torch() -> None:
        out = torch_output
        if post != 1:
            out.div_(post)
        out = out.to(d.orig)
        for i, (size, stride, offset) in enumerate(views):
            new = torch.as_strided(out, size, stride, offset)
            if accumulate:
                grads[i] += new
            else:
                grads[i] = new
        last["out"] = out

    def equal() -> bool:
        valid = g.plan.sharded_numel
        mine = _segments(sharded_grad, g.plan.row_offsets, valid)
        theirs = torch_grad if accumulate else last["out"]
        return _same(mine, _segments(theirs, g.packed_offsets, valid))

    aliases = not accumulate and post == 1 and d.orig == d.reduce
    impl = "div_ + " if post != 1 else ""
    impl += "to(orig) + " if d.orig != d.reduce else ""
    impl += "as_strided per param" + (" + grad +=" if accumulate else "")
    nbytes = rows * (d.reduce.itemsize + d.orig.itemsize * (2 if accumulate else 1))
    return OpBench(nbytes, run_fsdp_rs, run_torch, equal, impl, post, aliases)


def _pre_len(g: Group) -> list[tuple[int, int]]:
    """(product of the dims before the shard dim, this rank's elements per such
    index) per param of a ``Shard(d)`` case."""
    w = g.world_size
    return [
        (math.prod(s[:d]), s[d] // w * math.prod(s[d + 1 :]))
        for s, d in zip(g.case.shapes, g.case.dims, strict=True)
    ]


def _chunk_numel(g: Group) -> torch.Tensor:
    """The ops' ``chunk_numel`` table of a ``Shard(d)`` case."""
    runs = [length for _, length in _pre_len(g)]
    return torch.tensor(runs, dtype=torch.int64).to(g.device)


def _all_gather_copy_out_on_dims(g: Group, fsdp2: Any | None) -> OpBench:
    """Copy-out of ``Shard(d)`` params: the group's one copy-out with its
    ``chunk_numel`` table against FSDP2's ``split_with_sizes_copy`` into
    temporaries then ``torch.cat`` of their chunks on ``d`` into the outputs."""
    d, w, rows = g.dtypes, g.world_size, g.plan.row_numel
    sizes, shapes, dims = g.sizes, g.case.shapes, g.case.dims
    output = g.random(w, rows, dtype=d.param)
    unsharded = g.empty(g.plan.unsharded_numel, dtype=d.param)
    torch_output = g.packed(output)
    finals = [g.empty(math.prod(s), dtype=d.param) for s in shapes]
    split_copy = fsdp2.split_with_sizes_copy if fsdp2 else torch.split_with_sizes_copy
    starts = g.plan.unsharded_offsets.tolist()
    tables, chunks = g.tables.copy_out_args(), _chunk_numel(g)

    def run_fsdp_rs() -> None:
        g.ops.all_gather_copy_out(output, [unsharded], *tables, chunks)

    def run_torch() -> None:
        temps = [torch.empty(w * n, dtype=d.param, device=g.device) for n in sizes]
        split_copy(torch_output, sizes, dim=1, out=[t.view(w, -1) for t in temps])
        for temp, final, shape, dim in zip(temps, finals, shapes, dims, strict=True):
            sharded = list(shape)
            sharded[dim] //= w
            stacked = [w * sharded[0], *sharded[1:]]
            chunks = torch.chunk(temp.view(stacked), w, dim=0)
            torch.cat(chunks, dim=dim, out=final.view(shape))

    def equal() -> bool:
        return all(
            _same(unsharded[s : s + f.numel()], f) for s, f in zip(starts, finals, strict=True)
        )

    impl = ("fsdp." if fsdp2 else "") + "split_with_sizes_copy(dim=1) + cat(dim=d) per param"
    return OpBench(2 * w * rows * d.param.itemsize, run_fsdp_rs, run_torch, equal, impl)


def _reduce_scatter_copy_in_on_dims(g: Group, fsdp2: Any | None) -> OpBench:
    """Reduce-scatter copy-in of ``Shard(d)`` gradients: the group's one
    copy-in with its ``chunk_numel`` table (each gradient viewed as its planned
    ``(W, numel / W)``) against FSDP2's ``cat(chunk(grad, W, d), 0)`` per
    gradient then ``chunk_cat``."""
    d, w, rows, total = g.dtypes, g.world_size, g.plan.row_numel, g.total
    shapes, dims = g.case.shapes, g.case.dims
    grads = [g.random(*s, dtype=d.param) for s in shapes]
    rs_input = g.empty(w, rows, dtype=d.reduce)
    torch_input = g.empty(w, total, dtype=d.reduce)
    pre, _ = fsdp2_divide_factors(d.reduce, w)
    chunk_cat = fsdp2.chunk_cat if fsdp2 else torch._chunk_cat
    tables, chunks = g.tables.reduce_scatter_args(), _chunk_numel(g)
    planned = [t.view(w, -1) for t in grads]

    def run_fsdp_rs() -> None:
        g.ops.reduce_scatter_copy_in(planned, rs_input, *tables, pre, chunks)

    def run_torch() -> None:
        stacked = [
            torch.cat(torch.chunk(t, w, dim=dim), dim=0) for t, dim in zip(grads, dims, strict=True)
        ]
        chunk_cat(stacked, 0, w, out=torch_input)
        if pre != 1:
            torch_input.div_(pre)

    def equal() -> bool:
        return _same(g.packed(rs_input), torch_input)

    impl = "cat(chunk(grad, W, d), 0) per grad + " + ("fsdp." if fsdp2 else "_") + "chunk_cat"
    nbytes = sum(map(math.prod, shapes)) * d.param.itemsize + w * rows * d.reduce.itemsize
    return OpBench(nbytes, run_fsdp_rs, run_torch, equal, impl, pre)


_ON_DIMS: dict[str, Callable[[Group, Any | None], OpBench]] = {
    "all_gather_copy_out": _all_gather_copy_out_on_dims,
    "reduce_scatter_copy_in": _reduce_scatter_copy_in_on_dims,
}

_BUILDERS: dict[str, Callable[[Group, Any | None], OpBench]] = {
    "all_gather_copy_in": _all_gather_copy_in,
    "all_gather_copy_out": _all_gather_copy_out,
    "reduce_scatter_copy_in": _reduce_scatter_copy_in,
    "post_reduce": lambda g, _: _post_reduce(g, accumulate=False),
    "post_reduce_accumulate": lambda g, _: _post_reduce(g, accumulate=True),
}


# ----------------------------------------------------------------------------- timing


def _timer(device: torch.device, repeat: int) -> Callable[[Callable[[], object]], Timing]:
    """Seconds per call of ``fn`` on ``device``, ``repeat`` times after a warm-up."""
    if device.type == "cuda":
        return lambda fn: time_cuda(fn, repeat, warmup=CUDA_WARMUP)
    return lambda fn: time_call(fn, repeat, warmup=1, collect=False)[0]


_NO_CALL = Timing((0.0,))
_HostTimer = Callable[[Callable[[], object], Timing | None], Timing]


def _host_timer(
    device: torch.device, repeat: int, timer: Callable[[Callable[[], object]], Timing]
) -> _HostTimer:
    """Host seconds per call.

    [Note: Host cost]
    On CUDA, the wall time of a call that is not waited for: what the op costs
    the CPU (checks, tables, launches) while the GPU works. A per-parameter cost
    there (one Python attribute read per tensor) shows up as host time growing
    with ``n_params``. On CPU every op runs to completion in the call, so host
    time is the op's time and the same timing serves both columns (``timed``,
    where the caller has it; else ``timer`` times the call). Where the
    runtime aliases the reduce output (``aliases``) fsdp-rs makes no call and
    both its columns are 0.
    """
    if device.type != "cuda":
        return lambda fn, timed=None: timer(fn) if timed is None else timed

    def host(fn: Callable[[], object], timed: Timing | None = None) -> Timing:
        torch.cuda.synchronize()
        timing = time_call(fn, repeat, warmup=1, collect=False)[0]
        torch.cuda.synchronize()
        return timing

    return host


def _plain_copy(nbytes: int, device: torch.device) -> Callable[[], None]:
    """One contiguous copy reading and writing ``nbytes / 2`` bytes each."""
    src = torch.ones(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"{cpu} ({torch.get_num_threads()} torch threads)"


def bench_case(
    case: Case,
    dtypes: Dtypes,
    world_size: int,
    device: torch.device,
    repeat: int,
    *,
    rank: int = 0,
    ops: Sequence[str] = OPS,
) -> list[dict[str, Any]]:
    """One record per op: fsdp-rs, FSDP2's torch copies and a plain copy, timed."""
    group = Group.build(case, dtypes, world_size, rank, device)
    fsdp2 = _fsdp2_ops()
    timer = _timer(device, repeat)
    host_timer = _host_timer(device, repeat, timer)
    records = []
    for op in ops:
        builder = (_ON_DIMS.get(op) if case.dims else None) or _BUILDERS.get(op)
        if builder is None:  # --steps: the ops with their collectives
            from fsdp_rs.bench.copy_step import STEP_BUILDERS

            builder = STEP_BUILDERS[op]
        bench = builder(group, fsdp2)
        bench.fsdp_rs()
        bench.torch()
        outputs_equal = bench.outputs_equal()
        torch_t = timer(bench.torch)
        torch_host = host_timer(bench.torch, torch_t)
        aliases = bench.aliases
        if aliases:  # [Note: Host cost] the runtime makes no call here
            fsdp_rs_t = fsdp_rs_host = dispatch_host = _NO_CALL
        else:
            fsdp_rs_t = timer(bench.fsdp_rs)
            fsdp_rs_host = host_timer(bench.fsdp_rs, fsdp_rs_t)
            eager, group.ops = group.ops, torch.ops.fsdp_rs  # through the dispatcher
            dispatch_host = host_timer(bench.fsdp_rs)
            group.ops = eager
        nbytes, impl, factor = bench.nbytes, bench.torch_impl, bench.divide_factor
        del bench  # free the op's buffers before the plain copy allocates its own
        copy_t = timer(_plain_copy(nbytes, device))
        fsdp_rs_s, torch_s, copy_s = fsdp_rs_t.median, torch_t.median, copy_t.median
        records.append(
            {
                "case": case.key,
                "case_name": case.name,
                "op": op,
                "device": device.type,
                "device_name": device_name(device),
                "world_size": world_size,
                "rank": rank,
                "n_params": len(case.shapes),
                "shard_dims": sorted(set(case.dims)) or [0],
                "total_elements": case.numel,
                "row_numel": int(group.plan.row_numel),
                "orig_dtype": _name(dtypes.orig),
                "param_dtype": _name(dtypes.param),
                "reduce_dtype": _name(dtypes.reduce),
                "divide_factor": factor,
                "repeat": repeat,
                "bytes": nbytes,
                "fsdp_rs_s": fsdp_rs_s,
                "torch_s": torch_s,
                "copy_s": copy_s,
                "fsdp_rs_best_s": fsdp_rs_t.best,
                "torch_best_s": torch_t.best,
                "copy_best_s": copy_t.best,
                "fsdp_rs_host_s": fsdp_rs_host.median,
                "torch_host_s": torch_host.median,
                "fsdp_rs_dispatch_host_s": dispatch_host.median,
                "aliases": aliases,
                "fsdp_rs_gbps": _gbps(nbytes, fsdp_rs_s),
                "torch_gbps": _gbps(nbytes, torch_s),
                "copy_gbps": _gbps(nbytes, copy_s),
                "speedup": _ratio(torch_s, fsdp_rs_s),
                "frac_of_copy": _ratio(copy_s, fsdp_rs_s),
                "outputs_equal": outputs_equal,
                "torch_impl": impl,
            }
        )
    return records
