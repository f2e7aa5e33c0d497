"""What a model's forward leaves for backward, measured on a copy that holds
no memory: the input ``predict_memory`` cannot read from the group plans.

``activation_profile`` runs the forward (and, with a ``loss_fn``, the loss and
its backward) of a copy built under ``FakeTensorMode`` or on the ``meta``
device. A ``FakeTensorMode`` copy for the real device is the faithful one: its
ops pick the same kernels as the real run (a ``meta`` copy may choose another
attention, which saves more), and it allocates nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ActivationProfile", "Activations", "activation_profile"]


class Activations(NamedTuple):
    """What one block's forward leaves for backward: ``saved``, the bytes
    autograd saves until the block's backward; ``output``, the bytes of its
    outputs that require grad (the gradient flowing into its backward).
    ``backward``: the most its backward holds at once (its saved bytes, the
    gradient flowing in, its parameters' gradients as autograd makes them, its
    inputs' gradients and the transients between: a GELU's input gradient
    beside its output's); 0 when not measured."""

    saved: int
    output: int
    backward: int = 0


class ActivationProfile(NamedTuple):
    """``blocks``: per block name, its ``Activations``. ``loss``: the most the
    model's outputs, the loss and the backward up to the first block hold at
    once (beyond the blocks' saved activations); 0 without a ``loss_fn``."""

    blocks: dict[str, Activations]
    loss: int


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _needs_grad(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def _grad_bytes(output: Any) -> int:
    return sum(t.nbytes for t in _needs_grad(output))


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create while it is active, as they live: the
    current sum, its peak since ``restart``, and the peak of the open
    ``window`` (one at a time) above the base it was opened with."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._live: set[int] = set()
        self.window: list = []  # [name, base, peak] while open

    def restart(self) -> None:
        self.peak = self.current

    def open(self, name: str, base: int) -> tuple[str, int] | None:
        """Open a window for ``name``; returns the one it closes, if any."""
        closed = self.close()
        self.window = [name, base, self.current]
        return closed

    def close(self) -> tuple[str, int] | None:
        """Close the open window: its name and its peak above its base."""
        if not self.window:
            return None
        name, base, peak = self.window
        self.window = []
        return name, peak - base

    def _free(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = StorageWeakRef(storage).cdata
                if key not in self._live:
                    self._live.add(key)
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    if self.window:
                        self.window[2] = max(self.window[2], self.current)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def _put_back(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def activation_profile(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> ActivationProfile:
    """Run ``module(*args, **kwargs)`` and profile it per block (the modules
    you will call ``fully_shard`` on; keys: their names in ``module``).

    A block's ``saved`` bytes count each storage autograd saves once, for the
    innermost block running when it is first saved (it lives until that
    block's backward, the last to use it); parameters, buffers and inputs do
    not count. With ``loss_fn`` (called on the outputs; a scalar), the loss
    and the backward are run too (with the parameters' ``.grad`` set aside
    and put back after): ``loss`` is the peak from the outputs to the start
    of the first block's backward, and each block's ``backward`` the peak
    from the gradient of its outputs to that of its inputs (or to the next
    block's backward) above what was live before less its ``saved`` and
    ``output`` bytes. What ``module`` itself saves and frees before the first
    block's backward counts in ``loss``, not in its ``saved`` ([Note: The
    outermost module's saved bytes]). Build ``module`` and the inputs under
    ``FakeTensorMode`` (in the compute dtype of a mixed-precision policy) so
    that nothing is allocated."""
    name_of = {id(m): name for name, m in module.named_modules()}
    missing = [type(b).__name__ for b in blocks if id(b) not in name_of]
    if missing:
        raise ValueError(f"blocks must be submodules of module; not: {', '.join(missing)}")
    counted = {_storage_key(t) for t in (*module.parameters(), *module.buffers())}
    counted |= {_storage_key(x) for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)}
    out = {name_of[id(b)]: Activations(0, 0) for b in blocks}
    active: list[str] = []
    live = _LiveBytes()
    loss_peak: list[int | None] = [None]  # the peak when a block's backward began
    # ``module``'s own saved storages (when it is one of the blocks), and how
    # many of their bytes were freed before the first block's backward (see
    # [Note: The outermost module's saved bytes] below)
    root = name_of[id(module)] if id(module) in {id(b) for b in blocks} else None
    root_saved: list[tuple[StorageWeakRef, int]] = []
    freed_early = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in counted and active:
            counted.add(key)
            name = active[-1]
            storage = t.untyped_storage()
            out[name] = out[name]._replace(saved=out[name].saved + storage.nbytes())
            if name == root:  # a weak reference: addresses are reused once freed
                root_saved.append((StorageWeakRef(storage), storage.nbytes()))
        return t

    def record(closed: tuple[str, int] | None) -> None:
        if closed is not None:
            name, peak = closed
            out[name] = out[name]._replace(backward=max(out[name].backward, peak))

    def started(name: str) -> Callable:
        # the gradient of one of the block's outputs: its backward begins
        def hook(grad: torch.Tensor) -> None:
            if loss_peak[0] is None:
                loss_peak[0] = live.peak
                freed_early[0] = sum(n for ref, n in root_saved if ref.expired())
            if live.window[:1] != [name]:
                base = live.current - out[name].saved - out[name].output
                record(live.open(name, base))

        return hook

    def finished(name: str) -> Callable:
        # the gradient of one of the block's inputs: its backward is over
        def hook(grad: torch.Tensor) -> None:
            if live.window[:1] == [name]:
                record(live.close())

        return hook

    def enter(name: str, block: nn.Module) -> Callable:
        def hook(unused: nn.Module, args: Any) -> None:
            active.append(name)
            if loss_fn is not None and block is not module and torch.is_grad_enabled():
                for t in _needs_grad(args):
                    t.register_hook(finished(name))

        return hook

    def leave(block: nn.Module, args: Any, output: Any) -> None:
        name = active.pop()
        out[name] = out[name]._replace(output=out[name].output + _grad_bytes(output))
        if loss_fn is not None and block is not module and torch.is_grad_enabled():
            for t in _needs_grad(output):
                t.register_hook(started(name))

    with contextlib.ExitStack() as stack:
        if loss_fn is not None:
            # the backward as a step after zero_grad() runs it (gradients made,
            # not added to): the parameters' .grad set aside, then put back
            params = list(module.parameters())
            grads = [p.grad for p in params]
            stack.callback(_put_back, params, grads)
            for p in params:
                p.grad = None
        for b in blocks:
            name = name_of[id(b)]
            stack.callback(b.register_forward_pre_hook(enter(name, b)).remove)
            stack.callback(b.register_forward_hook(leave).remove)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
            outputs = module(*args, **kwargs)
        if loss_fn is None:
            return ActivationProfile(out, 0)
        with live:
            live.restart()
            start = live.current
            loss_fn(outputs).backward()
            record(live.close())
            peak = live.peak if loss_peak[0] is None else loss_peak[0]
    # The outputs were live at the start, and count unless a block saved them.
    unsaved = [t for t in _needs_grad(outputs) if _storage_key(t) not in counted]
    loss = peak - start + _grad_bytes(unsaved)
    if freed_early[0]:
        # [Note: The outermost module's saved bytes]
        # What the outermost module saves after its blocks (a head's input, a
        # final norm's) is freed in the loss's backward, before any block's:
        # counted with the loss, which holds it, not as activations held
        # through every block's forward and backward.
        out[root] = out[root]._replace(saved=out[root].saved - freed_early[0])
        loss += freed_early[0]
    return ActivationProfile(out, loss)
