"""``FlatOptimizer``: a torch optimizer stepped over runs of contiguous sharded
parameters instead of per parameter.

[Note: Flat optimizer]
An fsdp-rs group keeps this rank's shards of its parameters back to back in one
buffer (with zero padding between them), and after a reduction their ``.grad``s
are views of one gradient buffer in the same layout ([Note: Whole gradient
buffers]). An elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop,
Adamax, NAdam, RAdam, Adadelta, ASGD) computes each element from the
same element of the parameter, gradient and state and from per-parameter
scalars (the step count, and what follows from it and the hyperparameters), so
stepping a run of consecutive parameters as one flat tensor gives every element
the same bits as stepping each parameter (measured: [Note: Measured facts] in
DESIGN.md; CPU ``fused=True`` Adam and SGD are the exception, they round their
vector body and scalar tail apart). The padding stays zero: a zero parameter
with a zero gradient stays zero under each of them.

A run is a maximal sequence of consecutive parameters of one group that are in
one user parameter group, all got a gradient in the same gradient buffer (or a
run of one, for a gradient the user replaced), and have the same step count: a
parameter without a gradient is skipped as torch skips it (its state and step
count unchanged), which splits the run there, and runs stay split until the
step counts agree again. The math is torch's own: one instance of the user's
optimizer class (the shadow) is stepped with the runs as its parameters and the
user's groups' hyperparameters, so ``foreach``, ``fused``, ``capturable``,
``maximize``, ``amsgrad``, ``weight_decay`` and the rest mean what they mean in
torch, on any torch version.

State: each elementwise state (``exp_avg``, ``momentum_buffer``, ...) lives in
one flat buffer per group in the layout of its gradients, which holds the
trainable parameters only ([Note: Gradient layout]: a LoRA group's states are
the adapters' size, as torch's per-parameter states), made once, when torch
first creates it for a run; a run's state is a slice of it, and ``self.state[p]``
holds a DTensor view of it per parameter, so ``state_dict()`` /
``load_state_dict()`` are torch's per-parameter format and interchange with a
per-parameter optimizer (and, through it, DCP). A run's scalar states (``step``)
are one tensor shared by the run's parameters' ``self.state`` entries;
``state_dict()`` hands out a copy per parameter. Parameters no fsdp-rs group
holds (plain tensors, ignored parameters) are stepped per parameter by the same
shadow.

Cost per step: O(runs) Python while every group's gradients are whole
buffers, as at the last step (the runs are reused as they are), plus the
whole-buffer test: one C-level pass per group over its parameters' ``.grad``
(about 0.25 us a parameter on CPU, half of a 1e4-parameter step; it is what
keeps a replaced ``.grad`` from being stepped as the buffer's). A numpy pass
over a group's parameters when its runs are made again; O(parameters) Python
only in steps where some parameter's gradient is missing or replaced, and
once per parameter when its state is first made.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from fsdp_rs.runtime.group.grad_buffers import (
    ShardedBuffer,
    hold_grads,
    local_tensor,
    park_grads,
    sharded_buffers,
)
from fsdp_rs.runtime.group.params import clear_grads

__all__ = ["ELEMENTWISE", "FlatOptimizer"]

_GRAD = operator.attrgetter("grad")

#: The torch optimizers whose update is elementwise (see [Note: Flat optimizer]).
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)


@dataclass(eq=False)
class _Run:
    buf: _GroupState
    first: int  # parameter indices [first, last] of the group
    last: int
    param: torch.Tensor  # the slice of the sharded buffer
    state: dict = field(default_factory=dict)
    fresh: bool = False  # no state yet: torch makes it at the run's first step

    @property
    def span(self) -> tuple[int, int]:
        """Where the run lies in the sharded buffer."""
        sb = self.buf.sb
        return sb.offsets[self.first], sb.offsets[self.last] + sb.numels[self.last]

    @property
    def grad_span(self) -> tuple[int, int]:
        """Where it lies in the gradient buffer."""
        sb = self.buf.sb
        return sb.grad_offsets[self.first], sb.grad_offsets[self.last] + sb.numels[self.last]

    @property
    def state_span(self) -> tuple[int, int]:
        """Where it lies in the flat states ([Note: Flat state layout])."""
        a, b = self.grad_span
        start = int(self.buf.state_offsets[self.first])
        return start, start + (b - a)


# [Note: Flat state layout]
# A group's elementwise states (``exp_avg``, ...) are flat buffers holding the
# parameters this optimizer steps, not the whole group: with Muon for the
# matrices and AdamW for the rest (or any split of a model's parameters between
# optimizers), a buffer over every trainable parameter would keep AdamW state
# for the matrices too, more memory than the per-parameter optimizer. Each run
# of consecutive held parameters (a run never crosses one the optimizer does not
# hold, nor a frozen one) keeps the gradient layout's gaps, so a run's states
# are one slice of the length of its gradient slice; blocks start 16-element
# aligned. When the held or trainable set changes, the states move to the new
# layout.
_STATE_ALIGN = 16


# [Note: Gradient scaling]
# ``torch.amp.GradScaler.step`` hands an optimizer whose step supports amp
# scaling (a ``fused=True`` one; ``_step_supports_amp_scaling``, copied from the
# shadow) its scale and its found-inf flag as attributes, ``grad_scale`` and
# ``found_inf``, and calls ``step()`` without checking for infs itself: torch's
# fused step unscales the gradients and, where an inf was found, leaves the
# parameters and states as they were (its step counts put back). The shadow
# steps, so it gets those attributes for the step. A skipped step must not
# count in the runs' step counts either, or runs of parameters whose torch step
# counts differ would be merged later: that costs one host read of the flag per
# such step (GradScaler's unfused path reads it too).
_AMP_SCALING = ("grad_scale", "found_inf")


def _entry(run: _Run) -> tuple[int, torch.Tensor, dict]:
    """(user group, tensor, state) of ``run`` for the shadow's step."""
    return int(run.buf.user_group[run.first]), run.param, run.state


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class _GroupState:
    """An optimizer's view of one fsdp-rs group: step counts, flat states, runs."""

    def __init__(self, sb: ShardedBuffer) -> None:
        self.sb = sb
        n = len(sb.params)
        self.counts = np.zeros(n, dtype=np.int64)  # steps taken, per parameter
        self.user_group = np.full(n, -1, dtype=np.int64)  # -1: not in this optimizer
        self.flat: dict[str, torch.Tensor] = {}  # elementwise state buffers
        self.runs: list[_Run] = []
        self.signature: bytes | None = None  # of the runs' boundaries
        # the runs were made from whole gradient buffers at the last step: while
        # they stay whole, every run parameter steps, so the boundaries hold
        self.whole_runs = False
        # in the gradient layout: has a gradient when the buffer is whole
        self.trainable = np.fromiter((o >= 0 for o in sb.grad_offsets), dtype=bool, count=n)
        self.state_offsets = np.full(n, -1, dtype=np.int64)  # plan_states()
        self.state_numel = 0

    def plan_states(self) -> None:
        """Where each of this optimizer's parameters keeps its states in the flat
        buffers ([Note: Flat state layout]); -1 for one it does not step."""
        sb = self.sb
        grad_offsets = np.asarray(sb.grad_offsets, dtype=np.int64)
        numels = np.asarray(sb.numels, dtype=np.int64)
        held = (grad_offsets >= 0) & (self.user_group >= 0)
        offsets = np.full(len(held), -1, dtype=np.int64)
        end = 0
        if held.any():  # blocks of consecutive held parameters, one numpy pass
            prev = np.concatenate(([False], held[:-1]))
            nxt = np.concatenate((held[1:], [False]))
            starts = np.flatnonzero(held & ~prev)
            ends = np.flatnonzero(held & ~nxt)
            lengths = grad_offsets[ends] + numels[ends] - grad_offsets[starts]
            aligned = -(-lengths // _STATE_ALIGN) * _STATE_ALIGN
            bases = np.concatenate(([0], np.cumsum(aligned)[:-1]))
            block = np.cumsum(held & ~prev) - 1  # the block each held parameter is in
            index = np.flatnonzero(held)
            b = block[index]
            offsets[index] = bases[b] + grad_offsets[index] - grad_offsets[starts[b]]
            end = int(bases[-1] + lengths[-1])
        self.state_offsets, self.state_numel = offsets, end

    def flat_buffer(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The flat buffer of state ``key`` (zeros in the state layout, made once)."""
        flat = self.flat.get(key)
        if flat is None:
            flat = torch.zeros(self.state_numel, dtype=dtype, device=self.sb.sharded.device)
            self.flat[key] = flat
        return flat


class FlatOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (an elementwise ``torch.optim`` optimizer) over the flat
    shards of fsdp-rs groups, in runs of contiguous parameters ([Note: Flat
    optimizer]); bit for bit the same updates as ``optimizer_class(params,
    **kwargs)`` stepping the sharded parameters one by one.

    ``FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)``; ``params``
    may be parameter groups (dicts), as for any torch optimizer. It is a
    ``torch.optim.Optimizer``: ``param_groups`` (edits, LR schedulers),
    ``zero_grad``, ``add_param_group``, step hooks, ``state_dict`` /
    ``load_state_dict`` in torch's per-parameter format."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"FlatOptimizer: optimizer_class must be a torch.optim.Optimizer class "
                f"(e.g. torch.optim.AdamW), got {optimizer_class!r}"
            )
        if optimizer_class not in ELEMENTWISE:
            name = optimizer_class.__name__
            raise TypeError(
                f"FlatOptimizer: {name} is not one of the elementwise optimizers it can "
                f"step over flat shards ({', '.join(c.__name__ for c in ELEMENTWISE)}); "
                f"{name} needs each parameter's whole tensor, so use it per parameter: "
                f"{name}(model.parameters(), ...)"
            )
        # torch validates the hyperparameters and fills the groups' defaults
        shadow = optimizer_class(params, **kwargs)
        self._shadow = shadow
        self._groups: dict[int, _GroupState] = {}
        self._layout_key: tuple | None = None
        super().__init__([dict(g) for g in shadow.param_groups], dict(shadow.defaults))
        if hasattr(shadow, "_step_supports_amp_scaling"):  # GradScaler reads it (fused)
            self._step_supports_amp_scaling = shadow._step_supports_amp_scaling
        if shadow.state:  # made at construction (Adagrad): into the flat buffers
            for p, st in shadow.state.items():
                self.state[p] = st
            shadow.state = defaultdict(dict)
            self._import_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        shadow = self.__dict__.get("_shadow")
        if shadow is not None:
            # the class's own upgrades (group defaults added since, ``step`` as a
            # tensor), made by the shadow on our groups and states in place
            shadow.__setstate__({"state": self.state, "param_groups": self.param_groups})
            shadow.state, shadow.param_groups = defaultdict(dict), []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._layout_key = None

    # ------------------------------------------------------------------ layout

    def _layout(self) -> tuple[list[_GroupState], list[list[torch.Tensor]]]:
        """The groups' states (refreshed when the param groups changed or a group
        moved its buffer) and, per user group, the parameters no group holds."""
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if key == self._layout_key and all(gs.sb.current() for gs in self._groups.values()):
            return list(self._groups.values()), self._others
        found, _ = sharded_buffers([p for g in self.param_groups for p in g["params"]])
        groups: dict[int, _GroupState] = {}
        relaid: list[_GroupState] = []
        olds = []
        for sb in found:
            old = next((gs for gs in self._groups.values() if _same(gs.sb.params, sb.params)), None)
            gs = _GroupState(sb)
            olds.append((gs, old))
            groups[id(sb.sharded)] = gs
        # Frozen parameters have no place in the gradient layout: a .grad set on one
        # is stepped per parameter, as torch steps it.
        index = {
            id(p): (gs, i)
            for gs in groups.values()
            for i, p in enumerate(gs.sb.params)
            if gs.sb.grad_offsets[i] >= 0
        }
        others: list[list[torch.Tensor]] = []
        for ug, group in enumerate(self.param_groups):
            mine = []
            for p in group["params"]:
                hit = index.get(id(p))
                if hit is None:
                    mine.append(p)
                else:
                    hit[0].user_group[hit[1]] = ug
            others.append(mine)
        for gs, old in olds:
            gs.plan_states()
            if old is None:
                continue
            if np.array_equal(old.state_offsets, gs.state_offsets):
                gs.counts, gs.flat = old.counts, old.flat  # a moved buffer, or new groups
            else:  # another trainable or held set: the states move to the new layout
                relaid.append((gs, old))
        self._groups, self._others, self._layout_key = groups, others, key
        for gs, old in relaid:
            self._import_group(gs, old.counts)
        return list(groups.values()), others

    # ------------------------------------------------------------------ runs

    def _runs(self, gs: _GroupState) -> list[_Run]:
        """This step's runs of ``gs`` (reused while their boundaries hold), with
        each run parameter's ``.grad`` set."""
        sb = gs.sb
        whole = sb.whole_grad_buffer()
        if whole is not None and gs.whole_runs:  # the steady state: O(runs)
            for run in gs.runs:
                a, b = run.grad_span
                run.param.grad = whole[a:b]
            return gs.runs
        gs.whole_runs = whole is not None
        if whole is not None:  # every trainable parameter has a gradient in it
            # (a parameter frozen since the backward still has its .grad, which
            # torch steps: the layout's trainable set, not requires_grad, decides)
            has = gs.trainable
            sources = np.zeros(len(sb.params), dtype=np.int64)
            grad_of = None
        else:
            has, sources, grad_of = self._grad_sources(sb)
        included = has & (gs.user_group >= 0)
        n = len(included)
        new = np.ones(n, dtype=bool)
        if n > 1:
            same = (
                included[:-1]
                & (gs.user_group[1:] == gs.user_group[:-1])
                & (sources[1:] == sources[:-1])
                & (gs.counts[1:] == gs.counts[:-1])
            )
            new[1:] = ~same
        starts = np.flatnonzero(included & new)
        ends = np.empty_like(starts)
        if len(starts):
            # a run ends before the next start or the next excluded parameter
            stops = np.flatnonzero(~included | new)
            pos = np.searchsorted(stops, starts, side="right")
            nxt = np.where(pos < len(stops), stops[np.minimum(pos, len(stops) - 1)], n)
            ends = nxt - 1
        signature = starts.tobytes() + ends.tobytes() + sources.tobytes()
        if signature != gs.signature:
            gs.runs = [self._new_run(gs, int(a), int(b)) for a, b in zip(starts, ends, strict=True)]
            gs.signature = signature
        for run in gs.runs:
            a, b = run.grad_span
            if whole is not None:
                run.param.grad = whole[a:b]
            else:
                run.param.grad = grad_of(run)
        return gs.runs

    def _grad_sources(self, sb: ShardedBuffer):
        """Per parameter: has a gradient, and which buffer it is a view of at its
        own offset (0 for none: a run of its own). O(parameters) Python."""
        grads = list(map(_GRAD, sb.params))
        n = len(grads)
        has = np.zeros(n, dtype=bool)
        sources = np.zeros(n, dtype=np.int64)
        bases: dict[int, torch.Tensor] = {}
        for i, g in enumerate(grads):
            if g is None:
                continue
            has[i] = True
            local = local_tensor(g)
            base = local._base
            if (
                base is not None
                and base.dim() == 1
                and base.numel() == sb.grad_numel
                and base.dtype == sb.sharded.dtype
                and local.is_contiguous()
                and local.storage_offset() - base.storage_offset() == sb.grad_offsets[i]
            ):
                sources[i] = id(base)
                bases[id(base)] = base
            else:
                sources[i] = -(i + 1)  # alone

        def grad_of(run: _Run) -> torch.Tensor:
            a, b = run.grad_span
            src = sources[run.first]
            if src > 0:
                return bases[int(src)][a:b]
            return local_tensor(grads[run.first]).reshape(-1).to(sb.sharded.dtype)

        return has, sources, grad_of

    def _new_run(self, gs: _GroupState, first: int, last: int) -> _Run:
        sb = gs.sb
        run = _Run(gs, first, last, None)
        a, b = run.span
        run.param = sb.sharded[a:b]
        a, b = run.state_span
        members = sb.params[first : last + 1]
        head = self.state.get(members[0])
        if not head:  # torch makes the state at this step; _adopt_state moves it
            run.fresh = True
            return run
        for k, v in head.items():
            if k in gs.flat:
                run.state[k] = gs.flat[k][a:b]
            else:  # a scalar state, equal across the run (same step count)
                run.state[k] = v.clone() if torch.is_tensor(v) else v
        scalars = [(k, v) for k, v in run.state.items() if k not in gs.flat]
        for p in members:
            st = self.state[p]
            for k, v in scalars:
                st[k] = v
        return run

    def _adopt_state(self, run: _Run) -> None:
        """After a run's first step: its elementwise states move into the group's
        flat buffers, and each parameter's ``self.state`` gets views of them."""
        gs, sb = run.buf, run.buf.sb
        a, b = run.state_span
        for k, v in list(run.state.items()):
            if torch.is_tensor(v) and v.dim() == 1 and v.shape == run.param.shape:
                flat = gs.flat_buffer(k, v.dtype)
                flat[a:b].copy_(v)
                run.state[k] = flat[a:b]
        run.fresh = False
        if not run.state:  # a stateless update (SGD without momentum): none, as torch
            return
        for i in range(run.first, run.last + 1):
            self.state[sb.params[i]] = self._param_state(gs, i, run.state)

    def _param_state(self, gs: _GroupState, i: int, run_state: dict) -> dict:
        p = gs.sb.params[i]
        local = p._local_tensor
        st = {}
        for k, v in run_state.items():
            if k in gs.flat:
                off = int(gs.state_offsets[i])
                view = gs.flat[k].as_strided(local.shape, local.stride(), off)
                st[k] = DTensor.from_local(
                    view,
                    p.device_mesh,
                    p.placements,
                    shape=p.shape,
                    stride=p.stride(),
                    run_check=False,
                )
            else:
                st[k] = v
        return st

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, others = self._layout()
        stepped = [run for gs in groups for run in self._runs(gs)]
        try:
            # runs with state and the parameters no group holds: one call
            entries = [_entry(run) for run in stepped if not run.fresh]
            # (torch steps a parameter with a gradient only; none, no state entry)
            entries += [
                (ug, p, self.state[p])
                for ug, mine in enumerate(others)
                for p in mine
                if p.grad is not None
            ]
            self._shadow_step(entries)
            # [Note: Flat optimizer] runs whose state torch makes now: one call each,
            # moved into the flat buffers at once, so the step holds one run's
            # fresh state at a time on top of the flat buffers
            for run in [run for run in stepped if run.fresh]:
                self._shadow_step([_entry(run)])
                self._adopt_state(run)
        finally:
            for run in stepped:  # the gradient buffers are the runtime's to free
                run.param.grad = None
        if not self._skipped():
            for run in stepped:
                run.buf.counts[run.first : run.last + 1] += 1
        return loss

    def _skipped(self) -> bool:
        """Whether torch's step just skipped every parameter ([Note: Gradient
        scaling]): one host read of ``found_inf``, in the steps that have one."""
        found_inf = getattr(self, "found_inf", None)
        return found_inf is not None and bool(found_inf.item())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; ``set_to_none=True`` (the default) as one C-level
        pass per parameter group instead of a Python step per parameter."""
        if not set_to_none:
            return super().zero_grad(set_to_none=False)
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            # [Note: Parked gradient buffers] in ``runtime/group/grad_buffers.py``
            live = [gs.sb._group() for gs in self._groups.values() if gs.sb.current()]
            held = hold_grads(live)
            try:
                for group in self.param_groups:
                    clear_grads(group["params"])
            finally:
                park_grads(held)
        return None

    def _shadow_step(self, entries: list[tuple[int, torch.Tensor, dict]]) -> None:
        """torch's step of the user's optimizer class over ``entries`` (user group,
        tensor, its state), with the user groups' hyperparameters."""
        if not entries:
            return
        per_user: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        state: defaultdict = defaultdict(dict)
        for ug, tensor, st in entries:
            per_user[ug].append(tensor)
            state[tensor] = st
        shadow = self._shadow
        shadow.param_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": params}
            for g, params in zip(self.param_groups, per_user, strict=True)
        ]
        shadow.state = state
        # [Note: Gradient scaling] what GradScaler set on this optimizer, for the
        # shadow's fused step to read
        scaling = [k for k in _AMP_SCALING if hasattr(self, k)]
        for k in scaling:
            setattr(shadow, k, getattr(self, k))
        try:
            shadow.step()
        finally:
            shadow.state = defaultdict(dict)
            shadow.param_groups = []
            for k in scaling:
                delattr(shadow, k)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # a run's shared scalars: one copy each (new dicts: torch's are self.state's)
        sd["state"] = {
            idx: {k: v.clone() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in st.items()}
            for idx, st in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._import_state()

    def _import_state(self) -> None:
        """Move per-parameter states (loaded, or made by an optimizer's
        constructor, as Adagrad's) into the groups' flat buffers."""
        self._layout_key = None
        groups, _ = self._layout()
        for gs in groups:
            self._import_group(gs)

    def _import_group(self, gs: _GroupState, counts: np.ndarray | None = None) -> None:
        """``_import_state`` for one group: also when its gradient layout changed
        (another set of trainable parameters; ``counts``: the step counts kept
        before); a frozen parameter keeps its state as it is.

        Runs merge parameters of equal counts, and a run whose first parameter
        has no state is stepped as torch's first step (its states made afresh),
        so a parameter with state must never count 0: SGD keeps no ``step``, and
        its momentum would be made again from the gradient for the whole run."""
        gs.runs, gs.signature, gs.whole_runs = [], None, False
        gs.counts[:] = 0
        sb = gs.sb
        for i, p in enumerate(sb.params):
            st = self.state.get(p)
            off = int(gs.state_offsets[i])
            if not st or off < 0:
                continue
            step = st.get("step")
            if step is not None:
                gs.counts[i] = int(step.item() if torch.is_tensor(step) else step)
            else:  # no step count in torch's state: at least one, as it has one
                gs.counts[i] = max(1, 0 if counts is None else int(counts[i]))
            n = sb.numels[i]
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    local = local_tensor(v)
                    gs.flat_buffer(k, local.dtype)[off : off + n].copy_(local.reshape(-1))
            self.state[p] = self._param_state(gs, i, st)
