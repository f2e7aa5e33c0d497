"""fully_shard in one process: API surface, state machine, state dict, meta
init and bad input. A world-size-1 gloo group makes collectives real (and
trivial); a fake process group (W = 2) checks the metadata other ranks see."""

from __future__ import annotations

import gc
import socket
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_rs
from fsdp_rs import FSDPModule, fully_shard
from fsdp_rs.runtime.group.gradients import GradientReduction
from fsdp_rs.runtime.group.param_group import ShardedState


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _cpu_default_mesh(monkeypatch):
    """These tests shard CPU modules over gloo and fake groups without a mesh;
    next to a GPU the default mesh (as FSDP2's) would be CUDA's."""
    monkeypatch.setattr(fsdp_rs.runtime.comm.mesh, "default_device_type", lambda: "cpu")


@pytest.fixture
def gloo1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fake2():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def shard(model: nn.Module, **kwargs) -> nn.Module:
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    return fully_shard(model, **kwargs)


def test_class_swap_and_dtensor_params(fake2):
    model = shard(mlp())
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPSequential"
    assert isinstance(model[0], nn.Linear) and isinstance(model[0], FSDPModule)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),)
    # rank 1 of 2 holds rows [4, 7) of a 7-row weight: 3 rows, as torch.chunk gives
    assert model[0].weight.to_local().shape == (3, 5)
    assert model[0].weight.shape == (7, 5)
    assert model[2].weight.to_local().shape == (1, 7)


def test_unshard_reshard_and_state_dict_round_trip(gloo1):
    reference = mlp()
    model = shard(mlp())
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), reference.get_parameter(name))
    handle = model[0].unshard(async_op=True)
    handle.wait()
    group = model[0]._state.group
    assert group.state == ShardedState.UNSHARDED
    assert not isinstance(model[0].weight, DTensor)
    assert torch.equal(model[0].weight, reference[0].weight)
    model[0].reshard()
    assert group.state == ShardedState.SHARDED and isinstance(model[0].weight, DTensor)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(isinstance(v, DTensor) for v in state.values())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(state)
    # load_state_dict copies into the existing DTensors: the group buffer
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), reference.get_parameter(name))
    assert torch.equal(model(torch.ones(2, 5)), reference(torch.ones(2, 5)))


def test_meta_init_then_to_empty_and_reset(gloo1):
    with torch.device("meta"):
        model = mlp()
    shard(model)
    # FSDP2's message, naming the first group's parameters under the root
    expected = (
        "FSDP parameters should be materialized from meta device before training, but the "
        r"following were still on meta device: \['0.weight', '0.bias'\]"
    )
    with pytest.raises(RuntimeError, match=expected):
        model(torch.ones(2, 5))
    model[0].to_empty(device="cpu")  # one group materialized, the next one named
    with pytest.raises(RuntimeError, match=r"still on meta device: \['2.weight', '2.bias'\]"):
        model(torch.ones(2, 5))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    reference = mlp()
    out = model(torch.ones(2, 5))
    assert torch.equal(out, reference(torch.ones(2, 5)))
    out.sum().backward()
    for p in model.parameters():
        assert isinstance(p.grad, DTensor)


def test_load_state_dict_assign(gloo1):
    reference = mlp()
    model = shard(mlp())
    other = shard(mlp())
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    model.load_state_dict(other.state_dict(), assign=True)
    out = model(torch.ones(1, 5))
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(2)
    assert torch.equal(out, reference(torch.ones(1, 5)))


