"""The gradient side of a parameter group: where autograd accumulates the
unsharded gradients, and the post-backward that reduces them into the sharded
``.grad`` DTensors.

[Note: Pre-placed gradients]
Before a group's backward (its pre-backward hook), the group allocates
a gradient buffer in the unsharded layout (one storage resize and one
``zero_``), where that costs no memory FSDP2 does not use ([Note: Reduction
memory]), and points every unsharded parameter's ``.grad`` at its piece of it,
an alias with its own version counter (as in [Note: Unsharded parameter
versions]). Autograd then adds into the buffer in place instead of handing
over a fresh tensor per parameter, and the post-backward reads the whole group
with one ``reduce_scatter_copy_in_flat``: no per-parameter flatten, cat or
checks. Which parameters received a gradient is read off the aliases' version
counters; one whose counter did not move got none on this rank (which ranks
keep a ``.grad`` then is [Note: Gradient agreement]).

Anything else (a ``.grad`` the user set or cleared in between, a gradient that
arrived before the hook, ``create_graph=True`` replacing the alias) is noticed
by identity and takes the per-gradient path: ``reduce_scatter_copy_in`` over
the list autograd left. With side streams (an accelerator) that path is the
one taken, by the memory rule below and not by a device check: the
reduce-scatter inputs stay in flight, so no buffer fits. It is also the faster
one there: in-place accumulation would add one kernel launch per parameter and
a memset plus a read-modify-write of the buffer, where the pointer-table
copy-in reads each gradient once ([Note: Pointer tables]).

[Note: Reduction memory]
fsdp-rs holds no more memory than FSDP2 at any point of a step
(``tests/test_memory.py``), so it frees at FSDP2's points or earlier:

- the post-backward reshards before it reduces: the unsharded parameters are
  freed before the reduce-scatter input is allocated;
- the unsharded gradients (autograd's, or the pre-placed buffer) are dropped
  once the reduce-scatter copy-in has read them, before the output exists;
- a reduce-scatter input kept for a stream (on an accelerator) is released
  before the next group allocates its own ([Note: Cross-stream lifetimes]);
- [No sync] gradients already in the reduce dtype stay on the unsharded
  parameters and autograd adds the next backward's into them in place, as
  FSDP2 keeps them; in another dtype they are cast once and the next ones
  added in place, as FSDP2's ``unsharded_accumulated_grad`` ([Note:
  Unreduced gradients] names the forms).

The pre-placed buffer holds a whole group's gradients (zeros where none
arrived yet) while autograd computes each fresh one, so up to one group's
unsharded gradient more than autograd's hand-over. FSDP2 keeps every
reduce-scatter input until the next group's reduction, on every device;
fsdp-rs on CPU drops it after the collective and records its size
(``CommStreams.released_reduce_bytes``, reset at the end of backward). A group
pre-places only when its buffer fits in that: the first group of a backward,
one larger than the last reduced, and a backward without sync take autograd's
gradients, as FSDP2 does.

[Note: Gradient layout]
The gradient buffers (the pre-placed unsharded one, the reduce-scatter input
and output, the sharded one the ``.grad``s view) hold the group's trainable
parameters only, laid out as the group's own plan would lay out those
parameters alone (``grad_layout``, the group's ``layout`` itself when every
parameter trains). A group with frozen parameters (LoRA: a frozen base weight
and its adapters in one module) thus reduces and keeps only the adapters'
gradients, as FSDP2's reduce-scatter holds only the parameters that take
gradients; rows for the frozen ones would cost the whole layer in every buffer
and on the wire. Every row start is aligned, so a run of consecutive trainable
parameters has the same relative offsets in both layouts.

[Note: Gradient agreement]
Which parameters got a gradient is a local observation: in a mixture of
experts, an expert that no token of this rank was routed to gets none here and
one on the rank its tokens went to. The ``.grad`` state after backward must
not follow it: every rank of the mesh ends with the same set of sharded
``.grad``s, each holding all ranks' contributions (a missing gradient counts
as zeros), else the optimizer steps some rows of a parameter and not others.
So no local observation decides a collective or an assignment alone:

- every group with trainable parameters runs its reduce-scatter at every synced
  post-backward, whatever this rank's gradients (zeros where there are none),
  in the same order on every rank ([Note: Backward order]); its input has
  FSDP2's layout, so the reduction sums each element in FSDP2's order;
- a parameter this rank had a gradient for had one somewhere: it is assigned
  at once. One it had none for waits for ``GradientAgreement`` at the end of
  backward: one all-reduce (MAX) of a flag per parameter of every group reduced
  in that backward, per mesh, on every rank; a rank that missed some reads the
  flags (a device sync, only then) and assigns a ``.grad`` to each parameter
  some rank had a gradient for. A rank that had every gradient pays one small
  collective per backward and no sync.

[Note: Partial gradients of a module called twice]
A module that runs more than once in a forward (a block applied again, shared
weights) has its group's post-backward run once per call, in reverse order.
Autograd adds the calls' gradients into the unsharded parameters only once
it is through all of them, so every visit but the last finds none: FSDP2
reduces nothing there, fsdp-rs reduces zeros ([Note: Gradient agreement]).
With HSDP's all-reduce held back (``set_requires_all_reduce(False)``), the
reduce-scatter outputs summed so far are added, at the backward that
all-reduces, to the first visit where this rank has a gradient, or else to
the group's last visit in this backward ([Note: Backward order] knows which),
as FSDP2 adds them to its first reduction. Added to an earlier visit's zeros,
they would be all-reduced apart from the gradients and round otherwise. From
torch 2.15, FSDP2 reduces zeros at every visit of a group that holds such
gradients and adds them at the first, and so does fsdp-rs there.

[Note: Wider gradient accumulation]
Where the installed torch's FSDP2 has a gradient dtype policy ([Note: Default
reduce dtype]) and a group reduces in a wider floating dtype than it computes
in (bf16 parameters, fp32 reduce), a backward without gradient sync must sum in
the reduce dtype, as FSDP2 has autograd do it: at each pre-backward, an
unsharded parameter with no ``.grad`` gets ``grad_dtype`` = the reduce dtype
when the backward does not reduce, so autograd casts every contribution up and
sums them there; otherwise ``grad_dtype`` is None, and autograd sums in the
compute dtype (a synced backward: the copy-in casts once; or the contributions
are added into the wider ``.grad`` kept from an earlier backward). On older
torch, and for groups that do not widen, nothing is set. A DTensor parameter
whose gradient may be reduced over a tensor-parallel dim first
(``reduces_outside_dp``, [Note: DTensor parameters]) keeps ``grad_dtype`` = the
reduce dtype in every backward, as FSDP2 keeps it, so that reduction runs wide.
With ``grad_dtype`` None a gradient keeps the dtype its op computed it in
(torch 2.15's RMSNorm gives a bf16 weight an fp32 gradient), so such a group
never pre-places a gradient alias in the parameter dtype (autograd would add
the wider gradient into it, rounded), and its reduction casts gradients of
several dtypes each to the reduce dtype, as FSDP2 does. "The reduce dtype"
here is the group's accumulation dtype (``accumulate_dtype``), which is the
reduce dtype unless the parameters set a ``grad_dtype`` of their own ([Note:
Gradient dtype policy]); where that accumulation dtype is narrower than the
compute dtype, or neither, it is set on the unsharded parameters for good
(``fixed_grad_dtype``), and the group never pre-places either.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from fsdp_rs.runtime.api.policies import fsdp2_reduces_partial_first
from fsdp_rs.runtime.comm.collectives import (
    gradient_division,
    reduce_scatter,
    unreduced_post_divide,
)
from fsdp_rs.runtime.group.grad_assign import GradAssignment
from fsdp_rs.runtime.group.grad_state import (
    Accumulated,
    AccumulatedBuffer,
    KeptOnParams,
    PartialReduce,
)
from fsdp_rs.runtime.group.params import (
    alias_storage,
    clear_grads,
    get_grads,
    is_none,
    own_grads,
    set_grads,
    set_own_grads,
)
from fsdp_rs.runtime.step.observe import phase
from fsdp_rs.runtime.step.training_state import backward_task
from fsdp_rs.runtime.variants.nd import DTensorParam

__all__ = ["GradientReduction"]

_VERSION = operator.attrgetter("_version")


def _local_grad(nd, grad: torch.Tensor | None) -> torch.Tensor | None:
    """What is reduced of an unsharded gradient ([Note: DTensor parameters]);
    one already reduced to its local tensor (accumulated earlier) as it is."""
    if nd is None or not isinstance(grad, DTensor | AsyncCollectiveTensor):
        return grad
    return nd.local_grad(grad)


def _accumulate(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``acc += grad`` as autograd accumulates into a ``grad_dtype``: a wider
    gradient is rounded to it first; a narrower one is added as it is (its
    widening is exact, and a cast copy would cost memory FSDP2 does not use)."""
    if grad.dtype.itemsize > acc.dtype.itemsize:
        grad = grad.to(acc.dtype)
    return acc.add_(grad)


