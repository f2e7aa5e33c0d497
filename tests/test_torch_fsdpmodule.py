"""An fsdp-rs module is a ``torch.distributed.fsdp.FSDPModule`` to torch and to
libraries, and torch's methods never run on it ([Note: An FSDPModule to torch]
in ``runtime/api/fully_shard.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._composable.fsdp import FSDPModule as OldPathFSDPModule
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

import fsdp_rs


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fsdp_rs.fully_shard(model[0])
    fsdp_rs.fully_shard(model[2])
    fsdp_rs.fully_shard(model)
    return model


def test_fsdp_rs_modules_are_torchs_fsdp_modules(fake_pg) -> None:
    model = _model()
    for m in (model, model[0], model[2]):
        assert isinstance(m, TorchFSDPModule)
        assert isinstance(m, OldPathFSDPModule)
        assert isinstance(m, fsdp_rs.FSDPModule)
    assert not isinstance(model[1], TorchFSDPModule)
    # what slicing or indexing builds is the original class, as in FSDP2
    assert type(model[0:1]) is nn.Sequential


def test_torch_fsdp2_modules_are_not_fsdp_rs_modules(fake_pg) -> None:
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(8, 8)
    fully_shard(model)
    assert isinstance(model, TorchFSDPModule)
    assert not isinstance(model, fsdp_rs.FSDPModule)


def test_every_method_of_torchs_class_is_fsdp_rs_own() -> None:
    # On every torch CI runs: a method torch adds to its FSDPModule must be
    # defined by fsdp-rs too, or it would run FSDP2's code on fsdp-rs state.
    ours = fsdp_rs.FSDPModule.__mro__
    before_torch = ours[: ours.index(TorchFSDPModule)]
    missing = [
        name
        for name, value in vars(TorchFSDPModule).items()
        if (callable(value) or isinstance(value, property | staticmethod | classmethod))
        and not name.startswith("__")
        and not any(name in vars(cls) for cls in before_torch)
    ]
    assert not missing, f"torch's FSDPModule methods fsdp-rs does not define: {missing}"
    assert "__new__" in vars(fsdp_rs.FSDPModule)


def test_library_code_written_against_torchs_class_reaches_fsdp_rs(fake_pg) -> None:
    # Lightning's no_backward_sync, pipelining's stage backward: find modules
    # with torch's class, then call its setters.
    model = _model()
    x = torch.randn(2, 8)
    for m in model.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_requires_gradient_sync(False)
    model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # kept unsharded, not reduced
    for m in model.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_requires_gradient_sync(True)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp2_private_state_is_refused_by_name(fake_pg) -> None:
    model = _model()
    with pytest.raises(AssertionError, match="sharded by fsdp-rs's fully_shard"):
        model[0]._get_fsdp_state()


def test_set_unshard_async_op(fake_pg, monkeypatch) -> None:
    model = _model()
    with pytest.raises(TypeError, match="async_op"):
        model._set_unshard_async_op("yes")
    model._set_unshard_async_op(True)  # recursive, as FSDP2's
    groups = [m._state.group for m in (model[0], model[2])]  # the root holds none
    assert all(g.unshard_async_op for g in groups)
    seen = []
    for g in groups:
        original = g.unshard

        def unshard(*args, _original=original, **kwargs):
            seen.append(kwargs.get("async_op"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(g, "unshard", unshard)
    model(torch.randn(2, 8)).sum().backward()
    assert seen and all(seen), seen
    model[0]._set_unshard_async_op(False)
    assert not model[0]._state.group.unshard_async_op and model[2]._state.group.unshard_async_op


def test_all_reduce_hook_runs_with_its_stream_current(fake_pg) -> None:
    # torch's test_custom_hook_custom_stream, on the CPU device module's streams
    model = _model()
    device = torch.get_device_module("cpu")
    stream = device.Stream()
    seen = []
    model[2].set_all_reduce_hook(lambda output: seen.append(device.current_stream()), stream=stream)
    model(torch.randn(2, 8)).sum().backward()
    assert seen == [stream]
    assert device.current_stream() != stream