class Branchy(nn.Module):
    """``b`` is used only when asked; ``a`` is used twice (two gradient
    contributions in one backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.a(self.a(x))
        return self.b(x) if use_b else x


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.full_tensor()
        if isinstance(p.grad, DTensor) else p.grad.clone()
        for name, p in model.named_parameters()
    }  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")
@pytest.mark.parametrize("preplace", ["always", "when_it_fits"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gradients_match_autograd(gloo1, reshard_after_forward, preplace, monkeypatch):
    """Every way gradients reach a group (see [Note: Pre-placed gradients]): a
    param without a gradient keeps ``.grad`` None; two contributions in one
    backward; accumulation over backwards with and without gradient sync;
    ``create_graph=True``, where autograd replaces the pre-placed ``.grad``.
    With one rank the first backward's gradients equal plain autograd's bit for
    bit; accumulated ones differ by summation order only. ``always`` forces the
    pre-placed buffer where the memory rule ([Note: Reduction memory]) would
    take autograd's gradients, so both paths stay covered."""
    if preplace == "always":
        monkeypatch.setattr(GradientReduction, "_preplace_fits", lambda self: True)
    reference = Branchy()
    model = Branchy()
    fully_shard(model.a, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    x = torch.randn(3, 5)

    def step(m, use_b, create_graph=False, sync=True):
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(sync)
        m(x, use_b).pow(2).sum().backward(create_graph=create_graph)

    step(reference, False)
    step(model, False)
    expected, actual = _grads(reference), _grads(model)
    assert actual["b.weight"] is None and actual["b.bias"] is None
    for name, g in expected.items():
        assert (g is None and actual[name] is None) or torch.equal(actual[name], g), name
    for use_b, create_graph, sync in [
        (True, False, True),  # accumulate onto existing sharded grads
        (True, False, False),  # no sync: kept unsharded
        (False, True, True),  # replaced .grad, plus the kept accumulation
        (True, False, False),
        (True, False, True),
        (True, True, False),  # kept per gradient, then reduced from the buffer
        (True, False, True),
    ]:
        step(reference, use_b, create_graph)
        step(model, use_b, create_graph, sync)
        if sync:
            expected, actual = _grads(reference), _grads(model)
            for name, g in expected.items():
                assert torch.allclose(actual[name], g, rtol=1e-6, atol=0), name


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(y)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.block = TwoInputs()

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        h = self.lin(x)
        return self.block(h, h.tanh() if both else x)


@pytest.mark.parametrize("both", [False, True], ids=["one-input", "two-inputs"])
def test_post_backward_runs_during_backward(gloo1, monkeypatch, both):
    """A block's gradients are reduced once its backward is done, not at the
    end of the whole backward: through the view pre-hook when one input needs
    a gradient, the autograd function when two do. Gradients equal autograd's."""
    from fsdp_rs.runtime.group.param_group import FSDPParamGroup
    from fsdp_rs.runtime.step.state import FSDPState

    torch.manual_seed(0)
    reference = Stem()
    model = Stem()
    model.load_state_dict(reference.state_dict())
    fully_shard(model.block)
    fully_shard(model)
    ending, calls = [False], []
    post_backward, end = FSDPParamGroup.post_backward, FSDPState._end_of_backward

    def spy_post_backward(group):
        calls.append((group, ending[0]))
        post_backward(group)

    def spy_end(state):
        ending[0] = True
        end(state)

    monkeypatch.setattr(FSDPParamGroup, "post_backward", spy_post_backward)
    monkeypatch.setattr(FSDPState, "_end_of_backward", spy_end)
    x = torch.randn(2, 4)
    model(x, both).sum().backward()
    reference(x, both).sum().backward()
    assert calls == [(model.block._state.group, False), (model._state.group, True)]
    expected, actual = _grads(reference), _grads(model)
    for name, g in expected.items():
        assert torch.equal(actual[name], g), name


def test_setters_reach_every_group(fake2):
    model = shard(mlp())
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    model[0].set_gradient_divide_factor(3.0)  # this module's group only, as FSDP2
    groups = [m._state.group for m in (model[0], model[2])]
    assert all(not g.reduce_grads and not g.reshard_after_backward for g in groups)
    assert [g.gradient_divide_factor for g in groups] == [3.0, None]
    model[0].set_modules_to_forward_prefetch([model[2]])
    with pytest.raises(ValueError, match="not a fully_shard module"):
        model[0].set_modules_to_backward_prefetch([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="takes a bool"):
        model.set_reshard_after_forward(2)


def test_bad_input(fake2):
    model = shard(mlp())
    with pytest.raises(ValueError, match="already passed to fully_shard"):
        fully_shard(model[0])
    with pytest.raises(TypeError, match="DeviceMesh"):
        fully_shard(nn.Linear(2, 2), mesh="cpu")
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(torch.randn(4, 4).t())
    with pytest.raises(NotImplementedError, match="not contiguous"):  # FSDP2's class
        fully_shard(lin)
    with pytest.raises(ValueError, match="must divide the shard world size 2"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=3)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    fully_shard(a)
    fully_shard(b)  # as FSDP2: the shared parameter is refused at the first forward
    tied = fully_shard(nn.Sequential(a, b))
    with pytest.raises(ValueError, match="already managed by another fully_shard group"):
        tied(torch.randn(2, 3))
    with pytest.raises(AssertionError, match="mesh_dim_names"):  # ValueError too
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 2)))
    mixed = nn.Linear(3, 3)
    with torch.device("meta"):
        mixed.bias = nn.Parameter(torch.empty(3))
    with pytest.raises(ValueError, match="different devices"):
        fully_shard(mixed)
    with pytest.raises(AssertionError, match="Shard dim 1 is invalid for 1D tensor"):  # as FSDP2
        fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        fully_shard(nn.Linear(3, 3, bias=False), shard_placement_fn=lambda p: Shard(-1))
    with pytest.raises(ValueError, match="Invalid shard_placement_fn result"):
        fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: 1)
    scalar = nn.Module()
    scalar.s = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="Change s to a 1D tensor"):
        fully_shard(scalar)


