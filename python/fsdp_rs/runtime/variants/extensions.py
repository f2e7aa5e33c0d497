"""FSDP2's all-gather extensions: a parameter whose local shard defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (a tensor subclass such as
torchao's float8 weights, or methods set on a plain local tensor).

[Note: All-gather extensions]
An extension decides what is all-gathered and how the unsharded parameter is
made from it: ``fsdp_pre_all_gather(mesh[, outer_size, outer_stride, module,
mp_policy])`` returns ``(inputs, metadata)``, any number of tensors of any
dtypes (float8 data and its scales, say); after the all-gather,
``fsdp_post_all_gather(outputs, metadata, param_dtype)`` returns the unsharded
tensor and the tensors to free at reshard, and on later unshards is called
with ``out=`` the unsharded parameter made the first time, to refill it in
place. fsdp-rs calls them as FSDP2 does: the mesh is the shard mesh (1-D under
HSDP), ``outer_size`` and ``outer_stride`` the full parameter's, ``module``
the module that registers the parameter, the all-gather outputs are kept
across unshards (their storage freed and re-allocated, so an unsharded tensor
that aliases them stays valid) and passed as ``(world * rows, *rest)``.

Such a group (its gather strategy an ``ExtensionGather``) cannot use the
row-layout buffers: the local shards are the user's tensors (a subclass's
chunks, kept as FSDP2 keeps them) and the all-gather inputs are whatever the
extension returns. So its unshard is per parameter around one collective:
every input is packed into one byte buffer (dtypes may differ) and
all-gathered once, then copied out to its parameter's outputs. Parameters of
the group without an extension take FSDP2's default there (their padded shard,
cast to the parameter dtype). The gradient side is the group's own
(``GradientReduction``), planned over the parameters' shapes: a gradient that
is itself a subclass is read into a plain tensor first, by its own dispatch,
and the sharded ``.grad``s are plain DTensors, as FSDP2's. Gradients are not
pre-placed ([Note: Pre-placed gradients]): a plain alias cannot stand for a
subclass's gradient.

A subclass is recognised at ``fully_shard`` (its parameters form a group of
their own, [Note: One group per dtype]); methods set on a local shard after
``fully_shard`` (FSDP2's test patches them after ``to_empty``) are found at
lazy init, where the group's gather strategy becomes an ``ExtensionGather``
(``become_extension_group``: the same object, so the state, the bundle and the
flags set on it stay valid).
``reshard_after_forward=int`` reshards such a group fully after forward: FSDP2
has no post-forward shard of an extension's outputs either. Under
``set_fullgraph_compile`` the same steps are traced ([Note: Extensions under
trace], ``runtime/compile/traced_extension.py``).

[Note: Sharded and gathered as FSDP2]
A subclass may implement only the operations FSDP2 runs on it: torchao's
``NF4Tensor`` (QLoRA's frozen base weights) has ``torch.chunk``,
``new_zeros``, ``copy_``, ``view(-1)`` and a ``narrow`` from row 0, and raises
on ``aten.slice``. So a local shard is made as FSDP2's ``_init_sharded_param``
makes it: this rank's chunk of ``torch.chunk`` by rows is copied into
``narrow(0, 0, rows)`` of a zero padded chunk (``new_zeros``), and the shard is
that chunk's ``narrow(0, 0, rows)``; nothing is indexed or sliced. The
all-gather inputs may have any shape (NF4's are its flat inner tensors, not
rows of the parameter): each is gathered by its element count and its output
viewed as ``(-1, *shape[1:])`` (FSDP2's ``foreach_all_gather`` and
``foreach_all_gather_copy_out``), so every rank's inputs must have the same
sizes, as in FSDP2. One thing fsdp-rs adds: on an uneven shard an input of
this rank's rows (dim 0) with as many dims as the parameter is padded with
zero rows to the chunk, where FSDP2 requires the extension to pad it.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_rs.runtime.comm.collectives import all_gather
from fsdp_rs.runtime.group.gather import GatherStrategy
from fsdp_rs.runtime.group.grad_state import Accumulated
from fsdp_rs.runtime.group.param_group import FSDPParamGroup
from fsdp_rs.runtime.group.params import alias_storage
from fsdp_rs.runtime.group.unshard import ShardedState
from fsdp_rs.runtime.variants.bundle import GroupBundle

__all__ = [
    "POST_ALL_GATHER",
    "PRE_ALL_GATHER",
    "ExtensionGather",
    "as_output",
    "become_extension_group",
    "check_extensions",
    "has_extension",
    "pack",
    "plain_grad",
    "unpack",
]

PRE_ALL_GATHER = "fsdp_pre_all_gather"
POST_ALL_GATHER = "fsdp_post_all_gather"


def has_extension(t: torch.Tensor) -> bool:
    return hasattr(t, PRE_ALL_GATHER)


def refuse_on_dtensor(fqn: str) -> None:
    """An all-gather extension on a DTensor parameter's local tensor (float8
    with tensor parallelism): not run by fsdp-rs yet, and never all-gathered as
    plain data in its place."""
    raise NotImplementedError(
        f"fully_shard: the local tensor of parameter {fqn} defines {PRE_ALL_GATHER} (an all-gather "
        "extension) in a group of DTensor parameters (tensor or expert parallelism); "
        "fsdp-rs does not run extensions there yet: shard this module with torch's "
        "fully_shard"
    )


def _check_pair(fqn: str, t: torch.Tensor) -> None:
    if hasattr(t, PRE_ALL_GATHER) != hasattr(t, POST_ALL_GATHER):
        raise ValueError(
            f"fully_shard: the local shard of parameter {fqn} ({type(t).__name__}) defines "
            f"only one of {PRE_ALL_GATHER} and {POST_ALL_GATHER}; an all-gather extension "
            "needs both"
        )


def _alloc(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _rows_of(t: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether all-gather input ``t`` is rows of the local shard ``local``: its
    rows and as many dims ([Note: Sharded and gathered as FSDP2])."""
    return t.dim() == local.dim() and t.size(0) == local.size(0)


