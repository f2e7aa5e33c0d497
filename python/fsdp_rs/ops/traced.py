"""``fsdp_rs::unshard_copy_out``: the functional copy-out the traced hooks use,
with the gradient reduction as its autograd formula ([Note: Traced hooks]).

Forward: the group's unsharded parameters, one fresh tensor each in its shape,
filled from the all-gather output by ``fsdp_rs::all_gather_copy_out``.
Backward, for the group's sharded local tensors (which the forward does not
read: they are where the gradient goes): ``fsdp_rs::reduce_scatter_copy_in``
from the parameters' gradients (the pre-divide and the cast to the reduce
dtype), the functional reduce-scatter and its wait, with replicas (HSDP) the
functional all-reduce across them and its wait, then ``fsdp_rs::post_reduce``
(the post-divide and the cast to the parameters' dtype) into a fresh sharded
row, viewed per parameter. Both directions run the eager runtime's ops with its
arguments, so the traced path gives its results bit for bit; under AOT autograd
the backward's collective and copies land in the backward graph.

[Note: Unused parameters under trace]
A parameter that no op of the forward used has no gradient in eager fsdp-rs
and FSDP2 (its ``.grad`` stays as it was, and optimizers skip it). The op's
outputs are one tensor per parameter and its autograd formula does not
materialize missing gradients, so AOT autograd hands it ``None`` for such a
parameter (known when the graph is traced): it reduce-scatters zeros in its
place, as every rank must join the collective, and gives its shard no
gradient. One buffer cut into views would not do: the cut's backward fills
unused pieces with zeros. Whether a parameter was used is then a fact of this
rank's graph; ranks whose graphs differ would drop one rank's gradient from
another's shard. So every backward of a group that reduces across ranks also
all-reduces its used-mask, on every rank whether or not this rank's graph left
a gradient missing (a rank that checked alone would wait in a collective the
others never issue), and every rank raises where the ranks' masks differ (the
maximum and the minimum in one all-reduce: [Note: Agreement by extremes] in
``runtime/checks/agreement.py``). That costs one all-reduce of a few
bytes per group per backward, issued before the group's reduce-scatter and
waited on after it, so that both share one synchronisation of the ranks; the
mask is made to depend on the group's token's gradient, as the reduce-scatter
of a group without any gradient is ([Note: Every group's backward on every
rank]): AOT autograd's partitioner would otherwise compute what depends on no
gradient in the forward graph, at another place on each rank. The local tensors come
from the parameters through a ``to_local`` that keeps a missing gradient
missing ([Note: The local tensors' missing gradients]).

[Note: Gradients under trace are in the parameter dtype]
The op's outputs are not leaves, so autograd casts each gradient it hands the
formula to the unsharded parameter's dtype, whatever dtype the op that used
the parameter computed it in. Eager's unsharded parameters are leaves, and
from torch 2.15, where a group reduces in a wider dtype than it computes in
(bf16 parameters, fp32 reduce), eager leaves such a gradient as computed and
reduces it so, as FSDP2 does (torch 2.15's RMSNorm gives a bf16 weight an fp32
gradient): under trace it is rounded to bf16 first, as every torch before 2.15
does in eager. Compiled and eager then agree to that rounding, not bit for
bit. Where a DTensor parameter's partial gradient would be summed over tensor
parallelism in the wider dtype (eager keeps its ``grad_dtype`` at the reduce
dtype there), ``set_fullgraph_compile`` refuses the group instead.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from fsdp_rs.kernels._dtypes import bits

__all__ = ["Reduction", "all_gather_rows", "reduction", "regathered", "unshard_copy_out"]


@torch.library.custom_op("fsdp_rs::unshard_copy_out", mutates_args=())
def unshard_copy_out(
    all_gather_output: torch.Tensor,
    sharded: list[torch.Tensor],
    row_offsets: torch.Tensor,
    unsharded_offsets: torch.Tensor,
    padded_numel: torch.Tensor,
    tile_param: torch.Tensor,
    tile_start: torch.Tensor,
    tile_len: torch.Tensor,
    dims: list[int],
    ranks: list[int],
    padded_numels: list[int],
    sharded_offsets: list[int],
    sharded_numels: list[int],
    group_name: str,
    reduce_op: str,
    pre_divide: float,
    post_divide: float,
    reduce_dtype: torch.dtype,
    replicate_group_name: str,
    all_reduce_op: str,
    chunk_numel: torch.Tensor | None,
    trained: list[int],
    grad_tables: list[torch.Tensor],
    grad_row_numel: int,
    grad_chunk_numel: torch.Tensor | None,
    token: torch.Tensor,
) -> list[torch.Tensor]:
    """The unsharded parameters of a group (shapes: ``ranks[p]`` dims each,
    back to back in ``dims``), copied out of ``all_gather_output`` (rows x row
    numel); ``padded_numels``: ``padded_numel`` on the host, so that the
    outputs are allocated without reading a device table. ``trained``: the
    parameters that take gradients (indices into the outputs; the others'
    outputs do not require grad), and ``sharded`` their sharded local tensors,
    which take the gradient: views of a row of ``grad_row_numel`` elements
    laid out as ``grad_tables`` say (``reduce_scatter_copy_in``'s tables of
    the group's gradient layout, [Note: Gradient layout]) at
    ``sharded_offsets``, of ``sharded_numels`` elements. The rest configures
    the reduction (``group_name``: the shard process group, ``reduce_op``:
    ``"sum"`` or ``"avg"``; ``replicate_group_name``: the replicas' process
    group, "" without, and ``all_reduce_op`` its op). ``chunk_numel`` and
    ``grad_chunk_numel``: for a group sharded on a dim other than 0, the
    copies' tables of chunk lengths ([Note: Sharding on another dim]) of the
    parameters and of the gradient layout; None on dim 0.

    [Note: This rank's numels in the graph]
    ``sharded_numels`` is checked here, and it is also what keeps the graphs of
    two ranks apart: torch's compile caches key a graph by its code and its
    DTensor inputs' global metadata (pytorch/pytorch#188390), so ranks of one
    host whose shards differ (an uneven split) would share compiled code made for
    another shape; this rank's numels, constants in the graph's code, differ
    exactly when the shards do."""
    _check_numels(sharded, sharded_numels)
    rows = all_gather_output.shape[0]
    padded = [all_gather_output.new_empty(rows * n) for n in padded_numels]
    torch.ops.fsdp_rs.all_gather_copy_out(
        all_gather_output,
        padded,
        row_offsets,
        unsharded_offsets,
        padded_numel,
        tile_param,
        tile_start,
        tile_len,
        chunk_numel,
    )
    shapes = _shapes(dims, ranks)
    unsharded = [t[: math.prod(shape)].view(shape) for t, shape in zip(padded, shapes, strict=True)]
    return [*unsharded, token.new_empty(0)]


def _shapes(dims: list[int], ranks: list[int]) -> list[list[int]]:
    """The parameters' shapes, from their dims back to back and their ranks."""
    ends = list(itertools.accumulate(ranks))
    return [dims[end - rank : end] for end, rank in zip(ends, ranks, strict=True)]


def _check_numels(sharded: list[torch.Tensor], numels: list[int]) -> None:
    if [t.numel() for t in sharded] != list(numels):
        raise ValueError(
            f"fsdp_rs::unshard_copy_out: the sharded tensors have "
            f"{[t.numel() for t in sharded]} elements, the group's plan {list(numels)}; "
            "pass this rank's local tensors of the group, in its parameter order"
        )


@unshard_copy_out.register_fake
def _(all_gather_output, sharded, *rest) -> list[torch.Tensor]:
    dims, ranks, _, _, sharded_numels = rest[6:11]
    _check_numels(sharded, sharded_numels)
    unsharded = [all_gather_output.new_empty(shape) for shape in _shapes(dims, ranks)]
    return [*unsharded, rest[-1].new_empty(0)]


def all_gather_rows(source: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Every rank's ``source`` as the rows of one tensor (``world`` x numel), by
    the functional all-gather over ``group_name``; one rank's is its own. Bytes
    are bytes: a dtype the backend may not know (float8 or bool on gloo) goes
    as its same-width integers ([Note: Raw copies])."""
    if world == 1:
        return source.view(1, -1)
    functional = torch.ops._c10d_functional
    gathered = functional.all_gather_into_tensor(bits(source), world, group_name)
    return functional.wait_tensor(gathered).view(source.dtype).view(world, -1)


@dataclass(frozen=True)
class Reduction:
    """The traced backward's gradient reduction of one group (the eager
    post-backward's ops, with its arguments): ``rows`` shard ranks (1: no
    reduce-scatter), ``layouts`` (shape, stride, dtype) of the trained
    parameters' sharded local tensors, which live on ``shard_device`` at
    ``offsets`` of a row of ``row_numel`` elements laid out as ``tables`` (the
    gradient layout's ``reduce_scatter_copy_in`` tables) say; ``trained``: the
    parameters that take gradients, indices into the unsharded ones."""

    rows: int
    device: torch.device
    layouts: list
    shard_device: torch.device
    offsets: list[int]
    group_name: str
    reduce_op: str
    pre: float
    post: float
    reduce_dtype: torch.dtype
    replicate_group_name: str
    all_reduce_op: str
    trained: list[int]
    tables: tuple
    row_numel: int
    chunk_numel: torch.Tensor | None

    @property
    def reduce_groups(self) -> list[str]:
        """The process groups the reduction runs a collective over (none on one
        rank)."""
        shard_group = self.group_name if self.rows > 1 else ""
        return [name for name in (shard_group, self.replicate_group_name) if name]

    def __call__(
        self, grads: list[torch.Tensor | None], after: torch.Tensor | None = None
    ) -> list[torch.Tensor | None]:
        """The sharded gradients of the trained parameters (None where a
        parameter got none) from ``grads``, one per unsharded parameter;
        ``after``: the group's token's gradient, an empty tensor that the
        collectives are made to depend on ([Note: Every group's backward on
        every rank]), or None."""
        grads = [grads[i] for i in self.trained]
        used = [g is not None for g in grads]
        # issued first, so that its wait shares the reduce-scatter's
        check = _issue_used_check(used, self, after) if self.reduce_groups else None
        shape = (self.rows, self.row_numel)
        if after is None or any(used):
            rs_in = torch.empty(shape, dtype=self.reduce_dtype, device=self.device)
        else:  # no gradient: zeros that depend on the token's gradient
            rs_in = _zero(after).to(self.reduce_dtype).expand(shape).contiguous()
        if self.chunk_numel is not None:  # each viewed as planned: (W, numel / W)
            grads = [None if g is None else g.reshape(self.rows, -1) for g in grads]
        torch.ops.fsdp_rs.reduce_scatter_copy_in(
            grads, rs_in, *self.tables, self.pre, self.chunk_numel
        )
        functional = torch.ops._c10d_functional
        if self.rows > 1:
            output = functional.reduce_scatter_tensor(
                rs_in.view(-1), self.reduce_op, self.rows, self.group_name
            )
            output = functional.wait_tensor(output)
        else:
            output = rs_in[0]
        if self.replicate_group_name:  # HSDP: summed across the replicas as in eager
            output = functional.all_reduce(output, self.all_reduce_op, self.replicate_group_name)
            output = functional.wait_tensor(output)
        if check is not None:
            _check_used(check, len(used), self)
        dtype = self.layouts[0][2] if self.layouts else self.reduce_dtype
        if output.device != self.shard_device:  # CPU offload: post-reduced on the host
            output = output.to(self.shard_device)
        row = output.new_empty(self.row_numel, dtype=dtype)
        torch.ops.fsdp_rs.post_reduce(output, row, self.post, False)
        return [
            row.as_strided(shape, stride, offset) if u else None
            for (shape, stride, _), offset, u in zip(self.layouts, self.offsets, used, strict=True)
        ]


def reduction(
    rows: int,
    device: torch.device,
    sharded: list[torch.Tensor],
    offsets: list[int],
    group_name: str,
    reduce_op: str,
    pre: float,
    post: float,
    reduce_dtype: torch.dtype,
    replicate_group_name: str,
    all_reduce_op: str,
    trained: list[int],
    grad_tables: list[torch.Tensor],
    grad_row_numel: int,
    grad_chunk_numel: torch.Tensor | None,
) -> Reduction:
    """The ``Reduction`` of gradients into ``sharded`` (the trained
    parameters' local tensors; the host's under CPU offload)."""
    return Reduction(
        rows,
        device,
        [(s.shape, s.stride(), s.dtype) for s in sharded],
        sharded[0].device if sharded else device,
        list(offsets),
        group_name,
        reduce_op,
        pre,
        post,
        reduce_dtype,
        replicate_group_name,
        all_reduce_op,
        list(trained),
        tuple(grad_tables),
        grad_row_numel,
        grad_chunk_numel,
    )


def _setup_context(ctx, inputs, output) -> None:
    ag, sharded = inputs[:2]
    trained = set(inputs[21])
    frozen = [out for i, out in enumerate(output[:-1]) if i not in trained]
    if not trained:  # nothing to reduce: no backward, no token to chain
        frozen.append(output[-1])
    if frozen:  # no gradient computed for what is not trained
        ctx.mark_non_differentiable(*frozen)
    ctx.set_materialize_grads(False)  # [Note: Unused parameters under trace]
    ctx.reduction = reduction(
        ag.shape[0], ag.device, sharded, inputs[11], *inputs[13:20], *inputs[21:25]
    )
    ctx.n_tables = len(inputs[22])
    ctx.token_device = inputs[-1].device


def _backward(ctx, grads: list[torch.Tensor | None]):
    sharded = ctx.reduction(grads[:-1], grads[-1])
    # (grad_tables is a list: its gradients too); the previous token's
    # gradient whether or not one came, so that the previous group's backward
    # runs too ([Note: Every group's backward on every rank])
    return (
        None,
        sharded,
        *([None] * 20),
        [None] * ctx.n_tables,
        None,
        None,
        chained(grads[-1], ctx.token_device),
    )


def chained(incoming: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The gradient a group's backward gives the previous group's token,
    whether or not its own token got one ([Note: Every group's backward on
    every rank]): ``incoming``, or an empty tensor where the anchor's backward
    did not run."""
    return torch.zeros(0, device=device) if incoming is None else incoming


class _Regathered(torch.autograd.Function):
    """A token passed through; its backward reads a module's groups'
    all-gather outputs ([Note: Regathered on every rank])."""

    @staticmethod
    def forward(ctx, token, *gathered):  # type: ignore[override]
        ctx.save_for_backward(*gathered)
        return token.view_as(token)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # none of their rows, selected by an index made from the gradient:
        # read in the backward graph, not sliced in the forward and saved
        none = grad.to(torch.long).reshape(-1)
        for gathered in ctx.saved_tensors:
            grad = grad + _zero(gathered.index_select(0, none)).to(grad.dtype)
        return grad, *([None] * len(ctx.saved_tensors))


def regathered(token: torch.Tensor, gathered: list[torch.Tensor]) -> torch.Tensor:
    """``token`` passed through, its gradient made after ``gathered`` (a
    module's groups' all-gather outputs) is recomputed.

    [Note: Regathered on every rank]
    With ``reshard_after_forward`` a traced group is gathered inside a
    checkpoint that recomputes it in backward ([Note: Traced hooks]), and AOT
    autograd's partitioner recomputes only what the backward reads, where it
    first reads it. A rank whose forward dropped a module's output computes
    none of its parameters' gradients, so it would skip the gathers the other
    ranks issue, and the ranks' collectives would differ before the used-mask
    check could stop them ([Note: Every group's backward on every rank]). So
    at the end of the module's forward the current token passes through
    ``_Regathered``, whose backward reads the module's all-gather outputs.
    Made after the module's forward, it runs before the module's backward (and
    before those of modules it called): every rank gathers the module's
    groups again there, in forward order, then its groups' checks and
    reductions follow. Where the parameters got gradients these are the
    gathers recomputed anyway (each once, read by both), at the module's
    backward pre-hook, where FSDP2's eager backward gathers too; the value
    read is empty, and what the forward saves is the checkpoints' inputs, not
    the gathered buffers."""
    return _Regathered.apply(token, *gathered)


def _zero(after: torch.Tensor) -> torch.Tensor:
    """A zero scalar computed from ``after`` (empty), so that what is made
    from it depends on it in the graph."""
    return after.sum()


def _issue_used_check(
    used: list[bool], reduction: Reduction, after: torch.Tensor | None
) -> torch.Tensor:
    """The all-reduce (over the first process group of the reduction) of this
    rank's used-mask and its negation: their maximum and minus their minimum
    ([Note: Unused parameters under trace], [Note: Agreement by extremes]).
    Run on every rank at every backward, as the reduction's collectives are;
    after ``after`` where given."""
    mine = torch.tensor(used, dtype=torch.int32, device=reduction.device)
    if after is not None:
        mine = mine + _zero(after).to(torch.int32)
    extremes = torch.cat([mine, -mine])
    return torch.ops._c10d_functional.all_reduce(extremes, "max", reduction.reduce_groups[0])


def _check_used(issued: torch.Tensor, n: int, reduction: Reduction) -> None:
    """Every rank left the same parameters without a gradient, or every rank
    stops with an error: a gradient kept by one rank only would be dropped from
    the shards of the ranks that have none. ``issued``: ``_issue_used_check``'s
    all-reduce, then over the other process groups in turn (HSDP), so that
    every rank compares the same extremes."""
    functional = torch.ops._c10d_functional
    extremes = functional.wait_tensor(issued)
    for name in reduction.reduce_groups[1:]:
        extremes = functional.wait_tensor(functional.all_reduce(extremes, "max", name))
    torch._assert_async(
        (extremes[:n] == -extremes[n:]).all(),
        "fsdp_rs: a parameter got a gradient on some ranks and none on others under "
        "torch.compile with traced hooks (the ranks' graphs differ); make every rank "
        "use the same parameters, or compile without set_fullgraph_compile()",
    )


unshard_copy_out.register_autograd(_backward, setup_context=_setup_context)