class GradientReduction:
    """Mixed into ``FSDPParamGroup``: the gradient buffers and the post-backward.

    Uses the group's plan, tables, mesh info, dtypes (``widens_grads``: [Note:
    Wider gradient accumulation]) and the flags the API sets
    (``reduce_grads``, ``all_reduce_grads``, ``gradient_divide_factor``,
    ``all_reduce_hook``, ``force_sum_reduction``, ``reshard_after_backward``).
    What the reduction becomes on the sharded parameters (their ``.grad``
    views, their hooks) is the ``GradAssignment`` it holds, ``grad_assign``."""

    def _init_gradients(self) -> None:
        # On every device: whether a step pre-places is decided by memory
        # (``_preplace_fits``), never by device type; with side streams the
        # reduce-scatter inputs stay in flight and nothing is released to fit in,
        # so an accelerator takes autograd's gradients (the per-gradient path
        # CI runs under the stream simulator, tests/test_streams.py).
        self.preplace_grads = True
        self._placed = False  # the aliases are the unsharded params' .grad now
        # The backward (graph task id) in which placing was found not to fit, or
        # None: [Note: One placement check per backward]
        self._declined_in: int | None = None
        # The aliases' version counters when placed; only autograd's additions
        # move them, so the post-backward's reading serves the next placement.
        self._versions: list[int] | None = None
        # [Note: Unreduced gradients] what backwards without sync left (None:
        # nothing), and what backwards without HSDP's all-reduce left
        self._unsynced: KeptOnParams | Accumulated | AccumulatedBuffer | None = None
        self._partial: PartialReduce | None = None
        # the module's backward visits the group again in this backward (it ran
        # more than once in forward): [Note: Partial gradients of a module called twice]
        self.visits_left = False
        self._partial_first = fsdp2_reduces_partial_first()
        # the sharded gradient buffer, its .grad views and the row awaiting
        # agreement ([Note: Sharded gradient buffer]); the agreement (the root's)
        self.grad_assign = GradAssignment()
        self.agreement = None
        self.all_reduce_hook_stream = None  # set_all_reduce_hook(stream=...)
        self.finalize_pending = False  # [Note: Manual backward finalization]

    def _make_grad_aliases(self) -> None:
        """The unsharded gradient buffer (storage freed) and one alias per
        parameter that takes gradients; see [Note: Pre-placed gradients]."""
        if self._placed:  # [No sync] the old buffer keeps the gradients so far
            had = list(map(operator.ne, map(_VERSION, self._grad_aliases), self._versions))
            self._unsynced = AccumulatedBuffer(self.unsharded_grad, had)
            self._placed = False
        self.unsharded_grad = torch.empty(
            self.grad_layout.plan.unsharded_numel, dtype=self.param_dtype, device=self.device
        )
        storage = self.unsharded_grad.untyped_storage()
        self._grad_aliases = [
            alias_storage(storage, self.unsharded_grad, *layout) for layout in self._grad_layouts()
        ]
        storage.resize_(0)
        self._versions = None

    def _grad_layouts(self) -> list[tuple[int, torch.Size, tuple[int, ...]]]:
        """(unsharded offset, shape, stride) of each parameter that takes gradients,
        in the gradient layout ([Note: Gradient layout])."""
        if not self._grad_index:
            return []
        layout = self.grad_layout
        offsets = layout.plan.unsharded_offsets.tolist()
        shapes = [self.shapes[i] for i in self._grad_index]
        return list(zip(offsets, shapes, layout.strides, strict=True))

    def prepare_gradients(self) -> None:
        """Point the unsharded ``.grad``s at a zeroed gradient buffer (before the
        group's backward); a no-op where pre-placement is off or not possible."""
        if self.unsharded_params is None:
            return
        params = self._unsharded_with_grad
        if self.widens_grads:
            self._set_grad_dtypes(self._widened)
            # autograd leaves gradients in the dtype it computes them in: a
            # pre-placed alias in the parameter dtype would round a wider one
            return
        if self.fixed_grad_dtype is not None:  # autograd casts to it: no alias fits
            return
        if not self.preplace_grads or self._placed:
            return
        # [Note: One placement check per backward]
        # A group over several modules (``fully_shard([...])``, ``auto_shard``)
        # runs this at each module's pre-backward. Whether its gradients can be
        # placed is read once per backward: reading every parameter's ``.grad``
        # at each of M modules cost O(M * P) per step (a group of 1,000 Linears
        # spent most of its backward here). What would let a later module
        # place (another group's reduction freeing room) leaves this backward
        # on the per-gradient path, FSDP2's own, with the same results; this
        # group's post-backward reads the question anew.
        task = backward_task()
        if self._declined_in == task:
            return
        if not params or not self._preplace_fits() or not all(map(is_none, get_grads(params))):
            self._declined_in = task
            return
        grad = self.unsharded_grad
        grad.untyped_storage().resize_(grad.numel() * grad.element_size())
        grad.zero_()
        set_grads(params, self._grad_aliases)
        if self._versions is None:  # else the post-backward's reading still holds
            self._versions = list(map(_VERSION, self._grad_aliases))
        self._placed = True

    def _set_grad_dtypes(self, params: list[torch.Tensor]) -> None:
        """Autograd's accumulation dtype per unsharded parameter for this backward
        ([Note: Wider gradient accumulation])."""
        wide = None if self.reduce_grads else self.accumulate_dtype
        for param in params:
            param.grad_dtype = wide if param.grad is None else None

    def _fix_grad_dtypes(self) -> None:
        """The accumulation dtype on the new unsharded parameters, where it is
        fixed ([Note: Gradient dtype policy])."""
        if self.fixed_grad_dtype is not None:
            for param in self._unsharded_with_grad:
                param.grad_dtype = self.fixed_grad_dtype

    def _preplace_fits(self) -> bool:
        """Whether the buffer fits in what FSDP2 would still hold here: the last
        reduce-scatter input of this backward ([Note: Reduction memory])."""
        grad = self.unsharded_grad
        return grad.numel() * grad.element_size() <= self.streams.released_reduce_bytes

    def holds_unreduced_grads(self) -> bool:
        """Gradients of the unsharded parameters that no reduction has taken yet:
        left by backwards without sync or all-reduce ([Note: Unreduced
        gradients]), or placed for a backward in progress."""
        return self._unsynced is not None or self._partial is not None or self._placed

    def discard_gradient_state(self) -> None:
        """Drop what a failed iteration left (``reset_iter_state``): gradients
        accumulated without sync or all-reduce, a reduction awaiting agreement,
        the placed unsharded gradients. Assigned sharded ``.grad``s stay."""
        unsynced, self._unsynced = self._unsynced, None
        self._partial = None
        self.grad_assign.unagreed = None
        if isinstance(unsynced, KeptOnParams):
            clear_grads(unsynced.params)
        if self._placed and self.unsharded_params is not None:
            clear_grads(self._unsharded_with_grad)
        self._free_grad_buffer()
        self._versions = None
        self.finalize_pending = False

    def _free_grad_buffer(self) -> None:
        if self._placed:
            self.unsharded_grad.untyped_storage().resize_(0)
            self._placed = False

    # ---------------------------------------------------------- post-backward

    def post_backward(self) -> None:
        """Reduce the gradients autograd left on the unsharded parameters into the
        sharded ``.grad`` DTensors, then reshard (per ``reshard_after_backward``)."""
        self._declined_in = None  # [Note: One placement check per backward]
        # Without sync the gradients wait for a synced post-backward, which
        # finalize_backward() runs ([Note: Manual backward finalization]).
        self.finalize_pending = not self.reduce_grads
        if self.unsharded_params is None or not self._grad_index:
            return  # never unsharded, or nothing trainable: the same on every rank
        params = self._unsharded_with_grad
        kept = self._unsynced
        if isinstance(kept, KeptOnParams) and kept.params is not params:
            # [No sync] the unsharded parameters were made again since (adoption)
            self._unsynced = Accumulated(self._read_grads(kept.params))
            clear_grads(kept.params)
        del kept  # the old parameters: no reference left here
        grads = self._read_grads(params)
        keep = not self.reduce_grads and self._keeps_on_params(grads)
        if keep:  # [No sync] as FSDP2: see [Note: Unreduced gradients]
            if not isinstance(self._unsynced, KeptOnParams):
                self._unsynced = KeptOnParams(params)
        else:
            if isinstance(self._unsynced, KeptOnParams):
                self._unsynced = None  # read: reduced, or accumulated, below
            clear_grads(params)
        # Reshard first, as FSDP2 does: the unsharded parameters are freed before
        # the reduction allocates its buffers ([Note: Reduction memory]). A
        # pending (prefetched) unshard is left to the end of backward, which
        # keeps it unless this is the last backward.
        if self.reshard_after_backward and not self.unshard_pending:
            self.reshard()
        if keep:
            return
        context = self.step_context
        if context is not None and context.labelling:  # [Note: Labels and logs]
            with phase(context, "FSDP::post_backward_reduce", self.fqn):
                self._reduce_in_backward(grads)
        else:
            self._reduce_in_backward(grads)
        self._free_grad_buffer()

    def _reduce_in_backward(self, grads: list[torch.Tensor | None]) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True): record nothing
            with torch.no_grad():
                self._reduce_grads(grads)
        else:  # autograd runs hooks without grad mode: spare the context (~3 us)
            self._reduce_grads(grads)

    def _read_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
        """The gradients autograd left on the unsharded ``params`` (those with a
        gradient); an annotated parameter's read as the DTensor it is ([Note:
        spmd_types parameters]), before anything else sees it."""
        grads = get_grads(params)
        if self.annotations is not None:
            grads[:] = map(DTensorParam.typed_grad, self._grad_nd, grads)
        return grads

    def _keeps_on_params(self, grads: list[torch.Tensor | None]) -> bool:
        """[No sync] Whether this backward's gradients stay on the unsharded
        parameters: nothing accumulated elsewhere, all in the accumulation dtype
        (the reduce dtype unless [Note: Gradient dtype policy])."""
        dtype = self.accumulate_dtype
        unsynced = self._unsynced
        return (unsynced is None or isinstance(unsynced, KeptOnParams)) and all(
            g is None or g.dtype == dtype for g in grads
        )

    def _reduce_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Reduce ``grads`` (what autograd left on the unsharded parameters): by
        the buffer when they are all the placed aliases, else per gradient."""
        aliased: list[bool] = []
        if self._placed:  # an alias whose version did not move got no gradient
            versions = list(map(_VERSION, self._grad_aliases))
            had = list(map(operator.ne, versions, self._versions))
            self._versions = versions
            aliased = list(map(operator.is_, grads, self._grad_aliases))
        # Reduced even where this rank has no gradient: [Note: Gradient agreement].
        if aliased and all(aliased):
            grads.clear()
            self._reduce_buffer(self.unsharded_grad, had)
        else:
            if aliased:  # some replaced (by the user, or create_graph=True)
                grads[:] = [
                    None if a and not h else g for g, a, h in zip(grads, aliased, had, strict=True)
                ]
            self._reduce_list(grads)

    def _buffer_as_list(self, buffer: torch.Tensor, had: list[bool]) -> list[torch.Tensor | None]:
        views = [buffer.as_strided(s, st, off) for off, s, st in self._grad_layouts()]
        return [v if h else None for v, h in zip(views, had, strict=True)]

    def _reduce_buffer(self, buffer: torch.Tensor, had: list[bool]) -> None:
        if isinstance(self._unsynced, Accumulated):  # mixed with a per-gradient step
            self._reduce_list(self._buffer_as_list(buffer, had))  # goes per gradient
            return
        unsynced = self._unsynced
        if isinstance(unsynced, AccumulatedBuffer):  # in place, as FSDP2's ``+=``
            previous, previous_had = unsynced.buffer, unsynced.had
            self._unsynced = None
            previous.add_(buffer)
            if buffer is self.unsharded_grad:  # read: [Note: Reduction memory]
                self._free_grad_buffer()
            buffer = previous
            had = list(map(operator.or_, had, previous_had))
        if not self.reduce_grads:
            if buffer is self.unsharded_grad:  # freed next; FSDP2 keeps the reduce dtype
                buffer = buffer.to(self.accumulate_dtype, copy=True)
            self._unsynced = AccumulatedBuffer(buffer, had)
            return
        division = self._division()
        rs_in = self._reduce_scatter_input()
        args = self.grad_layout.tables.reduce_scatter_flat_args()
        self.ops.reduce_scatter_copy_in_flat(buffer, rs_in, *args, division.pre)
        # [Note: Reduction memory] the gradients are in the input now: free them.
        if buffer is self.unsharded_grad:
            self._free_grad_buffer()
        del buffer
        self._reduce_scatter(rs_in, division, had)

    def _reduce_list(self, grads: list[torch.Tensor | None]) -> None:
        """Reduce per gradient. Clears ``grads`` once they are read, which frees
        them where it held the last references ([Note: Reduction memory])."""
        # what backwards without sync accumulated, per parameter (or None): taken,
        # added to this backward's below
        unsynced, self._unsynced = self._unsynced, None
        accumulated = None
        if isinstance(unsynced, AccumulatedBuffer):
            accumulated = self._buffer_as_list(unsynced.buffer, unsynced.had)
        elif isinstance(unsynced, Accumulated):
            accumulated = unsynced.grads
        del unsynced  # no reference left here: [Note: Reduction memory]
        if self._grad_nd is not None:  # [Note: DTensor parameters]
            grads[:] = map(_local_grad, self._grad_nd, grads)
            if accumulated is not None:
                accumulated = list(map(_local_grad, self._grad_nd, accumulated))
        # Gradients of several dtypes: autograd left some in the reduce dtype
        # (``reduces_outside_dp``), or, where a group widens, in whatever dtype an
        # op's backward gave (torch >= 2.15's RMSNorm gives its bf16 weight an
        # fp32 gradient) next to ones in the parameter dtype ([Note: Wider
        # gradient accumulation]): each is cast to the reduce dtype, as FSDP2
        # casts each; the copy-in takes one dtype.
        if len({g.dtype for g in grads if g is not None}) > 1:
            grads[:] = [None if g is None else g.to(self.reduce_dtype) for g in grads]
        dtype = self.accumulate_dtype
        if accumulated is not None:  # in place, as FSDP2's ``+=``
            grads[:] = [
                a if g is None else (g.to(dtype) if a is None else _accumulate(a, g))
                for a, g in zip(accumulated, grads, strict=True)
            ]
            accumulated = None
        if not self.reduce_grads:
            # [No sync] keep the unsharded gradients, in the reduce dtype as FSDP2 does;
            # a copy of those that alias the gradient buffer (freed next).
            placed = self.unsharded_grad.untyped_storage().data_ptr() if self._placed else None
            copies = [
                None if g is None else g.to(dtype, copy=g.untyped_storage().data_ptr() == placed)
                for g in grads
            ]
            self._unsynced = Accumulated(copies)
            grads.clear()
            return
        division = self._division()
        had = [g is not None for g in grads]
        full = list(grads)  # in the gradient layout: [Note: Gradient layout]
        grads.clear()
        rs_in = self._reduce_scatter_input()
        self.sharding.copy_in(self, full, rs_in, division.pre)
        full.clear()  # [Note: Reduction memory]
        self._free_grad_buffer()
        self._reduce_scatter(rs_in, division, had)

    def _division(self):
        info = self.info
        return gradient_division(
            self.reduce_dtype,
            info.shard_size,
            info.replicate_size,
            self.gradient_divide_factor,
            self.force_sum_reduction,
        )

    def _reduce_scatter_input(self) -> torch.Tensor:
        self.streams.release_reduce_scatter_inputs(self)
        rows, row = self.info.shard_size, self.grad_layout.plan.row_numel
        comm = self.reduce_scatter_comm  # [Note: Comm objects]
        if comm is None:
            return torch.empty(rows, row, dtype=self.reduce_dtype, device=self.device)
        flat = comm.allocate((rows * row,), dtype=self.reduce_dtype, device=self.device)
        return flat.view(rows, row)

    def _reduce_scatter(self, rs_in: torch.Tensor, division, had_grad: list[bool]) -> None:
        """Reduce-scatter (+ all-reduce across replicas, + the user's hook), then
        the post-reduce, on the streams of [Note: Streams]."""
        # before the collective, on every path to it: [Note: One trainable set on every rank]
        self.agreement.check_trainable(self)
        info, plan, streams = self.info, self.grad_layout.plan, self.streams
        assign = self.grad_assign
        post = division.post
        comm = self.reduce_scatter_comm
        if self.reduce_scatter_unused_params:
            # Every trainable parameter is reduced (zeros where no gradient) and
            # gets a .grad, as FSDP2 does with set_reduce_scatter_unused_params.
            had_grad = [True] * len(had_grad)
        # Read now only where it decides the output: with replicas whose
        # all-reduce waits for a later backward the gradients stay partial ([No
        # all-reduce]) and are assigned after that one.
        partial = info.replicate_group is not None and not self.all_reduce_grads
        current = None if partial else own_grads(self._grad_params)
        direct = (
            comm is None
            and current is not None
            and assign.reduces_into_buffer(self, had_grad, current)
        )
        rs_stream = post_stream = None
        if streams.enabled:
            streams.begin_reduction(self)
            rs_stream = post_stream = streams.reduce_scatter
        with streams.on(rs_stream):
            if info.shard_size > 1:
                group = self.reduce_scatter_group or info.shard_group
                if comm is not None:
                    output = comm.allocate(
                        (plan.row_numel,), dtype=self.reduce_dtype, device=self.device
                    )
                    comm(
                        output_tensor=output,
                        input_tensor=rs_in.view(-1),
                        group=group,
                        op=division.reduce_scatter_op,
                    )
                else:
                    if direct:
                        output, views = assign.new_buffer(self)
                    else:
                        output = torch.empty(
                            plan.row_numel, dtype=self.reduce_dtype, device=self.device
                        )
                    reduce_scatter(
                        output, rs_in.view(-1), op=division.reduce_scatter_op, group=group
                    )
            else:
                output = rs_in[0]
                post = unreduced_post_divide(division, self.gradient_divide_factor)
            rs_event = streams.record(rs_stream)
            if info.replicate_group is not None:
                # [No all-reduce] the replicas' partial gradients are summed here
                # until a backward all-reduces them (on this stream: it made them).
                partial = self._partial
                if partial is not None and (  # in place, as FSDP2's ``+=``
                    not self.all_reduce_grads
                    or self._partial_first
                    or any(had_grad)
                    or not self.visits_left
                ):
                    output.add_(partial.output)
                    had_grad = list(map(operator.or_, had_grad, partial.had))
                    self._partial = None
                del partial
                if not self.all_reduce_grads:
                    self._partial = PartialReduce(output, had_grad)
                    self._end_reduction(rs_in, rs_event, rs_stream, streams.record(rs_stream), None)
                    return
        hook = self.all_reduce_hook
        if info.replicate_group is not None or hook is not None:
            if streams.enabled:
                post_stream = streams.all_reduce
                if info.replicate_group is None and self.all_reduce_hook_stream is not None:
                    post_stream = self.all_reduce_hook_stream
                post_stream.wait_stream(rs_stream)
            with streams.on(post_stream):
                if info.replicate_group is not None:
                    dist.all_reduce(output, op=division.all_reduce_op, group=info.replicate_group)
                if hook is not None:
                    self._run_all_reduce_hook(hook, output)
        with streams.on(post_stream):
            if direct:
                if post != 1.0:
                    output.div_(post)  # in place, as FSDP2 divides its reduce output
                set_own_grads(self._grad_params, views)
            else:
                assign.assign(self, output, post, had_grad, current)
            assign.run_accumulate_hooks(self, had_grad)
            post_event = streams.record(post_stream)
        self.agreement.note(self, had_grad, post_stream)
        # One rank: the post-reduce read the input itself.
        rs_in_event = post_event if info.shard_size == 1 else rs_event
        self._end_reduction(rs_in, rs_in_event, post_stream, post_event, output)

    def _run_all_reduce_hook(self, hook: Callable, output: torch.Tensor) -> None:
        """``hook(output)`` with the stream ``set_all_reduce_hook`` named current:
        where side streams run, it already is; without them (CPU), the device
        module's stream context makes it current for the hook, as FSDP2 does."""
        stream = self.all_reduce_hook_stream
        if stream is None or self.streams.enabled or self.info.replicate_group is not None:
            hook(output)
            return
        with torch.get_device_module(self.device.type).stream(stream):
            hook(output)

    def _end_reduction(self, rs_in, rs_in_event, post_stream, post_event, output) -> None:
        """Keep what the streams still use; see [Note: Cross-stream lifetimes]."""
        streams = self.streams
        if not streams.enabled:  # dropped now: [Note: Reduction memory]
            streams.released_reduce_bytes = rs_in.numel() * rs_in.element_size()
            return
        streams.keep_reduce_scatter_input(rs_in, rs_in_event)
        streams.note_post_reduce(post_stream, post_event)
        if post_stream is not streams.reduce_scatter:
            streams.keep_reduce_output(self, output, post_event)