def plain_grad(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A subclass gradient read into a plain tensor (by its own dispatch)."""
    if grad is None or type(grad) is torch.Tensor:
        return grad
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    out.copy_(grad)
    return out


def pack(per_param: list[tuple[list[torch.Tensor], object]]) -> torch.Tensor:
    """Every parameter's all-gather inputs (``ExtensionGather.inputs_of``'s, with
    their metadata) back to back in one byte buffer: the inputs may have
    several dtypes ([Note: All-gather extensions])."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for ins, _ in per_param for t in ins])


def unpack(
    gathered: torch.Tensor, per_param: list[tuple[list[torch.Tensor], object]]
) -> list[list[torch.Tensor]]:
    """Per parameter, the bytes of each of its inputs in ``gathered`` (``pack``'s
    buffer all-gathered, world x its bytes): world x the input's bytes, in
    ``uint8``."""
    out, offset = [], 0
    for ins, _ in per_param:
        columns = []
        for t in ins:
            nbytes = t.numel() * t.element_size()
            columns.append(gathered[:, offset : offset + nbytes])
            offset += nbytes
        out.append(columns)
    return out


def as_output(gathered: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """All-gather input ``t``'s output ``gathered`` (every rank's, in its
    dtype) as ``fsdp_post_all_gather`` takes it: ``(world * rows, *rest)``."""
    return gathered.view(-1, *t.shape[1:])


def _dtype_carrier(group, locals_: list[torch.Tensor]) -> torch.Tensor:
    """``group.sharded`` of an extension group: no data (the local shards hold
    it), only the dtype and device the gradient side reads."""
    device = locals_[0].device if locals_ else group.shard_device
    return torch.empty(0, dtype=group.orig_dtype, device=device)


def _padded(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """This rank's rows ``t`` padded with zero rows to ``chunk``."""
    t = t.contiguous()
    if t.size(0) == chunk:
        return t
    padded = t.new_zeros((chunk, *t.shape[1:]))
    padded.narrow(0, 0, t.size(0)).copy_(t)
    return padded


class ExtensionGather(GatherStrategy):
    """The gather strategy of a group whose parameters (some or all) use
    all-gather extensions; see [Note: All-gather extensions]. One per group: it
    keeps the all-gather outputs and the tensors to free at reshard."""

    preplaces_grads = False  # a plain alias cannot stand for a subclass's gradient
    adopts_grad_dtypes = False  # its shards are the extensions' own tensors
    reads_subclass_grads = True

    def __init__(self) -> None:
        self.outputs: list[list[torch.Tensor]] = []  # per param, kept across unshards
        self.inner: list[list[torch.Tensor]] = []  # per param, freed at reshard
        self.owners: list[nn.Module] | None = None

    def reset_unsharded(self, group) -> None:
        """The unsharded parameters are made again at the next unshard."""
        group.unsharded_params = None
        self.outputs = []
        self.inner = []
        self.owners = None

    # ------------------------------------------------------------------ init

    def build_sharded(self, group, params: list[nn.Parameter]) -> None:
        """Each local shard is this rank's chunk of the parameter, made by the
        parameter's own type (a subclass stays one) with FSDP2's operations
        only: ``torch.chunk``, a zero padded chunk, ``narrow`` + ``copy_``
        into it and ``narrow`` back ([Note: Sharded and gathered as FSDP2])."""
        rank, world = group.info.shard_rank, group.info.shard_size
        chunk_rows = group.plan.chunk_rows.tolist()
        sharded_rows = group.plan.sharded_rows.tolist()
        locals_ = []
        with torch.no_grad():
            for p, chunk, rows in zip(params, chunk_rows, sharded_rows, strict=True):
                data = p.detach()
                padded = data.new_zeros((chunk, *data.shape[1:]))
                if rows:
                    padded.narrow(0, 0, rows).copy_(torch.chunk(data, world, dim=0)[rank])
                if group.offload_to_cpu and not padded.is_meta:
                    padded = padded.cpu()
                    if group.pin_memory:
                        padded = padded.pin_memory()
                locals_.append(padded.narrow(0, 0, rows))
        group.sharded = _dtype_carrier(group, locals_)
        group._make_sharded_params(group.requires_grad, locals_)
        group.managed.swap(group.sharded_params)
        self.reset_unsharded(group)

    def check_pairs(self, group) -> None:
        for fqn, p in zip(group.managed.fqns, group.managed.registered(), strict=True):
            if isinstance(p, DTensor):
                _check_pair(fqn, p._local_tensor)

    def on_meta(self, group) -> bool:
        return any(
            p._local_tensor.is_meta for p in group.managed.registered() if isinstance(p, DTensor)
        )

    def adopt_registered(self, group) -> None:
        """FSDP2's re-reading of the registered parameters: the local shards are
        read at each unshard, so only new objects or a new dtype matter here;
        see [Note: Adopting registered parameters]."""
        if group.state == ShardedState.UNSHARDED:
            return
        current = group.managed.registered()
        group._check_registered_dtensors(current)
        locals_ = [p._local_tensor for p in current]
        if any(t.is_meta for t in locals_):
            return
        group._check_adopted(current, locals_)
        changed = any(a is not b for a, b in zip(current, group.sharded_params, strict=True))
        if locals_[0].dtype != group.orig_dtype:
            group._set_dtypes(locals_[0].dtype)
            changed = True
        if group.sharded.device != locals_[0].device or group.sharded.dtype != group.orig_dtype:
            group.sharded = _dtype_carrier(group, locals_)
        if changed:
            group.sharded_params = current
            group._keep_grad_dtype()
            group._read_requires_grad()
            self.reset_unsharded(group)
            group.managed.swap(group.sharded_params)

    # --------------------------------------------------------------- unshard

    def _owner_modules(self, group) -> list[nn.Module]:
        """The module registering each parameter (FSDP2 passes it to the
        pre-all-gather)."""
        if self.owners is None:
            managed = group.managed
            modules = managed.slot_modules(group.modules)
            self.owners = [modules[k] for k in managed.first_slots()]
        return self.owners

    def inputs_of(self, group, i: int, local: torch.Tensor, chunk: int) -> tuple[list, object]:
        """Parameter ``i``'s all-gather inputs (contiguous, of any shape) and
        metadata."""
        if local.device != group.device:  # CPU offload
            local = local.to(group.device, non_blocking=True)
        pre = getattr(local, PRE_ALL_GATHER, None)
        if pre is None:  # FSDP2's default: the padded shard in the parameter dtype
            return [_padded(local.to(group.param_dtype), chunk)], None
        arity = len(inspect.signature(pre).parameters)
        if arity == 1:
            inputs, metadata = pre(group.info.shard_mesh)
        elif arity == 5:
            owner = self._owner_modules(group)[i]
            inputs, metadata = pre(
                group.info.shard_mesh, group.shapes[i], group.strides[i], owner, group.mp_policy
            )
        else:
            raise TypeError(
                f"fsdp_rs: {PRE_ALL_GATHER} of parameter {group.managed.fqns[i]} takes {arity} "
                "arguments; it must be fsdp_pre_all_gather(mesh) or fsdp_pre_all_gather(mesh, "
                "outer_size, outer_stride, module, mp_policy)"
            )
        # [Note: Sharded and gathered as FSDP2]
        uneven = local.dim() > 0 and local.size(0) != chunk
        return [
            _padded(t, chunk) if uneven and _rows_of(t, local) else t.contiguous() for t in inputs
        ], metadata

    def unshard(self, group, async_op: bool, side_streams: bool) -> None:
        if group.trainable_set_changed():  # [Note: Trainable set changes]
            self.reset_unsharded(group)  # the first wait after it reads requires_grad again
        streams, info = group.streams, group.info
        copy_in_stream, ag_stream = streams.all_gather_streams(side_streams and not async_op)
        chunk_rows = group.plan.chunk_rows.tolist()
        with streams.on(copy_in_stream), torch.no_grad():
            per_param = [
                self.inputs_of(group, i, p._local_tensor, chunk)
                for i, (p, chunk) in enumerate(zip(group.sharded_params, chunk_rows, strict=True))
            ]
            flat = pack(per_param)
        if ag_stream is not None:
            ag_stream.wait_stream(copy_in_stream)
        comm = group.all_gather_comm  # [Note: Comm objects]
        work = None
        with streams.on(ag_stream):
            if comm is not None and info.shard_size > 1:  # one rank: none, as FSDP2
                out = comm.allocate(
                    (info.shard_size * flat.numel(),), dtype=torch.uint8, device=group.device
                )
                work = comm(
                    output_tensor=out, input_tensor=flat, group=info.shard_group, async_op=async_op
                )
            elif info.shard_size > 1:
                out = torch.empty(
                    info.shard_size * flat.numel(), dtype=torch.uint8, device=group.device
                )
                work = all_gather(out, flat, group=info.shard_group, async_op=async_op)
            else:
                out = flat
            event = streams.record(ag_stream)
        group._pending_unshard = (work if async_op else None, out, event, flat, per_param)

    def wait_for_unshard(self, group, defer_release: bool) -> None:
        work, out, _, flat, per_param = group._await_unshard(defer_release)
        streams = group.streams
        world = group.info.shard_size
        gathered = out.view(world, -1)
        first = group.unsharded_params is None
        # [Note: Made outside inference mode] (runtime/group/unshard.py): the buffers and
        # parameters made at the first unshard
        made_here = torch.inference_mode(False) if first else contextlib.nullcontext()
        with made_here:
            if first:
                group._read_requires_grad()
                self.outputs = [
                    [
                        torch.empty(world * t.numel(), dtype=t.dtype, device=group.device)
                        for t in ins
                    ]
                    for ins, _ in per_param
                ]
                self.inner = [[] for _ in per_param]
                params: list[nn.Parameter] = []
            with torch.no_grad():
                unpacked = unpack(gathered, per_param)
                for i, (inputs, metadata) in enumerate(per_param):
                    outputs = self.outputs[i]
                    for o, columns in zip(outputs, unpacked[i], strict=True):
                        _alloc(o)
                        with torch.autograd._unsafe_preserve_version_counter(o):
                            o.view(world, -1).view(torch.uint8).copy_(columns)
                    unflat = tuple(map(as_output, outputs, inputs))
                    local = group.sharded_params[i]._local_tensor
                    post = getattr(local, POST_ALL_GATHER, None)
                    if first:
                        params.append(self._new_unsharded(group, i, post, unflat, metadata))
                    elif post is not None:
                        for t in self.inner[i]:
                            _alloc(t)
                        post(unflat, metadata, group.param_dtype, out=group.unsharded_params[i])
        if first:
            group.unsharded_params = params
            group._unsharded_with_grad = [params[i] for i in group._grad_index]
            group._fix_grad_dtypes()
            group._widened = group._unsharded_with_grad
        streams.release_after((out, flat), streams.record(), defer_release and work is None)
        group.state = ShardedState.UNSHARDED
        group.managed.swap(group.unsharded_params)

    def _new_unsharded(self, group, i: int, post, unflat: tuple, metadata) -> nn.Parameter:
        shape, stride, rg = group.shapes[i], group.strides[i], group.requires_grad[i]
        if post is None:  # the all-gather output is the parameter's data
            out = self.outputs[i][0]
            return nn.Parameter(alias_storage(out.untyped_storage(), out, 0, shape, stride), rg)
        result = post(unflat, metadata, group.param_dtype)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                f"fsdp_rs: {POST_ALL_GATHER} of parameter {group.managed.fqns[i]} returned "
                f"{type(result).__name__}; called without out=, it must return "
                "(unsharded_tensor, tensors_to_free)"
            )
        tensor, to_free = result
        self.inner[i] = list(to_free)
        return nn.Parameter(torch.as_strided(tensor, shape, stride, 0), rg)

    # --------------------------------------------------------------- reshard

    def reshard(self, group, after_forward: bool) -> None:
        if group._pending_unshard is not None:
            group.wait_for_unshard()
        if group.state != ShardedState.UNSHARDED:
            return
        group._keep_user_flags(after_forward)
        if not group.keep_unsharded_storage:  # set_keep_unsharded_storage(True): kept
            for t in itertools.chain(*self.outputs, *self.inner):
                _free(t)
        group.state = ShardedState.SHARDED
        group.managed.swap(group.sharded_params)

    # ------------------------------------------------------------- gradients

    def plain_grads(self, group, grads: list[torch.Tensor | None]) -> None:
        grads[:] = map(plain_grad, grads)
        accumulated = group._unsynced  # [Note: Unreduced gradients]
        if isinstance(accumulated, Accumulated):
            accumulated.grads = list(map(plain_grad, accumulated.grads))


def become_extension_group(group: FSDPParamGroup) -> None:
    """A plain group whose local shards gained extensions after
    ``fully_shard``: the same object, now gathered by an ``ExtensionGather``;
    the shards stay where they are (views of the old sharded buffer, which
    they keep alive)."""
    if group.nd is not None:
        found = [i for i, p in enumerate(group.sharded_params) if has_extension(p._local_tensor)]
        refuse_on_dtensor(group.managed.fqns[found[0]])
    if group.state != ShardedState.SHARDED or group._pending_unshard is not None:
        group.reshard()
    group.state = ShardedState.SHARDED
    group._post_forward_rows = group._post_forward_event = None
    if group.unsharded_params is not None and group._placed:
        group._free_grad_buffer()
    gather = ExtensionGather()
    group.gather = gather
    group.preplace_grads = False
    group.sharded = _dtype_carrier(group, [p._local_tensor for p in group.sharded_params])
    gather.reset_unsharded(group)


def check_extensions(group: FSDPParamGroup | GroupBundle) -> None:
    """At lazy init: a plain group whose local shards gained all-gather
    extensions since ``fully_shard`` becomes an extension group
    (``become_extension_group``); an extension group's shards must define both
    hooks ([Note: All-gather extensions])."""
    for member in group.groups if isinstance(group, GroupBundle) else (group,):
        if not isinstance(member.gather, ExtensionGather):
            if not member.gained_extension():
                continue
            become_extension_group(member)
        member.gather.check_pairs(member)