def test_public_names():
    for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
                 "CPUOffloadPolicy", "UnshardHandle", "register_fsdp_forward_method",
                 "GradientReductionHandle"):  # fmt: skip
        assert getattr(fsdp_rs, name) is not None


def test_original_parameters_are_released(fake2):
    """fully_shard keeps no reference to the full parameters it replaced, so their
    memory is freed (only the sharded buffer remains)."""
    model = mlp()
    originals = [weakref.ref(p) for p in model.parameters()]
    shard(model)
    gc.collect()
    assert [r() for r in originals] == [None] * len(originals)


def test_gc_state_is_restored(fake2):
    """fully_shard pauses the cyclic GC ([Note: GC during fully_shard]) and leaves
    it as it found it, also when it raises."""
    assert gc.isenabled()
    fully_shard(nn.Linear(2, 2))
    assert gc.isenabled()
    with pytest.raises(TypeError, match=r"an nn\.Module"):
        fully_shard("not a module")
    assert gc.isenabled()
    gc.disable()
    try:
        fully_shard(nn.Linear(2, 2))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_is_last_backward(gloo1):
    """Not the last backward: the forward order (for implicit prefetching) and an
    unshard started but not used survive it; the last backward clears both."""
    model = shard(mlp())
    model[0].requires_grad_(False)  # model[0]'s output needs no gradient: no backward unshard
    group = model[0]._state.group
    x = torch.ones(2, 5)
    for last in (False, True):
        model.set_is_last_backward(last)
        out = model(x)
        model[0].unshard(async_op=True)
        assert group.unshard_pending
        out.sum().backward()
        context = model._state.context
        assert group.unshard_pending == (not last)
        assert bool(context.forward_order) == (not last)
    assert group.state == ShardedState.SHARDED and isinstance(model[0].weight, DTensor)


