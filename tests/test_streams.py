"""The stream protocol of [Note: Streams], checked on CPU: fsdp-rs trains with
a simulated accelerator's streams (``stream_sim``) under a fake process group,
and a race checker reports any access a GPU could reorder. The checker's own
tests and the broken-protocol tests show it finds what it should."""

from __future__ import annotations

import contextlib
import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_rs import MixedPrecisionPolicy, fully_shard
from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy
from fsdp_rs.runtime.comm.streams import CommStreams
from fsdp_rs.runtime.group.param_group import FSDPParamGroup

sys.path.insert(0, str(Path(__file__).parent))
from stream_sim import RaceChecker, SimDevice, simulated_streams

STEPS = 3

CONFIGS: dict[str, dict] = {
    "plain": {},
    "bf16": {"mp": True},
    "no_reshard": {"kwargs": {"reshard_after_forward": False}},
    "reshard_int": {"world": 4, "kwargs": {"reshard_after_forward": 2}},
    "hsdp": {"world": 4, "hsdp": True},
    "hsdp_bf16_partial_all_reduce": {"world": 4, "hsdp": True, "mp": True, "micro": 2},
    "prefetch": {"prefetch": True},
    "accumulate_no_sync": {"micro": 2},
    "all_reduce_hook_stream": {"hook": True},
    "post_optim_event": {"post_optim_event": True},
    "unshard_api": {"unshard_api": True},
    "one_rank": {"world": 1},
    "mixed_dtypes_one_root_group": {"mixed": True, "mp": True, "root_only": True},
    # a root parameter with no gradient here that another rank had one for: its
    # .grad is assigned after the agreement ([Note: Gradient agreement])
    "partial_grads": {"partial": True},
    # set_reduce_scatter_max_input_buffers(2): two inputs in flight, released in order
    "two_reduce_scatter_inputs": {"world": 4, "rs_buffers": 2},
    # [Note: Manual backward finalization]: the root's reduction at finalize_backward();
    # micro-steps without sync reduced there, the end of the iteration at wait()
    "manual_finalization": {"manual": "sync"},
    "manual_accumulate_async": {"manual": "async", "micro": 2, "mp": True},
    "keep_unsharded_storage": {"keep": True},
    # [Note: Gradient dtype policy] (torch >= 2.15): a bf16 model whose weights
    # keep fp32 gradients (two groups per layer, reduced in fp32), with no sync
    "grad_dtype_weights_no_sync": {"grad_dtype": True, "micro": 2},
    "grad_dtype_weights_hsdp": {"grad_dtype": True, "world": 4, "hsdp": True},
}


def _groups(model: nn.Module) -> list[FSDPParamGroup]:
    states = {id(s): s for m in model.modules() if (s := getattr(m, "_fsdp_rs_state", None))}
    groups = [s.group for s in states.values() if s.group is not None]
    return [g for group in groups for g in getattr(group, "groups", (group,))]


def train(config: dict, device: SimDevice, checker: RaceChecker) -> None:
    world = config.get("world", 2)
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        _train(config, device, checker, world)
    finally:
        dist.destroy_process_group()


def _train(config: dict, device: SimDevice, checker: RaceChecker, world: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.Linear(7, 5))
    kwargs = dict(config.get("kwargs", {}))
    if config.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    # The CPU mesh stays explicit: the default one is on the GPU whenever one is
    # present, and the simulated device stands in for its streams here.
    if config.get("hsdp"):
        names = ("replicate", "shard")
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
    else:
        kwargs["mesh"] = init_device_mesh("cpu", (world,))
    layers = [model[0], model[2], model[3]]
    if config.get("partial"):
        model.unused = nn.Parameter(torch.randn(3, 3))  # not read: no gradient on this rank
    if config.get("mixed"):
        model[2].to(torch.bfloat16)  # with mp: one group per dtype under the root
    if config.get("grad_dtype"):
        model.to(torch.bfloat16)
        for p in model.parameters():
            if p.ndim == 2:
                p.grad_dtype = torch.float32
    if config.get("root_only"):
        layers = []
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for group in _groups(model):
        group.preplace_grads = False  # what an accelerator does ([Note: Pre-placed gradients])
    if config.get("prefetch"):
        for a, b in itertools.pairwise(layers):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    manual = config.get("manual")
    if manual:
        model.set_manual_backward_finalization(True)
    if config.get("keep"):
        model.set_keep_unsharded_storage(True)
    if config.get("rs_buffers"):
        model.set_reduce_scatter_max_input_buffers(config["rs_buffers"])
    if config.get("hook"):
        hook_stream = device.Stream()
        for module in [*layers, model]:
            module.set_all_reduce_hook(lambda grads: grads.mul_(1.0), stream=hook_stream)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dtype = torch.float32
    if config.get("grad_dtype"):  # AdamW refuses gradients of another dtype
        opt, dtype = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), torch.bfloat16
    with torch.no_grad():
        model(torch.randn(1, 16, dtype=dtype))  # lazy init: the side streams exist
    _name_streams(model)
    micro = config.get("micro", 1)
    with checker:
        for step in range(STEPS):
            for k in range(micro):
                last = k == micro - 1
                if manual:  # every micro-step; finalize_backward() reduces
                    model.set_requires_gradient_sync(micro == 1)
                elif config.get("hsdp"):
                    model.set_requires_all_reduce(last)
                else:
                    model.set_requires_gradient_sync(last)
                if config.get("unshard_api"):
                    handle = model[2].unshard(async_op=True)
                    model[0].unshard()
                    handle.wait()
                model(torch.randn(4, 16, dtype=dtype)).float().pow(2).mean().backward()
            if manual:
                model.set_requires_gradient_sync(True)
                if manual == "async":
                    model.finalize_backward(async_op=True).wait()
                else:
                    model.finalize_backward()
            if config.get("partial"):  # another rank had one, so this one has a .grad
                assert model.unused.grad is not None
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
            if config.get("post_optim_event"):
                model.set_post_optim_event(device.current_stream().record_event())
        model.reshard()


