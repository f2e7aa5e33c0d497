"""The training step's host cost is O(groups) ([Note: Trusted calls] in
``ops/copies.py``, [Note: Direct collectives] in ``runtime/comm/collectives.py``):
counted as Python function calls, not timed, so that the test is exact on a
noisy machine. ``python -m fsdp_rs.bench step`` measures the time."""

from __future__ import annotations

import collections
import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist

import fsdp_rs
from fsdp_rs.bench.training import BenchModel, shard_model
from fsdp_rs.optim import FlatOptimizer
from fsdp_rs.runtime.comm import collectives

ROOT = os.path.dirname(fsdp_rs.__file__)
TORCH = os.path.dirname(torch.__file__)
# What a sharding library runs per step: its own code, torch.distributed
# (DTensor, c10d) and autograd's Python. The model's own forward (the bench
# model iterates a ParameterList in Python) and ``Module.zero_grad`` (which the
# unsharded model pays alike) are per parameter by construction, and not
# counted.
COUNTED = (
    ROOT + os.sep,
    os.path.join(TORCH, "distributed") + os.sep,
    os.path.join(TORCH, "autograd") + os.sep,
    os.path.join(TORCH, "optim") + os.sep,
)


@pytest.fixture
def fake_pg_8():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def _calls_per_step(groups: int, per_group: int) -> collections.Counter:
    """Python calls of one training step (``zero_grad(set_to_none=True)``,
    forward, backward, a ``FlatOptimizer`` step) by function, after two
    warm-up steps."""
    torch.manual_seed(0)
    model = BenchModel(groups * per_group, per_group)
    shard_model(model, "fsdp_rs")
    opt = FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    x = torch.randn(4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    step()
    step()
    calls: collections.Counter = collections.Counter()
    bench = os.path.join(ROOT, "bench") + os.sep

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(COUNTED) and not name.startswith(bench):
                calls[(name, frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def test_step_python_calls_do_not_grow_with_parameters(fake_pg_8) -> None:
    few, many = _calls_per_step(4, 10), _calls_per_step(4, 200)
    grown = {
        f"{os.path.relpath(k[0], TORCH if k[0].startswith(TORCH) else ROOT)}:{k[1]}": (
            few[k],
            many[k],
        )
        for k in few.keys() | many.keys()
        if few[k] != many[k]
    }
    assert not grown, f"Python calls per step grew with parameters per group: {grown}"
    assert sum(few.values()) > 0


def _calls_in_fully_shard(blocks: int, per_block: int) -> collections.Counter:
    """Python-level calls (functions, and builtins called from Python code) of
    ``fully_shard`` over ``blocks`` blocks of ``per_block`` parameters and the
    root, by function, in fsdp-rs and torch's module and distributed code."""
    torch.manual_seed(0)
    model = BenchModel(blocks * per_block, per_block)
    counted = (*COUNTED, os.path.join(TORCH, "nn") + os.sep)
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        name = frame.f_code.co_filename
        if not name.startswith(counted):
            return
        if event == "call":
            calls[(name, frame.f_code.co_name)] += 1
        elif event == "c_call":  # a builtin called from that code, e.g. in a loop
            calls[(name, getattr(arg, "__qualname__", repr(arg)))] += 1

    gc.collect()  # earlier objects' weak-reference callbacks run now, not counted
    sys.setprofile(profile)
    try:
        shard_model(model, "fsdp_rs")
    finally:
        sys.setprofile(None)
    return calls


def test_fully_shard_python_calls_do_not_grow_with_parameters(fake_pg_8) -> None:
    """[Note: fully_shard's cost per parameter]: the same calls for blocks of 10
    and of 200 parameters."""
    _calls_in_fully_shard(2, 10)  # first: the mesh, and a spec per shape, made once
    few, many = _calls_in_fully_shard(4, 10), _calls_in_fully_shard(4, 200)
    grown = {k: (few[k], many[k]) for k in few.keys() | many.keys() if few[k] != many[k]}
    assert not grown, f"fully_shard's Python calls grew with parameters per block: {grown}"
    assert sum(few.values()) > 0


def test_step_runs_no_table_checks(fake_pg_8, monkeypatch) -> None:
    """The copy ops the runtime calls trust the tables ``GroupTables``
    checked when planned: a step checks no table (it checked about 17 per
    group per step before)."""
    from fsdp_rs.kernels import _checks

    calls = _calls_per_step(3, 5)
    checks = {k[1]: n for k, n in calls.items() if k[0] == _checks.__file__}
    for name in ("check_table", "check_layout_tables", "check_tile_table", "check_buffer"):
        assert name not in checks, f"{name} ran {checks[name]} times in one step"


def test_step_calls_process_groups_directly(fake_pg_8) -> None:
    """The all-gathers and reduce-scatters of a step skip torch.distributed's
    Python entry points ([Note: Direct collectives]); what remains there per
    step (the gradient agreement) does not grow with the number of groups."""
    c10d = os.path.join(TORCH, "distributed", "distributed_c10d.py")
    few = _calls_per_step(2, 3)
    many = _calls_per_step(12, 3)
    for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor"):
        assert (c10d, name) not in many
    entry = {k: n for k, n in many.items() if k[0] == c10d}
    assert entry == {k: n for k, n in few.items() if k[0] == c10d}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


@pytest.mark.parametrize("which", ["subclass", "complex", "no_group", "coalescing"])
def test_collectives_fall_back_to_torch(fake_pg_8, monkeypatch, which) -> None:
    """What the direct call does not cover goes through torch's entry point."""
    gather, scatter = _Recorder(), _Recorder()
    monkeypatch.setattr(collectives, "_dist_all_gather", gather)
    monkeypatch.setattr(collectives, "_dist_reduce_scatter", scatter)
    group = dist.new_group(list(range(8)))
    dtype = torch.complex64 if which == "complex" else torch.float32
    out, inp = torch.zeros(16, dtype=dtype), torch.ones(2, dtype=dtype)
    if which == "subclass":
        inp = torch.nn.Parameter(inp, requires_grad=False)
    if which == "no_group":
        group = None
    coalescing = dist.distributed_c10d._world.pg_coalesce_state
    if which == "coalescing":  # as inside torch's _coalescing_manager
        coalescing[group] = []
    try:
        collectives.all_gather(out, inp, group=group)
        collectives.reduce_scatter(inp, out, group=group)
    finally:
        coalescing.pop(group, None)
    assert len(gather.calls) == 1 and len(scatter.calls) == 1


def test_collectives_direct_on_plain_tensors(fake_pg_8, monkeypatch) -> None:
    gather, scatter = _Recorder(), _Recorder()
    monkeypatch.setattr(collectives, "_dist_all_gather", gather)
    monkeypatch.setattr(collectives, "_dist_reduce_scatter", scatter)
    group = dist.new_group(list(range(8)))
    out, inp = torch.zeros(16), torch.ones(2)
    assert collectives.all_gather(out, inp, group=group) is None
    work = collectives.all_gather(out, inp, group=group, async_op=True)
    assert work is not None
    work.wait()
    assert collectives.reduce_scatter(inp, out, op=dist.ReduceOp.AVG, group=group) is None
    assert not gather.calls and not scatter.calls


def _get_grads_per_step(modules: int, monkeypatch) -> int:
    """Calls of the runtime's ``get_grads`` (one C-level read of every
    parameter's ``.grad``) in one step of a single group over ``modules``
    ``nn.Linear`` (``fully_shard([...])``, as ``auto_shard`` makes)."""
    from fsdp_rs import fully_shard
    from fsdp_rs.runtime.group import gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(modules)])
    fully_shard(list(model))
    fully_shard(model)
    x = torch.randn(2, 4)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    calls = [0]
    real = gradients.get_grads

    def counted(params):
        calls[0] += 1
        return real(params)

    monkeypatch.setattr(gradients, "get_grads", counted)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return calls[0]


def test_a_group_over_many_modules_reads_its_grads_once_per_backward(fake_pg_8, monkeypatch):
    """[Note: One placement check per backward]: not once per module (which
    made a group of M modules and P parameters cost O(M * P) per step)."""
    assert _get_grads_per_step(3, monkeypatch) == _get_grads_per_step(30, monkeypatch)


def _backward_survivors(per_group: int) -> int:
    """Python objects the garbage collector tracks that a backward leaves alive
    (net), for 4 groups of ``per_group`` parameters, at the steady state."""
    import gc

    torch.manual_seed(0)
    model = BenchModel(4 * per_group, per_group)
    shard_model(model, "fsdp_rs")
    x = torch.randn(4)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        loss.backward()
        return gc.get_count()[0] - before
    finally:
        gc.enable()


def test_backward_leaves_two_objects_per_parameter(fake_pg_8) -> None:
    # Each trainable parameter's .grad is a DTensor over a local view: two
    # objects the collector tracks, which live until zero_grad() and so reach
    # its oldest generation; each such object is paid again in collections over
    # the whole heap (about 2.5 us per parameter per step at 1e4 parameters, as
    # much as making the views). Nothing else per parameter may survive a step.
    few, many = _backward_survivors(10), _backward_survivors(200)
    assert many - few <= 2 * 4 * (200 - 10), (few, many)


@pytest.fixture
def fake_pg_1():
    # one rank: no collective runs, so every value is real (the fake group of
    # more ranks writes no collective output)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_grads_swapped_by_the_user_accumulate_per_parameter(fake_pg_1) -> None:
    # [Note: Sharded gradient buffer]: the buffer takes the next backward's sum
    # only while every .grad is its view at its own place; two same-shaped
    # .grads swapped are views of it, elsewhere.
    from fsdp_rs.bench.training import LinearChain

    torch.manual_seed(0)
    model = LinearChain(6)
    fsdp_rs.fully_shard(model)  # one group
    x = torch.randn(4, 8)
    model(x).sum().backward()
    w0, w1 = model.blocks[0].weight, model.blocks[1].weight
    first = [p.grad.to_local().clone() for p in model.parameters()]
    assert not torch.equal(first[0], first[2])
    w0.grad, w1.grad = w1.grad, w0.grad
    model(x).sum().backward()
    second = [p.grad.to_local() for p in model.parameters()]
    expected = [g + g for g in first]
    expected[0] = expected[2] = first[0] + first[2]  # each holds the other's, plus its own
    for got, want in zip(second, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
