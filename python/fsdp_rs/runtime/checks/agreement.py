"""Which parameters got a gradient on some rank: one flag all-reduce per
backward ([Note: Gradient agreement] in gradients.py); and, before a
backward's first reduce-scatter, whether every rank trains the same parameters
([Note: One trainable set on every rank]).

[Note: One trainable set on every rank]
A group reduces the gradients of the parameters that require grad, laid out
for that set ([Note: Gradient layout]); which ones do is read on each rank
from its own parameters. A rank that froze other parameters than the others
(``requires_grad`` set from something rank-local, such as its own loss) would
lay out its reduce-scatter input otherwise: one parameter's gradient summed
into another's rows where the sizes happen to match, and a collective of
another size (gloo aborts the process, NCCL hangs or reads past the input)
where they do not. So before its first reduce-scatter over a mesh in a
backward, every rank all-reduces (MAX) a digest of the trainable sets of all
the root's groups that reduce over that mesh, and its negation ([Note:
Agreement by extremes]): one small collective per mesh per synced backward,
read at once (on an accelerator the
host waits for it and for what that process group ran before it; the
reduce-scatter stream it runs on holds nothing of this backward yet).
Where the ranks differ, every rank sees it in the same result, gathers the
sets (one more collective, only then) and raises the error, naming the first
parameter that differs with each rank's value, before any rank reduces. Off
where the plan check is ([Note: Cross-rank plan check]:
``FSDP_RS_CHECK_PLANS=0``, torch's fake process group). Not caught: a rank
that froze every parameter of every group reducing over a mesh never
reaches the check there (its backward has nothing to reduce), and under
traced hooks a change after ``set_fullgraph_compile()`` on some ranks only
sends those ranks to the eager hooks, whose collectives then differ from the
others' ([Note: One decision for all ranks] compares the sets when it is
called).

[Note: Agreement by extremes]
Whether every rank holds the same values (a digest, a mask) is asked with one
all-reduce (MAX) of the values followed by their negation: the first half
comes back as the values' maximum over the ranks, the second as minus their
minimum, and the ranks agree exactly where the two halves are equal
(``high == -low``). One collective of a few bytes, the same on every rank
whatever it holds, and a result every rank reads alike, so that every rank
takes the same branch (go on, or raise). Over several process groups (HSDP)
the result is all-reduced over each in turn. Two checks ask it: the
trainable sets here (``GradientAgreement.check_trainable``: a buffer made
once and filled in place, so that nothing is allocated on the reduce-scatter
stream, read on the host), and the traced backward's used-mask
(``ops/traced.py``, [Note: Unused parameters under trace]: functional
collectives, compared by ``torch._assert_async`` in the graph, as a traced
backward cannot read a value on the host). The eager gradient agreement
([Note: Gradient agreement] in gradients.py) asks another question, which
parameters got a gradient on any rank (MAX of the flags alone), and a rank
that had none for such a parameter reads the flags on the host and assigns its
``.grad`` then; the traced backward cannot (which of its gradients are missing
is fixed when its graph is traced, and it reads nothing on the host), so it
asks whether the ranks' masks agree and raises where they do not.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from fsdp_rs.runtime.checks.plan_check import enabled as plan_checks_enabled
from fsdp_rs.runtime.checks.plan_check import mesh_dims, param_fqn
from fsdp_rs.runtime.comm.streams import CommStreams
from fsdp_rs.runtime.step.observe import rare

__all__ = ["GradientAgreement", "first_difference", "trained_digest"]


def trained_digest(requires_grad: list[bool]) -> int:
    """A digest of a group's trainable set ([Note: One trainable set on every
    rank]): the same on every rank for the same set."""
    return zlib.crc32(bytes(requires_grad))


def _key(group: Any) -> tuple[Any, Any]:
    """The process groups ``group`` reduces over (None: no other rank there)."""
    info = group.info
    return (
        info.shard_group if info.shard_size > 1 else None,
        info.replicate_group if info.replicate_size > 1 else None,
    )


class GradientAgreement:
    """One per root. Groups note their local had-gradient mask when their
    reduction is assigned; ``resolve`` at the end of backward agrees on them.

    The flags of one mesh are the masks of its groups in the order they were
    noted, which is the reduce-scatter order, the same on every rank ([Note:
    Backward order]); so the all-reduce has the same size and meaning on all."""

    def __init__(self, streams: CommStreams) -> None:
        self.streams = streams
        # (shard group, replicate group) -> [(group, had, post-reduce stream)]
        self._noted: dict[tuple[Any, Any], list[tuple[Any, list[bool], Any]]] = {}
        # [Note: One trainable set on every rank] the root's groups by the
        # process groups they reduce over, and those checked in this backward
        self._groups: dict[tuple[Any, Any], list[Any]] = {}
        self._checked: set[tuple[Any, Any]] = set()
        self._names: dict[int, list[str]] = {}
        # each mesh's check buffer: made once, at lazy init, and written only on
        # the reduce-scatter stream, so no block freed by another stream is
        # reused there before that stream waited ([Note: Cross-stream lifetimes])
        self._buffers: dict[tuple[Any, Any], torch.Tensor] = {}

    def register(self, groups: list[tuple[Any, list[str]]]) -> None:
        """The root's groups (in module order, the same on every rank), each with
        the names of its modules under the root (for the error). With
        ``FSDP_RS_CHECK_PLANS=0``, on torch's fake process group and on one rank,
        none is checked, as the plans are not ([Note: Cross-rank plan check])."""
        if not plan_checks_enabled():
            return
        for group, names in groups:
            key = _key(group)
            if mesh_dims(group.info):
                self._groups.setdefault(key, []).append(group)
                self._names[id(group)] = names
                if key not in self._buffers:  # [Note: Made outside inference mode]
                    with torch.inference_mode(False):
                        buffer = torch.zeros(2, dtype=torch.int64, device=group.device)
                    self._buffers[key] = buffer
        if self._buffers and self.streams.enabled:  # after the zeros, once
            self.streams.reduce_scatter.wait_stream(self.streams.current())

    def check_trainable(self, group: Any) -> None:
        """Before ``group``'s reduce-scatter: at the first over its process
        groups in this backward, every rank trains the same parameters of
        every group reducing there, or every rank raises ([Note: One trainable
        set on every rank])."""
        key = _key(group)
        if key in self._checked or key not in self._groups:
            return
        self._checked.add(key)
        groups = self._groups[key]
        digest = zlib.crc32(b"".join(g.trained_digest.to_bytes(4, "little") for g in groups))
        extremes = self._buffers[key]
        with self.streams.on(self.streams.reduce_scatter if self.streams.enabled else None):
            extremes[0].fill_(digest)  # in place: nothing allocated on this stream
            extremes[1].fill_(-digest)
            for pg in key:
                if pg is not None:
                    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=pg)
            high, low = extremes.tolist()
        if high != -low:
            raise _differing_sets(groups, key, self._names)

    def note(self, group: Any, had_grad: list[bool], stream: Any) -> None:
        self._noted.setdefault(_key(group), []).append((group, had_grad, stream))

    def discard(self) -> None:
        """Forget the reductions noted in a backward that did not finish."""
        self._noted = {}
        self._checked = set()

    def resolve(self) -> None:
        """The all-reduces (every rank, every mesh that reduced), then the
        missing ``.grad``s where this rank lacked some gradient."""
        with rare("fsdp_rs::gradient_agreement"):  # [Note: Labels and logs]
            self._resolve()

    def _resolve(self) -> None:
        noted, self._noted = self._noted, {}
        self._checked = set()
        for (shard_group, replicate_group), entries in noted.items():
            missing = [not all(had) for _, had, _ in entries]
            if shard_group is None and replicate_group is None:
                for group, _, _ in entries:
                    group.grad_assign.unagreed = None  # no other rank: local is agreed
                continue
            flags = torch.ones(sum(len(had) for _, had, _ in entries), dtype=torch.uint8)
            if any(missing):
                offset = 0
                for (_, had, _), m in zip(entries, missing, strict=True):
                    if m:
                        flags[offset : offset + len(had)] = torch.tensor(had, dtype=torch.uint8)
                    offset += len(had)
            flags = flags.to(entries[0][0].device)
            for pg in (shard_group, replicate_group):
                if pg is not None:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
            if not any(missing):
                continue  # had every gradient: knows the answer, reads nothing
            agreed = flags.bool().tolist()
            offset = 0
            for (group, had, stream), m in zip(entries, missing, strict=True):
                n = len(had)
                if m:
                    with self.streams.on(stream):
                        group.grad_assign.assign_agreed(group, had, agreed[offset : offset + n])
                        self.streams.note_post_reduce(stream, self.streams.record(stream))
                offset += n


def _differing_sets(
    groups: list[Any], key: tuple[Any, Any], names: dict[int, list[str]]
) -> RuntimeError:
    """The error every rank raises where the trainable sets differ: the sets
    gathered over ``key``'s process groups (all ranks are here), the first
    parameter whose ``requires_grad`` differs named with each rank's value."""
    mine = [list(g.requires_grad) for g in groups]
    named = "(not found: the ranks' digests differ)"
    for pg in key:
        if pg is None:
            continue
        everyone: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(everyone, mine, group=pg)
        ranks = dist.get_process_group_ranks(pg)
        found = first_difference(groups, everyone, ranks, names)
        if found is not None:
            named = found
            break
    return RuntimeError(
        "fsdp_rs: the ranks train different parameters (requires_grad differs between "
        f"them): {named}. Each group's gradients are reduced in a layout made for the "
        "parameters that require grad, so the ranks' reductions would not match (one "
        "parameter's gradient summed into another's). Set requires_grad the same way on "
        "every rank (a decision from a rank's own values, such as its loss, must be agreed "
        "first, e.g. by all-reducing them)"
    )


def first_difference(
    groups: list[Any], everyone: list[Any], ranks: list[int], names: dict[int, list[str]]
) -> str | None:
    """The first parameter of ``groups`` whose ``requires_grad`` differs in
    ``everyone`` (per rank of ``ranks``, its masks of ``groups``), named under
    the root (``names``: each group's module names) with each rank's value;
    None where they agree."""
    for i, group in enumerate(groups):
        for j, fqn in enumerate(group.managed.fqns):
            fqn = param_fqn(names[id(group)], fqn)
            values = [sets[i][j] for sets in everyone]
            if len(set(values)) > 1:
                per = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, values, strict=True))
                return f"requires_grad of {fqn} is {per}"
    return None
