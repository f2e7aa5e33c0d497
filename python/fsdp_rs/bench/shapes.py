"""Deterministic parameter-shape mixes for the planner benchmarks.

Three families, each built by tiling a per-layer template with NumPy (no
per-parameter Python loop, so a million shapes take milliseconds):

* ``transformer``: a dense 7B-style layer, 12 tensors: q/k/v/o ``(4096, 4096)``,
  q/k/v biases ``(4096,)``, MLP gate/up ``(11008, 4096)``, down ``(4096, 11008)``,
  two norms ``(4096,)`` (about 202M elements per layer).
* ``moe``: a router ``(64, 2048)`` then 64 experts of gate/up ``(1408, 2048)`` and
  down ``(2048, 1408)``: 193 tensors, about 554M elements per layer.
* ``adapter``: rank-16 LoRA pairs ``A (16, in)`` / ``B (out, 16)`` on a target
  drawn (seeded) from the attention, MLP and expert projections above, each
  pair followed by a base-free IA3-style scaling vector ``(out,)``: about
  50K elements per tensor.

``auto`` (the default) keeps an ``N``-parameter model plausible for world size
``W`` by filling an element budget of ``W * 2e9`` (about 8 GB of fp32 shards
per rank) with the largest tensors first:

1. ``transformer`` layers up to half the budget (at least one layer),
2. ``moe`` layers up to a further 40% of the budget,
3. every remaining parameter is ``adapter``-like.

Counts are in tensors and a family's last layer may be cut short. Small ``N``
is therefore dense-only; large ``N`` is mostly adapters, so ``N = 1e6`` at
``W = 8`` is about ``6e10`` elements rather than a 1e13-element dense model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "ELEMENT_BUDGET_PER_RANK",
    "MIXES",
    "ShapeMix",
    "auto_counts",
    "family_shapes",
    "make_shapes",
]

ELEMENT_BUDGET_PER_RANK = 2_000_000_000
"""``auto`` sizes models to at most about this many elements per rank."""

MIXES = ("auto", "transformer", "moe", "adapter")
FAMILIES = ("transformer", "moe", "adapter")

_HIDDEN = 4096
_FFN = 11008
_MOE_HIDDEN = 2048
_MOE_FFN = 1408
_NUM_EXPERTS = 64
_LORA_RANK = 16

_TRANSFORMER_LAYER: list[tuple[int, ...]] = [
    (_HIDDEN, _HIDDEN),  # q
    (_HIDDEN,),  # q bias
    (_HIDDEN, _HIDDEN),  # k
    (_HIDDEN,),  # k bias
    (_HIDDEN, _HIDDEN),  # v
    (_HIDDEN,),  # v bias
    (_HIDDEN, _HIDDEN),  # o
    (_HIDDEN,),  # post-attention norm
    (_FFN, _HIDDEN),  # gate
    (_FFN, _HIDDEN),  # up
    (_HIDDEN, _FFN),  # down
    (_HIDDEN,),  # input norm of the next layer
]
_MOE_LAYER: list[tuple[int, ...]] = [(_NUM_EXPERTS, _MOE_HIDDEN)] + [
    shape
    for _ in range(_NUM_EXPERTS)
    for shape in ((_MOE_FFN, _MOE_HIDDEN), (_MOE_FFN, _MOE_HIDDEN), (_MOE_HIDDEN, _MOE_FFN))
]
# (in_features, out_features) of the projections adapters attach to.
_ADAPTER_TARGETS = np.array(
    [
        (_HIDDEN, _HIDDEN),  # q/k/v/o
        (_HIDDEN, _FFN),  # gate/up
        (_FFN, _HIDDEN),  # down
        (_MOE_HIDDEN, _MOE_FFN),  # expert gate/up
        (_MOE_FFN, _MOE_HIDDEN),  # expert down
    ],
    dtype=np.int64,
)
_ADAPTER_UNIT = 3  # tensors per adapter: LoRA A, LoRA B, scaling vector


@dataclass(frozen=True)
class ShapeMix:
    """``N`` parameter shapes as the planner's flat int64 inputs."""

    ndims: np.ndarray
    dims: np.ndarray
    counts: dict[str, int]
    """Tensors per family, in the order they appear."""
    seed: int

    @property
    def num_params(self) -> int:
        return int(self.ndims.size)

    @property
    def numels(self) -> np.ndarray:
        """Elements of each parameter (int64)."""
        if self.ndims.size == 0:
            return np.zeros(0, dtype=np.int64)
        starts = np.zeros(self.ndims.size, dtype=np.int64)
        np.cumsum(self.ndims[:-1], out=starts[1:])
        return np.multiply.reduceat(self.dims, starts)

    @property
    def total_elements(self) -> int:
        return int(self.numels.sum(dtype=np.int64))

    @property
    def name(self) -> str:
        """Compact description, e.g. ``transformer:624+moe:376``."""
        parts = [f"{family}:{count}" for family, count in self.counts.items() if count]
        return "+".join(parts) if parts else "empty"