def _run(name: str) -> RaceChecker:
    with simulated_streams() as (device, checker), contextlib.ExitStack() as stack:
        if CONFIGS[name].get("partial"):
            stack.enter_context(_another_rank_had_every_gradient())
        train(CONFIGS[name], device, checker)
    return checker


@contextlib.contextmanager
def _another_rank_had_every_gradient():
    """The fake process group's all-reduce leaves its input alone; the flags'
    MAX over a rank that had every gradient is all ones."""
    import fsdp_rs.runtime.checks.agreement as agreement

    def all_reduce(tensor, op=None, group=None):
        tensor.fill_(1)

    real = agreement.dist.all_reduce
    agreement.dist.all_reduce = all_reduce
    try:
        yield
    finally:
        agreement.dist.all_reduce = real


def _name_streams(model: nn.Module) -> None:
    """Name fsdp-rs's side streams for readable reports."""
    streams = _groups(model)[0].streams
    for name in ("copy_in", "all_gather", "reduce_scatter", "all_reduce"):
        getattr(streams, name).name = name
    CHECKED.append(streams)


CHECKED: list[CommStreams] = []


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_races(name):
    if CONFIGS[name].get("grad_dtype") and not fsdp2_has_grad_dtype_policy():
        pytest.skip("this torch's FSDP2 keeps no per-parameter grad_dtype")
    CHECKED.clear()
    checker = _run(name)
    assert checker.violations == []
    config, used, streams = CONFIGS[name], checker.ops_per_stream, CHECKED[0]
    if config.get("world", 2) > 1:  # the checker saw the side streams at work
        assert used[streams.all_gather] > 0 and used[streams.reduce_scatter] > 0, used
    if config.get("mp"):
        assert used[streams.copy_in] > 0, used
    if config.get("hsdp"):
        assert used[streams.all_reduce] > 0, used
    if config.get("hook"):
        ours = {streams.copy_in, streams.all_gather, streams.reduce_scatter, streams.all_reduce}
        assert used[streams.all_reduce] == 0, used  # the hook and post-reduce on the hook's
        assert set(used) - ours - {streams.current()}, used


def _drop_reduce_scatter_inputs(self: CommStreams, keep: int = 0) -> None:
    self._reduce_scatter_inputs = []  # released without the wait


BROKEN = {
    # name: (class, method, replacement, config)
    "all_gather_streams_skip_optimizer": (
        CommStreams,
        "all_gather_streams_wait_current",
        lambda self, event=None: None,
        "bf16",
    ),
    "copy_out_skips_all_gather_event": (CommStreams, "wait_current", lambda s, e: None, "bf16"),
    "all_gather_output_released_early": (
        CommStreams,
        "release_after",
        lambda self, tensors, event, defer: None,
        "bf16",
    ),
    "deferred_release_skips_wait": (
        CommStreams,
        "flush_all_gather",
        lambda self: setattr(self, "_all_gather_releases", []),
        "bf16",
    ),
    "optimizer_skips_post_reduce": (CommStreams, "end_of_backward", lambda self: None, "plain"),
    "reduce_scatter_input_released_early": (
        CommStreams,
        "keep_reduce_scatter_input",
        lambda self, rs_input, event: None,
        "plain",
    ),
    "reduce_scatter_input_released_without_wait": (
        CommStreams,
        "_release_reduce_scatter_inputs",
        _drop_reduce_scatter_inputs,
        "plain",
    ),
    "all_reduce_output_released_early": (
        CommStreams,
        "keep_reduce_output",
        lambda self, group, output, event: None,
        "hsdp",
    ),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_protocol_is_caught(monkeypatch, name):
    cls, method, replacement, config = BROKEN[name]
    monkeypatch.setattr(cls, method, replacement)
    assert _run(config).violations, f"{name}: the checker missed it"


# ------------------------------------------------------------ the checker itself


def test_checker_orders_by_events():
    device = SimDevice()
    side = device.Stream()
    checker = RaceChecker(device)
    with checker:
        x = torch.ones(8)  # compute stream
        with device.stream(side):
            y = x * 2  # reads x with no wait: a race
        assert any("read after write" in v for v in checker.violations)
        checker.violations.clear()
        side.wait_stream(device.current_stream())
        with device.stream(side):
            z = x * 3
            event = side.record_event()
        z.add_(1)  # compute writes z before waiting: a race
        assert any("write after write" in v for v in checker.violations)
        checker.violations.clear()
        device.current_stream().wait_event(event)
        (y + z).sum()
    assert checker.violations == []


def test_checker_applies_the_allocator_rule():
    device = SimDevice()
    side = device.Stream()
    checker = RaceChecker(device)
    with checker:
        x = torch.ones(1 << 16)  # allocated on compute
        side.wait_stream(device.current_stream())
        with device.stream(side):
            y = x.sum()
        del x  # back to compute's pool while the side stream may still read it
        torch.empty(1 << 16)  # compute's next allocation may reuse it
    assert any("reuse of a freed block" in v for v in checker.violations)
    del y
