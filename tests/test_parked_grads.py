"""[Note: Parked gradient buffers] (``runtime/group/grad_buffers.py``): a
``zero_grad`` of ``FlatOptimizer`` or of an fsdp-rs module frees each group's
gradient memory but keeps its buffer and ``.grad`` views for the next backward,
where nothing outside fsdp-rs holds them. One rank of a fake process group, so
that every value is real (no collective runs); the spawned ranks of
``test_flat_optim.py`` train parked buffers against torch's optimizers too."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from fsdp_rs.bench.training import BenchModel, shard_model
from fsdp_rs.optim import FlatOptimizer
from fsdp_rs.runtime.group.params import state_of


@pytest.fixture
def fake_pg_1():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(blocks: int = 3, per_block: int = 5):
    torch.manual_seed(0)
    model = BenchModel(blocks * per_block, per_block)
    shard_model(model, "fsdp_rs")
    return model


def _groups(model) -> list:
    return [state_of(block).group for block in model.blocks]


def _train(model, opt, x: torch.Tensor, steps: int, zero_grad=None) -> None:
    """``steps`` steps of ``zero_grad`` (the optimizer's unless given), forward,
    backward and ``opt.step()``."""
    for _ in range(steps):
        (zero_grad or opt.zero_grad)()
        model(x).sum().backward()
        opt.step()


def _clear_by_hand(model) -> None:
    """``zero_grad(set_to_none=True)`` as a plain loop: nothing is parked."""
    for p in model.parameters():
        p.grad = None


@pytest.mark.parametrize("how", ["optimizer", "module"])
def test_parked_buffers_train_bit_for_bit(fake_pg_1, how) -> None:
    x = torch.randn(4)
    parked, plain = _model(), _model()
    opts = [FlatOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2) for m in (parked, plain)]
    grads_seen = []
    for step in range(5):
        if how == "optimizer":
            opts[0].zero_grad()
        else:
            parked.zero_grad()
        if step >= 2:  # from the second zero_grad after a step on, buffers are parked
            assert all(g._parked is not None for g in _groups(parked))
        _clear_by_hand(plain)
        assert all(g._parked is None for g in _groups(plain))
        for m, opt in zip((parked, plain), opts, strict=True):
            m(x).sum().backward()
            opt.step()
        grads_seen.append([id(p.grad) for p in parked.blocks.parameters()])
    for a, b in zip(parked.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
        assert torch.equal(a.grad.to_local(), b.grad.to_local())
    assert grads_seen[2] == grads_seen[3] == grads_seen[4]  # the same objects again


def test_parked_buffer_holds_no_memory(fake_pg_1) -> None:
    model = _model()
    opt = FlatOptimizer(model.parameters(), torch.optim.SGD, lr=1e-2)
    x = torch.randn(4)
    _train(model, opt, x, steps=2)
    buffers = [g.grad_assign.owned(g)[0] for g in _groups(model)]
    assert all(b.untyped_storage().nbytes() > 0 for b in buffers)
    opt.zero_grad()
    assert all(b.untyped_storage().nbytes() == 0 for b in buffers)  # freed, as FSDP2's
    del buffers
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kept", ["grad", "to_local", "local_tensor", "local_view"])
def test_a_kept_grad_is_never_written(fake_pg_1, kept) -> None:
    """What the user keeps of a ``.grad`` across ``zero_grad`` keeps its values
    through the next backward: that group is not parked; the others are."""
    model = _model()
    opt = FlatOptimizer(model.parameters(), torch.optim.SGD, lr=1e-2)
    x = torch.randn(4)
    _train(model, opt, x, steps=2)
    p = next(model.blocks[1].parameters())
    held = {
        "grad": lambda g: g,
        "to_local": lambda g: g.to_local(),
        "local_tensor": lambda g: g._local_tensor,
        "local_view": lambda g: g._local_tensor[:1],
    }[kept](p.grad)
    before = held.clone() if not hasattr(held, "full_tensor") else held.to_local().clone()
    opt.zero_grad()
    groups = _groups(model)
    assert groups[1]._parked is None
    assert groups[0]._parked is not None and groups[2]._parked is not None
    model(x * 2).sum().backward()
    after = held if not hasattr(held, "full_tensor") else held.to_local()
    # the model's gradient is 4 per element whatever the input and parameters (the
    # input's 4 elements each add every parameter): the kept tensor still holds
    # its 4s (not 4 + 4 accumulated into it), and the parameter has a new .grad
    assert torch.equal(after, before)
    assert p.grad is not None and p.grad is not held
    assert bool((p.grad.to_local() == 4).all())


def _step_survivors(per_group: int, how: str) -> int:
    """Objects the garbage collector tracks that a steady-state backward after
    ``how``'s ``zero_grad`` leaves alive (net), 4 groups of ``per_group``
    parameters."""
    model = _model(4, per_group)
    opt = FlatOptimizer(model.parameters(), torch.optim.SGD, lr=1e-2)
    zero_grad = opt.zero_grad if how == "optimizer" else model.zero_grad
    x = torch.randn(4)
    _train(model, opt, x, steps=3, zero_grad=zero_grad)
    zero_grad()
    loss = model(x).sum()
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        loss.backward()
        return gc.get_count()[0] - before
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["optimizer", "module"])
def test_a_parked_backward_makes_no_object_per_parameter(fake_pg_1, how) -> None:
    # without parking: two per parameter (test_step_host_cost.py's bound)
    few, many = _step_survivors(10, how), _step_survivors(200, how)
    assert many - few <= 8, (few, many)