def test_mixed_dtypes_one_group_per_dtype(gloo1):
    """A module with fp32 and bf16 parameters is sharded as one group per dtype
    ([Note: One group per dtype]); it trains like the plain module (one rank:
    bit for bit), and flags reach both groups."""
    from fsdp_rs.runtime.variants.bundle import GroupBundle

    class Mixed(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self[2](self[1](self[0](x)).to(torch.bfloat16)).float()

    def build() -> nn.Module:
        model = Mixed(*mlp())
        model[2].to(torch.bfloat16)
        return model

    reference, model = build(), build()
    fully_shard(model)
    group = model._fsdp_rs_state.group
    assert isinstance(group, GroupBundle) and len(group.groups) == 2
    assert [g.orig_dtype for g in group.groups] == [torch.float32, torch.bfloat16]
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, DTensor) and p.dtype == q.dtype, name
        assert torch.equal(p.full_tensor(), q), name
    model.set_requires_gradient_sync(False)
    assert all(not g.reduce_grads for g in group.groups)
    model.set_requires_gradient_sync(True)
    x = torch.randn(4, 5)

    reference(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == q.dtype and torch.equal(p.grad.full_tensor(), q.grad), name
    state = model.state_dict()
    assert {k: v.dtype for k, v in state.items()} == {
        k: v.dtype for k, v in reference.state_dict().items()
    }


def test_identical_groups_share_one_layout(fake2):
    """Groups with the same shapes, dtypes and mesh place share one plan and one
    set of tables ([Note: Shared group layouts]); others get their own, and a
    layout goes with the last group using it."""
    from fsdp_rs.runtime.group.layout import _LAYOUTS

    def blocks() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.Linear(5, 7), nn.Linear(7, 5))

    model = blocks()
    for block in model:
        fully_shard(block)
    first, second, third = (block._state.group for block in model)
    assert first.layout is second.layout and first.tables is second.tables
    assert third.layout is not first.layout
    assert first.plan is second.plan
    # each block's shards are still its own data (rank 1 of 2: the second chunk)
    for block, reference in zip(model, blocks(), strict=True):
        for p, q in zip(block.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.to_local(), torch.chunk(q.detach(), 2)[1])
    bf16 = nn.Linear(5, 7).to(torch.bfloat16)
    fully_shard(bf16)
    assert bf16._state.group.layout is not first.layout
    layout = weakref.ref(first.layout)
    del model, first, second, third, block
    gc.collect()
    assert layout() is None
    assert bf16._state.group.layout in _LAYOUTS.values()


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list = []

    def forward(self, batch: dict) -> torch.Tensor:
        self.seen.append(batch)
        return self.lin(batch["x"][0])


def test_root_inputs_on_the_device_pass_as_they_are(gloo1):
    """The root moves forward inputs to its device (as FSDP2); inputs already
    there keep their identity, containers included."""
    from fsdp_rs.runtime.step.containers import elsewhere as _elsewhere

    model = fully_shard(_Recorder())
    batch = {"x": [torch.randn(2, 4)]}
    model(batch).sum().backward()
    assert model.seen[0] is batch
    cpu = torch.device("cpu")
    assert not _elsewhere(((batch,), {}), cpu)
    assert _elsewhere(((), {"y": [torch.empty(1, device="meta")]}), cpu)


def test_containers_walk_and_rebuild_only_what_changed():
    """[Note: Containers]: dataclasses, NamedTuples, dicts, lists are entered;
    untouched containers come back as the same objects."""
    import dataclasses as dc
    from collections import OrderedDict, namedtuple

    from fsdp_rs.runtime.step.containers import map_tensors, tensors_in

    @dc.dataclass
    class D:
        a: torch.Tensor
        b: list

    NT = namedtuple("NT", "x y")
    t1, t2, t3 = torch.ones(1), torch.zeros(2), torch.ones(3, dtype=torch.float64)
    tree = (D(t1, [NT(t2, 5), {t3}]), OrderedDict(k=t3), "s")
    assert [t.shape for t in tensors_in(tree)] == [(1,), (2,), (3,)]  # sets not entered
    same = map_tensors(lambda t: t, tree)
    assert same is tree
    cast = map_tensors(lambda t: t.float() if t.dtype == torch.float64 else t, tree)
    assert (
        cast[0] is tree[0] and type(cast[1]) is OrderedDict and cast[1]["k"].dtype == torch.float32
    )
    doubled = map_tensors(lambda t: t * 2, tree)
    assert isinstance(doubled[0], D) and isinstance(doubled[0].b[0], NT)
    assert torch.equal(doubled[0].b[0].x, t2 * 2) and doubled[0].b[0].y == 5
    loop: list = []
    loop.append(loop)
    with pytest.raises(RuntimeError, match="deeper than"):
        tensors_in(loop)