def _tile_template(template: list[tuple[int, ...]], count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` tensors of ``template`` repeated."""
    ndims_unit = np.array([len(s) for s in template], dtype=np.int64)
    dims_unit = np.array([d for s in template for d in s], dtype=np.int64)
    reps = -(-count // len(template))
    ndims = np.tile(ndims_unit, reps)[:count]
    dims = np.tile(dims_unit, reps)[: int(ndims.sum())]
    return ndims, dims


def _adapter_shapes(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    units = -(-count // _ADAPTER_UNIT)
    targets = _ADAPTER_TARGETS[rng.integers(0, len(_ADAPTER_TARGETS), size=units)]
    in_features, out_features = targets[:, 0], targets[:, 1]
    rank = np.full(units, _LORA_RANK, dtype=np.int64)
    # Per unit: A (r, in), B (out, r), scale (out,) -> 5 dims, ndims (2, 2, 1).
    dims = np.stack([rank, in_features, out_features, rank, out_features], axis=1).ravel()
    ndims = np.tile(np.array([2, 2, 1], dtype=np.int64), units)[:count]
    return ndims, dims[: int(ndims.sum())]


def family_shapes(
    family: str, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(ndims, dims)`` of ``count`` tensors of one family."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if family == "transformer":
        return _tile_template(_TRANSFORMER_LAYER, count)
    if family == "moe":
        return _tile_template(_MOE_LAYER, count)
    if family == "adapter":
        return _adapter_shapes(count, rng)
    raise ValueError(f"unknown shape family {family!r}; expected one of {FAMILIES}")


def _layer_numel(template: list[tuple[int, ...]]) -> int:
    return sum(int(np.prod(s)) for s in template)


def auto_counts(num_params: int, world_size: int) -> dict[str, int]:
    """Tensors per family for ``auto``: see the module docstring for the rule."""
    if num_params < 0 or world_size < 1:
        raise ValueError("num_params must be >= 0 and world_size >= 1")
    budget = world_size * ELEMENT_BUDGET_PER_RANK
    dense_layers = max(1, (budget // 2) // _layer_numel(_TRANSFORMER_LAYER))
    transformer = min(num_params, dense_layers * len(_TRANSFORMER_LAYER))
    moe_layers = (budget * 2 // 5) // _layer_numel(_MOE_LAYER)
    moe = min(num_params - transformer, moe_layers * len(_MOE_LAYER))
    return {"transformer": transformer, "moe": moe, "adapter": num_params - transformer - moe}


def make_shapes(num_params: int, world_size: int, mix: str = "auto", seed: int = 0) -> ShapeMix:
    """``num_params`` shapes of ``mix`` (``auto`` or one family), deterministic in ``seed``."""
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if mix == "auto":
        counts = auto_counts(num_params, world_size)
    elif mix in FAMILIES:
        counts = {mix: num_params}
    else:
        raise ValueError(f"unknown shape mix {mix!r}; expected one of {MIXES}")
    rng = np.random.default_rng(seed)
    parts = [family_shapes(family, count, rng) for family, count in counts.items()]
    ndims = np.concatenate([p[0] for p in parts])
    dims = np.concatenate([p[1] for p in parts])
    return ShapeMix(ndims=ndims, dims=dims, counts=counts, seed=seed)
