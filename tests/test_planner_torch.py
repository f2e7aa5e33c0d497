"""The planner's per-parameter metadata equals torch's own FSDP2 / FSDP1 metadata.

torch is the ground truth: ``fully_shard`` on a meta-device model over a fake
process group computes every ``FSDPParam``'s sizes and strides, and FSDP1's
``FlatParamHandle`` computes the flat-parameter shard metadata. Both the
pure-Python reference and (when built) the Rust planner must reproduce them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleShardingStrategy
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_rs._core as core
from fsdp_rs.planning import reference


@pytest.fixture(params=["reference", "rust"])
def planner(request):
    """Either implementation."""
    return core if request.param == "rust" else reference


def _arrays(shapes):
    ndims = np.array([len(s) for s in shapes], dtype=np.int64)
    dims = np.array([d for s in shapes for d in s], dtype=np.int64)
    return ndims, dims


def _table(plan, name):
    value = getattr(plan, name)
    return None if value is None else [int(v) for v in value]


def _per_param(plan, name):
    """Split a concatenated size/stride table into one tuple per param."""
    table, offsets = _table(plan, name), _table(plan, "dim_offsets")
    return [tuple(table[offsets[p] : offsets[p + 1]]) for p in range(len(offsets) - 1)]


@pytest.fixture
def fake_pg():
    """``fake_pg(W, r)`` initializes a fake process group; destroyed after the test."""

    def init(world_size: int, rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


# Odd shapes: 1-D, d0 < W, d0 == 0, primes, a 0 in a later dim, 3-D/4-D, d0 just
# around multiples of the world sizes tested.
SHAPES = [
    (1,),
    (2,),
    (7,),
    (17,),
    (257,),
    (0,),
    (127,),
    (129,),
    (4096,),
    (17, 257),
    (257, 17),
    (2, 3),
    (5, 3),
    (0, 4),
    (4, 0),
    (6, 0),
    (0, 0),
    (1, 1000),
    (1000, 1),
    (3, 0, 5),
    (0, 3, 0),
    (9, 3, 4),
    (2, 3, 4, 5),
    (13, 7, 0, 2),
    (128, 3),
    (129, 2),
    (50_000, 3),
    (131, 1, 1, 7),
]

FSDP2_CASES = [
    # (world_size, ranks, reshard_after_forward values)
    (1, [0], [None, 1]),
    (2, [0, 1], [None, False, 2]),
    (3, [0, 1, 2], [None, 1, 3]),
    (8, [0, 3, 7], [None, 1, 2, 4, 8]),
    (128, [0, 64, 127], [None, 8, 128]),
]


def _post_forward_world_size(reshard_after_forward, world_size):
    """World size of torch's post-forward shard, or None when torch keeps none."""
    if reshard_after_forward is None or reshard_after_forward is True:
        return world_size  # post-forward mesh is the FSDP mesh itself
    if reshard_after_forward is False or reshard_after_forward == 1:
        return None  # an int 1 means "do not reshard" (torch warns)
    return reshard_after_forward


@pytest.mark.parametrize(
    ("world_size", "rank", "reshard_after_forward"),
    [(w, r, raf) for w, ranks, rafs in FSDP2_CASES for r in ranks for raf in rafs],
)
def test_fsdp2_param_metadata(planner, fake_pg, world_size, rank, reshard_after_forward):
    fake_pg(world_size, rank)
    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Module()
    model.params = nn.ParameterList(
        nn.Parameter(torch.empty(s, device="meta", dtype=torch.bfloat16)) for s in SHAPES
    )
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fsdp_params = model._get_fsdp_state()._fsdp_param_group.fsdp_params
    assert [tuple(fp._orig_size) for fp in fsdp_params] == SHAPES

    pf_world = _post_forward_world_size(reshard_after_forward, world_size)
    plan = planner.plan_group(
        *_arrays(SHAPES),
        world_size,
        rank,
        orig_elem_size=2,
        alignment=1,  # torch packs all-gather inputs without alignment padding
        post_forward_world_size=pf_world,
    )
    sharded = _per_param(plan, "sharded_sizes")
    padded = _per_param(plan, "padded_sharded_sizes")
    strides = _per_param(plan, "contiguous_strides")
    pf_sizes = _per_param(plan, "post_forward_sizes") if pf_world is not None else None
    split_sizes, unsharded = _table(plan, "split_sizes"), _table(plan, "unsharded_offsets")
    unsharded.append(plan.unsharded_numel)
    for p, fp in enumerate(fsdp_params):
        where = f"param {p} shape {SHAPES[p]}"
        assert tuple(fp.sharded_size) == sharded[p], where
        assert tuple(fp.padded_sharded_param_size) == padded[p], where
        assert tuple(fp.contiguous_sharded_stride) == strides[p], where
        assert tuple(fp._contiguous_orig_stride) == strides[p], where
        assert tuple(fp.sharded_param._local_tensor.size()) == sharded[p], where
        # with alignment 1, a row segment is exactly torch's padded shard ...
        assert split_sizes[p] == fp._sharded_param_data.numel(), where
        # ... and an unsharded segment is torch's all-gather output for the param
        assert unsharded[p + 1] - unsharded[p] == world_size * split_sizes[p], where
        if pf_sizes is None:
            assert not hasattr(fp, "sharded_post_forward_size"), where
        else:
            assert tuple(fp.sharded_post_forward_size) == pf_sizes[p], where
            assert tuple(fp.contiguous_sharded_post_forward_stride) == strides[p], where
    assert plan.row_numel == sum(fp._sharded_param_data.numel() for fp in fsdp_params)
    assert _table(plan, "sharded_numel") == [math.prod(fp.sharded_size) for fp in fsdp_params]
    assert _table(plan, "numel") == [math.prod(s) for s in SHAPES]


