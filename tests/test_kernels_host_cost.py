"""Host cost of the Triton ops ([Note: Host cost] in ``bench/copy.py``,
[Note: Pointer tables]): the Python work of a call, counted as Python function
calls with the launch itself stubbed out, does not grow with the number of
parameters, for the group's own buffers and for per-parameter tensors alike.
Counting calls instead of timing keeps the test exact on a noisy machine."""

from __future__ import annotations

import sys

import pytest
import torch

from fsdp_rs.kernels import (
    all_gather_copy_in,
    all_gather_copy_out,
    post_reduce,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_flat,
)
from fsdp_rs.ops import GroupTables
from fsdp_rs.planning import plan_group, shapes_to_arrays

WORLD_SIZE = 4


class _Launches:
    """Stands in for a ``@triton.jit`` kernel: records the grids it was given."""

    def __init__(self) -> None:
        self.grids: list = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


@pytest.fixture
def launches(monkeypatch) -> _Launches:
    stub = _Launches()
    for module, name in (
        (all_gather_copy_in, "_copy_in_kernel"),
        (all_gather_copy_out, "_copy_out_kernel"),
        (post_reduce, "_post_reduce_kernel"),
        (reduce_scatter_copy_in, "_rs_copy_in_kernel"),
        (reduce_scatter_copy_in_flat, "_rs_copy_in_flat_kernel"),
    ):
        monkeypatch.setattr(module, name, stub)
    return stub


def _python_calls(fn) -> int:
    """Python-level function calls made while running ``fn`` (C calls excluded)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _calls(n_params: int) -> dict[str, int]:
    shapes = [(8, 3) if i % 2 else (5,) for i in range(n_params)]
    plan = plan_group(*shapes_to_arrays(shapes), WORLD_SIZE, 1)
    tables = GroupTables.from_plan(plan)
    rows = plan.row_numel
    sharded = torch.randn(rows)
    all_gather_output = torch.randn(WORLD_SIZE, rows)
    unsharded = torch.empty(plan.unsharded_numel)
    per_param = [torch.empty(WORLD_SIZE * int(n)) for n in plan.padded_sharded_numel]
    grads = [torch.randn(s) for s in shapes]
    grads[1] = None  # a parameter without a gradient
    rs_input = torch.empty(WORLD_SIZE, rows)
    return {
        "all_gather_copy_in": _python_calls(
            lambda: all_gather_copy_in.triton_all_gather_copy_in(sharded, all_gather_output, 1)
        ),
        "all_gather_copy_out (group buffer)": _python_calls(
            lambda: all_gather_copy_out.triton_all_gather_copy_out(
                all_gather_output, [unsharded], *tables.copy_out_args()
            )
        ),
        "all_gather_copy_out (per param)": _python_calls(
            lambda: all_gather_copy_out.triton_all_gather_copy_out(
                all_gather_output, per_param, *tables.copy_out_args()
            )
        ),
        "reduce_scatter_copy_in (per-param gradients)": _python_calls(
            lambda: reduce_scatter_copy_in.triton_reduce_scatter_copy_in(
                grads, rs_input, *tables.reduce_scatter_args()
            )
        ),
        "reduce_scatter_copy_in_flat": _python_calls(
            lambda: reduce_scatter_copy_in_flat.triton_reduce_scatter_copy_in_flat(
                unsharded, rs_input, *tables.reduce_scatter_flat_args()
            )
        ),
        "post_reduce": _python_calls(
            lambda: post_reduce.triton_post_reduce(sharded, torch.empty_like(sharded), 2.0, True)
        ),
    }


def test_python_calls_per_op_do_not_grow_with_parameters(launches) -> None:
    few, many = _calls(40), _calls(4000)
    assert len(launches.grids) == 2 * len(few)  # every op launched, once per call
    assert many == few, {op: (few[op], many[op]) for op in few if few[op] != many[op]}