def test_comm_settings_bad_input(fake2):
    model = shard(mlp())
    with pytest.raises(TypeError, match="max_input_buffers must be an int"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match=">= 1"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="AllGather comm object"):
        model.set_custom_all_gather(object())
    with pytest.raises(ValueError, match="fully_shard returned"):
        fsdp_rs.share_comm_ctx([model, nn.Linear(2, 2)])

    class Comm:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, *args, **kwargs):
            return None

    model[0].set_custom_reduce_scatter(Comm())
    with pytest.raises(RuntimeError, match="custom comm"):
        model[0].set_allocate_memory_from_process_group_for_comm(True)


def test_reset_iter_state_on_a_nested_module_raises(gloo1):
    model = shard(mlp())
    model(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="root fully_shard module"):
        model[0].reset_iter_state()
    model.reset_iter_state()


def test_all_gather_extension_refills_its_unsharded_parameter(gloo1):
    """An all-gather extension's post-all-gather makes the unsharded parameter
    once, then refills that same object (``out=``) at every later unshard,
    as FSDP2 calls it ([Note: All-gather extensions])."""
    outs = []

    def pre(self, mesh):
        return (self * 2,), ("meta", mesh.ndim)

    def post(self, outputs, metadata, param_dtype, *, out=None):
        assert metadata == ("meta", 1)
        outs.append(out)
        (gathered,) = outputs
        if out is not None:
            with torch.no_grad():
                out.copy_(gathered / 2)
            return None
        half = gathered / 2
        return half, (gathered, half)

    model = fully_shard(nn.Linear(4, 4))
    local = model.weight._local_tensor
    local.fsdp_pre_all_gather = pre.__get__(local)
    local.fsdp_post_all_gather = post.__get__(local)
    x = torch.randn(2, 4)
    expected = x @ model.weight.to_local().detach().T + model.bias.to_local().detach()
    for _ in range(2):
        y = model(x)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        y.sum().backward()  # reshards
    assert len(outs) == 2 and outs[0] is None and isinstance(outs[1], nn.Parameter)


def test_all_gather_extension_on_dtensor_parameter_is_refused(gloo1):
    """An extension on a tensor-parallel parameter's local tensor is refused,
    never all-gathered as plain data in its place."""
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))

    class Extended(torch.Tensor):
        def fsdp_pre_all_gather(self, mesh):
            raise AssertionError("not reached")

        def fsdp_post_all_gather(self, *args, **kwargs):
            raise AssertionError("not reached")

    lin = nn.Linear(4, 4, bias=False)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh["tp"], [Shard(0)]))
    lin.weight._local_tensor = lin.weight._local_tensor.as_subclass(Extended)
    with pytest.raises(NotImplementedError, match="weight defines fsdp_pre_all_gather"):
        fully_shard(lin, mesh=mesh["dp"])


def test_misuse_raises_as_fsdp2(fake2):
    """Where FSDP2 raises an AssertionError, fsdp-rs's ValueError is one too."""
    import copy

    model = shard(mlp())
    with pytest.raises(AssertionError, match="can only be applied to a module once"):
        fully_shard(model)
    with pytest.raises(AssertionError, match="does not support deepcopy"):
        copy.deepcopy(model)
    with pytest.raises(ValueError, match="containers that do not implement forward"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match="expects a 1D or 2D DeviceMesh"):
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1, 2)))
    sliced = model[:2]  # constructing the swapped class builds the original one
    assert type(sliced) is nn.Sequential and not isinstance(sliced, FSDPModule)


class _ListWithForward(nn.ModuleList):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


class _DictWithForward(nn.ModuleDict):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["b"](self["a"](x))


@pytest.mark.parametrize("container", [_ListWithForward, _DictWithForward])
def test_container_subclass_with_forward_is_sharded_as_fsdp2(fake2, container) -> None:
    # FSDP2 refuses ModuleList / ModuleDict only where they have no forward
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    if container is _ListWithForward:
        module = container(layers)
    else:
        module = container({"a": layers[0], "b": layers[1]})
    fully_shard(module)
    assert isinstance(module, FSDPModule)
    out = module(torch.randn(2, 4))  # the fake group gathers no values: shapes only
    assert out.shape == (2, 4)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in module.parameters())