@pytest.mark.parametrize("reshard_after_forward", [0, 3, 5, 16, -2])
def test_bad_post_forward_world_size_rejected_like_torch(planner, fake_pg, reshard_after_forward):
    world_size = 8
    fake_pg(world_size, 0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(17, 3, device="meta"))
    with pytest.raises(ValueError):
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    with pytest.raises(ValueError):
        planner.plan_group(
            *_arrays([(17, 3)]), world_size, 0, post_forward_world_size=reshard_after_forward
        )


FLAT_SHAPES = [(17, 3), (0,), (7,), (2, 2), (5,), (1,), (3, 0, 2), (13,), (4, 4), (2,)]
FLAT_CASES = [(1, [0]), (2, [0, 1]), (3, [0, 2]), (8, [0, 3, 7]), (128, [0, 1, 127])]


@pytest.mark.parametrize(("world_size", "rank"), [(w, r) for w, ranks in FLAT_CASES for r in ranks])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fsdp1_flat_metadata(planner, fake_pg, world_size, rank, use_orig_params, dtype):
    fake_pg(world_size, rank)
    model = nn.Module()
    model.params = nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=dtype)) for s in FLAT_SHAPES)
    handle = FlatParamHandle(
        list(model.parameters()),
        model,
        torch.device("cpu"),
        HandleShardingStrategy.FULL_SHARD,
        offload_params=False,
        mp_param_dtype=None,
        mp_reduce_dtype=None,
        keep_low_precision_grads=False,
        process_group=dist.group.WORLD,
        use_orig_params=use_orig_params,
    )
    handle.shard()
    flat = handle.flat_param
    aligned_numel = 16 // dtype.itemsize if use_orig_params else 0
    assert handle._aligned_numel == aligned_numel

    plan = planner.plan_flat(*_arrays(FLAT_SHAPES), world_size, rank, aligned_numel=aligned_numel)
    offsets, total = [], 0
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not is_padding:
            offsets.append(total)
        total += numel
    assert _table(plan, "flat_offsets") == offsets
    assert _table(plan, "numel") == [math.prod(s) for s in FLAT_SHAPES]
    assert plan.flat_numel == total == flat._unpadded_unsharded_size.numel()
    assert plan.shard_numel == flat._sharded_size.numel() == flat.numel()
    assert plan.shard_numel_padded == flat._shard_numel_padded
    fields = ("offset_in_shard", "numel_in_shard", "intra_param_start_idx", "intra_param_end_idx")
    want = [
        (info.in_shard, *(-1 if getattr(info, f) is None else getattr(info, f) for f in fields))
        for info in flat._shard_param_infos
    ]
    got = list(
        zip(
            [bool(v) for v in plan.in_shard],
            _table(plan, "offset_in_shard"),
            _table(plan, "numel_in_shard"),
            _table(plan, "intra_param_start"),
            _table(plan, "intra_param_end"),
            strict=True,
        )
    )
    assert got == want


@pytest.mark.parametrize("shape", [(2**40, 2**40, 0), (2**40, 0, 2**40), (0, 2**40, 2**40)])
def test_overflowing_shapes_rejected_like_torch(planner, shape):
    """A zero dim does not excuse an overflowing partial product or stride, as in torch."""
    try:
        torch.empty(shape, device="meta")
    except RuntimeError:
        with pytest.raises(ValueError):
            planner.plan_group(*_arrays([shape]), 8, 3)
    else:
        plan = planner.plan_group(*_arrays([shape]), 8, 3)
        assert _table(plan, "contiguous_strides") == list(
            torch.empty(shape, device="meta").stride()
        )
