"""``FSDPModule.zero_grad(set_to_none=True)``: it clears what torch's
``nn.Module.zero_grad`` clears (an ignored parameter, a shared one, a frozen
one given a ``.grad`` by hand), runs a class's own ``zero_grad`` and walk, and
parks only the buffers of groups whose ``.grad``s it cleared ([Note: Parked
gradient buffers]). One rank of a fake process group, so every value is real."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_rs


@pytest.fixture
def fake_pg_1():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    """Sharded blocks, a parameter fully_shard ignores, one registered twice
    (shared by two modules), a ``None`` parameter slot and a parameter that
    requires no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.ignored = nn.Parameter(torch.randn(4))
        self.tied = nn.Linear(4, 4, bias=False)
        self.tied_too = nn.Linear(4, 4, bias=False)
        self.tied_too.weight = self.tied.weight  # a second registration
        self.register_parameter("empty", None)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (self.tied(x) + self.tied_too(x) + self.ignored).sum()


def _sharded(cls=Net) -> nn.Module:
    torch.manual_seed(0)
    model = cls()
    for block in model.blocks:
        fsdp_rs.fully_shard(block)
    fsdp_rs.fully_shard(model, ignored_params={model.ignored})
    return model


def _grads(model: nn.Module) -> list:
    return [p.grad for p in model.parameters()]


def test_clears_what_torch_clears(fake_pg_1) -> None:
    model = _sharded()
    for _ in range(3):
        model(torch.randn(2, 4)).backward()
        assert all(
            g is not None
            for p, g in zip(model.parameters(), _grads(model), strict=True)
            if p.requires_grad
        )
        model.frozen.grad = torch.ones(4)  # a gradient set by hand is cleared too
        model.zero_grad()
        assert all(g is None for g in _grads(model))


def test_a_group_outside_the_walk_keeps_its_grads(fake_pg_1) -> None:
    """A group the root found at its lazy init whose module left the model:
    the root's ``zero_grad`` neither clears its ``.grad``s (torch's walk does
    not reach them) nor parks their buffer under them."""
    model = _sharded()
    model(torch.randn(2, 4)).backward()
    model.zero_grad()
    model(torch.randn(2, 4)).backward()  # the buffers were parked once: reused
    gone = model.blocks[1]
    expected = [p.grad.to_local().clone() for p in gone.parameters()]
    model.blocks[1] = nn.Identity()
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    for p, want in zip(gone.parameters(), expected, strict=True):
        assert p.grad is not None
        assert p.grad.to_local().untyped_storage().nbytes() > 0
        assert torch.equal(p.grad.to_local(), want)


class OwnWalk(Net):
    """A class that finds its parameters its own way."""

    def named_parameters(self, *args, **kwargs):
        yield from super().named_parameters(*args, **kwargs)


class OwnZeroGrad(Net):
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls = getattr(self, "calls", 0) + 1
        super().zero_grad(set_to_none)


@pytest.mark.parametrize("cls", [OwnWalk, OwnZeroGrad])
def test_a_class_of_its_own_gets_torchs_walk(fake_pg_1, cls) -> None:
    model = _sharded(cls)
    model(torch.randn(2, 4)).backward()
    model.zero_grad()
    assert all(g is None for g in _grads(model))
    if cls is OwnZeroGrad:
        assert model.calls == 1
