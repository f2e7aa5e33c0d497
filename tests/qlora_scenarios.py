"""QLoRA ([Note: Sharded and gathered as FSDP2] in runtime/variants/extensions.py):
frozen quantized base weights with trainable LoRA adapters, each block
``fully_shard``ed, trained with fsdp-rs and with torch FSDP2 side by side in
one spawned gloo process.

The base weights are ``Blockwise`` (below), a test-local subclass with the
contract of torchao's ``NF4Tensor``: it implements only the operations FSDP2
runs on a parameter's local tensor (``torch.chunk``, ``new_zeros``,
``narrow`` + ``copy_``, ``view(-1)``, ``as_strided``, ``detach``) and refuses
``aten.slice``; its ``fsdp_pre_all_gather`` returns flat 1-D inner tensors of
three dtypes, none of them in the parameter's rows (``PaddedBlockwise``: padded
to the chunk's rows on an uneven shard). ``nf4`` scenarios use torchao's own
``to_nf4`` where torchao is importable. Each returns, per library, the losses,
every local shard (each inner tensor of a quantized one) and sharded gradient,
the base weights' local type and the ``param_dtype`` the post-all-gather got."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from scenario_common import DIM, HIDDEN, LIBS, _inputs, _mesh
from spawned import run_named

STEPS = 3
RANK = 8  # the adapters' rank: shards of whole 16-byte units ([Note: Gloo sums by buffer size])
_INNER = ("codes", "scales", "offsets")


class Blockwise(torch.Tensor):
    """A 2-D weight quantized to 4 bits per element in blocks of ``block``
    elements of a row: ``codes`` (two per byte, uint8), a bf16 ``scale`` and an
    fp32 ``offset`` per block, all flat. Like ``NF4Tensor``, it supports only
    what FSDP2 does to a parameter (chunk by rows, zeros of a padded shape,
    narrow from row 0 and copy into it, flat views) and raises
    ``NotImplementedError`` on any other op, slicing included; its
    pre-all-gather is NF4's one-argument one."""

    seen: ClassVar[list] = []  # the param_dtype each post-all-gather got

    @staticmethod
    def __new__(cls, codes, scales, offsets, shape, block, row=None, full=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=offsets.dtype, device=codes.device
        )

    def __init__(self, codes, scales, offsets, shape, block, row=None, full=None) -> None:
        self.codes, self.scales, self.offsets = codes, scales, offsets
        self.block = block
        self.row = shape[-1] if row is None else row  # elements per row
        self.full = shape[0] if full is None else full  # the whole weight's rows

    @classmethod
    def quantize(cls, w: torch.Tensor, block: int) -> Blockwise:
        assert w.dim() == 2 and w.size(1) % block == 0 and block % 2 == 0, w.shape
        blocks = w.detach().reshape(-1, block)
        lo, hi = blocks.amin(1), blocks.amax(1)
        scales = ((hi - lo) / 15).to(torch.bfloat16)
        q = ((blocks - lo[:, None]) / scales.float()[:, None].clamp_min(1e-12)).round()
        q = q.clamp(0, 15).to(torch.uint8).reshape(-1, 2)
        codes = (q[:, 0] | (q[:, 1] << 4)).contiguous()
        return cls(codes, scales, lo.contiguous(), w.shape, block)

    def _with(self, codes, scales, offsets, shape) -> Blockwise:
        meta = (self.block, self.row, self.full)
        return type(self)(codes, scales, offsets, torch.Size(shape), *meta)

    def _rows(self, rows: int) -> tuple[int, int]:
        """(codes, blocks) of ``rows`` rows."""
        return rows * self.row // 2, rows * self.row // self.block

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        q = torch.stack([self.codes & 15, self.codes >> 4], 1).reshape(-1, self.block).float()
        w = self.offsets[:, None] + q * self.scales.float()[:, None]
        return w.reshape(self.shape).to(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, block={self.block})"

    def __tensor_flatten__(self):
        return list(_INNER), (self.shape, self.block, self.row, self.full)

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(*(inner[k] for k in _INNER), *meta)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:  # dequantized to the input's dtype; the weight is frozen
            x, w, *rest = args
            return F.linear(x, w.dequantize(x.dtype), *rest, **kwargs)
        if func is torch.Tensor.narrow:  # as NF4: before it becomes aten.slice
            return _narrow(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        op = _OPS.get(func)
        if op is None:
            raise NotImplementedError(f"{cls.__name__}: {func} is not supported")
        return op(*args, **(kwargs or {}))

    def fsdp_pre_all_gather(self, mesh):
        return (self.codes, self.scales, self.offsets), self.shape[1:]

    @torch.no_grad()
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        Blockwise.seen.append(str(param_dtype))
        codes, scales, offsets = outputs
        assert codes.dim() == scales.dim() == offsets.dim() == 1, [o.shape for o in outputs]
        if out is not None:  # the outputs are out's own inner tensors, refilled in place
            assert out.codes.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
            return None
        shape = (codes.numel() * 2 // metadata[0], *metadata)
        return self._with(codes, scales, offsets, shape), (codes, scales, offsets)


class PaddedBlockwise(Blockwise):
    """The same, its pre-all-gather padding an uneven shard's flat inner
    tensors to the chunk's rows (from the whole weight's rows, which it keeps:
    FSDP2's five-argument pre-all-gather must return inputs of the padded
    shard's shape there, so flat ones come from the one-argument pre)."""

    def fsdp_pre_all_gather(self, mesh):
        codes, blocks = self._rows(math.ceil(self.full / mesh.size()))
        padded = []
        inner = (self.codes, self.scales, self.offsets)
        for t, n in zip(inner, (codes, blocks, blocks), strict=True):
            p = t.new_zeros(n)
            p.narrow(0, 0, t.numel()).copy_(t)
            padded.append(p)
        return tuple(padded), self.shape[1:]


def _narrow(t: Blockwise, dim: int, start: int, length: int) -> Blockwise:
    if dim != 0 or start != 0:
        raise NotImplementedError(f"{type(t).__name__}.narrow(dim={dim}, start={start})")
    codes, blocks = t._rows(length)
    return t._with(
        t.codes.narrow(0, 0, codes),
        t.scales.narrow(0, 0, blocks),
        t.offsets.narrow(0, 0, blocks),
        (length, t.row),
    )


def _split(t: Blockwise, size: int, dim: int = 0) -> list[Blockwise]:
    if dim != 0:
        raise NotImplementedError(f"{type(t).__name__}: split on dim {dim}")
    codes, blocks = t._rows(size)
    parts = zip(t.codes.split(codes), t.scales.split(blocks), t.offsets.split(blocks), strict=True)
    return [t._with(c, s, o, (c.numel() * 2 // t.row, t.row)) for c, s, o in parts]


def _new_zeros(t: Blockwise, size, **kwargs) -> Blockwise:
    """Zeros of ``size`` rows (FSDP2's padded shard), or FSDP2's empty chunk
    (``new_empty(0)``) for a rank past the last."""
    rows = size[0] if len(size) == 2 else 0
    assert len(size) == 1 or size[1] == t.row, (size, t.row)
    n = rows * t.row
    return t._with(
        t.codes.new_zeros(n // 2),
        t.scales.new_zeros(n // t.block),
        t.offsets.new_zeros(n // t.block),
        (rows, t.row),
    )


def _copy(dst: Blockwise, src: Blockwise, non_blocking: bool = False) -> Blockwise:
    assert isinstance(src, Blockwise) and src.shape == dst.shape, (src, dst)
    for k in _INNER:
        getattr(dst, k).copy_(getattr(src, k))
    return dst


def _view(t: Blockwise, size) -> Blockwise:
    if list(size) != [-1]:
        raise NotImplementedError(f"{type(t).__name__}.view({size})")
    return t._with(t.codes, t.scales, t.offsets, (t.numel(),))


def _as_strided(t: Blockwise, size, stride, offset=0) -> Blockwise:
    """The unsharded parameter: its first rows, contiguous (FSDP2 unpads so)."""
    if offset or len(size) != 2 or size[1] != t.row or size[0] * t.row > t.numel():
        raise NotImplementedError(f"{type(t).__name__}.as_strided({size}, {stride}, {offset})")
    return _narrow(t, 0, 0, size[0])


def _detach(t: Blockwise) -> Blockwise:
    return t._with(*(getattr(t, k).detach() for k in _INNER), t.shape)


def _slice(t, dim=0, start=None, end=None, step=1):
    name = type(t).__name__
    raise NotImplementedError(f"{name}: aten.slice(dim={dim}, start={start}, end={end})")


aten = torch.ops.aten
_OPS: dict = {
    aten.split.Tensor: _split,
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_zeros,  # FSDP2's empty chunk for a rank past the last
    aten.copy_.default: _copy,
    aten.view.default: _view,
    aten.as_strided.default: _as_strided,
    aten.detach.default: _detach,
    aten.slice.Tensor: _slice,
}


# ------------------------------------------------------------------ models


class LoraLinear(nn.Module):
    """A frozen (quantized) base weight plus trainable adapters ``b @ a``."""

    def __init__(self, in_features: int, out_features: int, quantize: Callable) -> None:
        super().__init__()
        base = nn.Linear(in_features, out_features, bias=False)
        self.weight = nn.Parameter(quantize(base.weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(in_features, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, out_features, bias=False)  # not zero: both get grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self, hidden: int, quantize: Callable) -> None:
        super().__init__()
        self.lin1 = LoraLinear(DIM, hidden, quantize)
        self.lin2 = LoraLinear(hidden, DIM, quantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


class QloraNet(nn.Module):
    def __init__(self, hidden: int, quantize: Callable) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, quantize) for _ in range(2))
        self.head = nn.Linear(DIM, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _quantizer(kind: str) -> tuple[Callable, int]:
    """(how to quantize a weight, the blocks' hidden size) of ``kind``."""
    if kind == "blockwise":  # even shards at W = 2 and 4
        return lambda w: Blockwise.quantize(w, 8), HIDDEN
    if kind == "padded":  # 18 rows: 5, 5, 5 and 3 at W = 4 (9 each at W = 2)
        return lambda w: PaddedBlockwise.quantize(w, 2), 18
    nf4 = _import_nf4()
    return lambda w: nf4.to_nf4(w, block_size=16, scaler_block_size=4), HIDDEN


def _import_nf4():
    """torchao's NF4 module (its path since torchao 0.15, then the older one)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def _values(t: torch.Tensor) -> list:
    """A tensor's values as floats, each inner tensor of a quantized one."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    names = getattr(type(t), "__tensor_flatten__", None)
    if names is not None and type(t) is not torch.Tensor:
        return [_values(getattr(t, n)) for n in t.__tensor_flatten__()[0]]
    return t.detach().double().flatten().tolist()


def _train(model: nn.Module, rank: int) -> list:
    trained = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.Adam(trained, lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(_inputs(rank, step)).sum()
        loss.backward()
        losses.append(_values(loss))
        if step < STEPS - 1:
            optim.step()
            optim.zero_grad()
    return losses


def qlora(world_size: int, rank: int, kind: str, mp: bool = False, **shard_kwargs) -> dict:
    """The QLoRA model trained ``STEPS`` steps per library, each block and the
    root ``fully_shard``ed; ``mp``: bf16 parameters."""
    if kind == "nf4":
        try:
            _import_nf4()
        except ImportError as e:
            return {"skipped": f"torchao's NF4 is not importable: {e}"}
    if mp:
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    quantize, hidden = _quantizer(kind)
    out = {}
    for lib in LIBS:
        Blockwise.seen.clear()
        torch.manual_seed(0)
        model = QloraNet(hidden, quantize)
        mesh = _mesh(world_size, False)
        for block in model.blocks:
            LIBS[lib](block, mesh=mesh, **shard_kwargs)
        LIBS[lib](model, mesh=mesh, **shard_kwargs)
        params = dict(model.named_parameters())
        base = params["blocks.0.lin1.weight"]
        losses = _train(model, rank)
        out[lib] = {
            "losses": losses,
            "params": {n: _values(p) for n, p in params.items()},
            "grads": {n: None if p.grad is None else _values(p.grad) for n, p in params.items()},
            "base_type": type(base._local_tensor).__name__,
            "post_dtypes": sorted(set(Blockwise.seen)),
        }
    return out


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "blockwise": (qlora, {"kind": "blockwise"}),
    "blockwise_bf16": (qlora, {"kind": "blockwise", "mp": True}),
    "blockwise_keep": (qlora, {"kind": "blockwise", "reshard_after_forward": False}),
    "padded": (qlora, {"kind": "padded"}),
    "padded_bf16": (qlora, {"kind": "padded", "mp": True}),
    "nf4": (qlora, {"kind": "nf4"}),
    "nf4_bf16": (qlora, {"kind": "nf4", "mp": True}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
