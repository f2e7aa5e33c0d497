"""``fsdp_rs.predict_memory`` and ``fsdp_rs.activation_profile``: the
per-group inputs they read from a sharded model and the errors they raise.
(That the prediction is within 5% of the measured peak: ``test_memory.py``.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_rs
from fsdp_rs import ActivationProfile, Activations, activation_profile, fully_shard, predict_memory
from fsdp_rs.planning import reference
from fsdp_rs.runtime.group.params import state_of
from fsdp_rs.runtime.memory.memory_plan import group_memory


@pytest.fixture
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield init_device_mesh("cpu", (4,))
    dist.destroy_process_group()


def _mlp(dim: int = 64, layers: int = 3, device: str = "cpu") -> nn.Sequential:
    with torch.device(device):
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)]
        )


def test_activation_profile_counts_each_storage_once_per_block():
    model = _mlp(layers=3, device="meta")
    x = torch.empty(8, 64, device="meta")
    got = activation_profile(model, list(model), x)
    # Block 0's Linear saves the input (not counted) and its ReLU its output; the
    # next Linear saves that same output again (counted once, for block 0).
    one = Activations(8 * 64 * 4, 8 * 64 * 4)
    assert got == ActivationProfile({k: one for k in ("0", "1", "2")}, 0)
    with torch.no_grad():
        none = activation_profile(model, list(model), x)
    assert none == ActivationProfile({k: Activations(0, 0) for k in ("0", "1", "2")}, 0)
    # Hooks are gone afterwards.
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_activation_profile_innermost_block_and_root():
    model = _mlp(layers=2, device="meta")
    x = torch.empty(4, 64, device="meta", requires_grad=True)
    got = activation_profile(model, [model, model[1]], x).blocks
    # The root gets what block 1 does not claim (block 0's ReLU output).
    one = Activations(4 * 64 * 4, 4 * 64 * 4)
    assert got == {"": one, "1": one}
    with pytest.raises(ValueError, match="submodules"):
        activation_profile(model, [nn.Linear(1, 1)], x)


def test_activation_profile_of_the_loss():
    """``loss``: from the outputs to the first block's backward, the peak of what
    the loss and the backward hold, the outputs included; the same on a fake
    CPU copy and a meta one for a model whose kernels do not depend on the
    device; nothing allocated."""
    logits = 8 * 1000 * 4

    def build(device: str):
        with torch.device(device):
            model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1000))
        return model, torch.empty(8, 64, device=device)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    model, x = build("meta")
    blocks = [model[0]]
    got = activation_profile(model, blocks, x, loss_fn=loss_fn)
    # The logits (not saved by a block), pow's output and its gradient at least;
    # model[2] runs its backward in this window too (a 8x64 input gradient and
    # the weight gradients, 1000x64 + 1000 floats).
    assert 3 * logits <= got.loss <= 6 * logits + 4 * (1000 * 64 + 1000 + 8 * 64)
    # model[0] saves only the input (not counted); the ReLU after it is no block's.
    # Its backward holds the gradient flowing in and its weight's and bias's
    # (the input needs none), until the backward ends.
    assert got.blocks == {"0": Activations(0, 8 * 64 * 4, 8 * 64 * 4 + 4 * (64 * 64 + 64))}
    assert activation_profile(model, blocks, x).loss == 0
    with FakeTensorMode():
        model, x = build("cpu")
        assert activation_profile(model, [model[0]], x, loss_fn=loss_fn) == got


def test_activation_profile_of_the_outermost_module():
    """[Note: The outermost module's saved bytes] What the root saves after its
    blocks is freed in the loss's backward: it counts with the loss, not as
    the root's activations; what it saves before them stays its own."""
    width = 8 * 64 * 4

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1000))
    x = torch.empty(8, 64, device="meta")
    alone = activation_profile(model, [model[0]], x, loss_fn=loss_fn)
    got = activation_profile(model, [model[0], model], x, loss_fn=loss_fn)
    # the GELU's input and the head's input, saved after the block, freed first
    assert got.blocks[""].saved == 0
    assert got.loss == alone.loss + 2 * width
    assert got.blocks["0"] == alone.blocks["0"]
    # The backward runs as after zero_grad(): a .grad the model holds is set
    # aside (not added to) and put back.
    held = torch.empty(1000, device="meta")
    model[2].bias.grad = held
    assert activation_profile(model, [model[0], model], x, loss_fn=loss_fn) == got
    assert model[2].bias.grad is held and model[0].weight.grad is None
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    got = activation_profile(model, [model[2], model], x, loss_fn=loss_fn)
    # the GELU's input, saved before the block and freed after its backward
    assert got.blocks[""].saved == width
    assert got.blocks["2"].saved == width  # its input, the GELU's output


def test_activation_profile_of_each_block_backward():
    """``backward``: the most a block's backward holds at once, from the
    gradient of its outputs to that of its inputs; the same on every torch."""
    with torch.device("meta"):
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(2)]
        )
    x = torch.empty(8, 64, device="meta")
    hidden, width = 8 * 256 * 4, 8 * 64 * 4  # one activation of each width

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    got = activation_profile(model, list(model), x, loss_fn=loss_fn).blocks["1"]
    # Saved: the input (block 0's output) and the GELU's input and output.
    assert got.saved == width + 2 * hidden and got.output == width
    # The peak is the first Linear's backward: every weight and bias gradient,
    # the input gradient it makes, its own saved input and the gradient it reads.
    grads = 4 * (2 * 64 * 256 + 256 + 64)
    assert got.backward == grads + width + width + hidden
    for p in model.parameters():
        p.requires_grad_(p.ndim == 1)  # LoRA's shape: matrices frozen
    got = activation_profile(model, list(model), x, loss_fn=loss_fn).blocks["1"]
    # Only the GELU's input is saved; the peak is the GELU's backward: its saved
    # input, the gradient it reads and the one it makes (beside the second
    # bias's gradient), above what the saved bytes and output alone would say.
    assert got.saved == hidden and got.output == width
    assert got.backward == 3 * hidden + 4 * 64
    assert got.backward > got.saved + got.output


def test_group_memory_reads_the_plans(mesh):
    model = _mlp(layers=3)
    model[0][0].weight.requires_grad_(False)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[1], mesh=mesh, reshard_after_forward=False)
    fully_shard(model[2], mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    columns = group_memory(model)
    assert columns["fqns"] == [("0",), ("1",), ("2",)]  # the root has no parameters
    assert columns["reshard_after_forward"] == [True, False, True]
    padded = 64 * 64 + 64  # both divide by 4: no padding
    assert columns["all_gather_bytes"] == [4 * padded] * 3
    assert columns["sharded_bytes"] == [padded] * 3
    # Only block 0's bias trains: its gradients are 64 floats, a quarter each rank.
    assert columns["unsharded_gradient_bytes"] == [4 * 64, 4 * padded, 4 * padded]
    assert columns["gradient_bytes"] == [64, padded, padded]
    # reshard_after_forward=2 on 4 ranks keeps half of the rows.
    assert columns["post_forward_bytes"] == [0, 0, 2 * padded]


def _reference(model: nn.Module, **inputs) -> dict[str, int]:
    """The reference memory model on ``model``'s group columns and ``inputs``,
    without side streams (CPU)."""
    columns = group_memory(model)
    del columns["fqns"], columns["kept_unsharded_bytes"]
    required = ("sharded_bytes", "all_gather_bytes", "unsharded_bytes")
    required += ("reduce_scatter_input_bytes", "reduce_scatter_output_bytes")
    args = [columns.pop(k) for k in required]
    return reference.peak_memory(*args, side_streams=False, **columns, **inputs)


def test_predict_memory_is_the_planner_on_those_inputs(mesh):
    model = _mlp(layers=3)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acts = {"0": Activations(100, 10), "1": 200, "2": Activations(300, 30)}
    got = predict_memory(model, activations=acts, resident_bytes=7, accumulate=True)
    profile = ActivationProfile({"0": Activations(100, 10), "1": Activations(200, 0)}, 55)
    with_loss = predict_memory(model, activations=profile)
    want = _reference(
        model,
        activation_bytes=[100, 200, 300],
        output_bytes=[10, 0, 30],
        resident_bytes=7,
        accumulate=True,
    )
    assert got == want
    assert got["persistent"] == 3 * (64 * 64 + 64) + 7
    # An ActivationProfile's loss bytes go to the planner's loss_bytes.
    assert with_loss == _reference(
        model, activation_bytes=[100, 200, 0], output_bytes=[10, 0, 0], loss_bytes=55
    )
    # A block's measured backward goes to the planner's backward_bytes.
    measured = predict_memory(model, activations={"1": Activations(200, 0, 50_000)})
    assert measured == _reference(
        model, activation_bytes=[0, 200, 0], backward_bytes=[0, 50_000, 0]
    )
    assert measured["backward"] > predict_memory(model, activations={"1": 200})["backward"]
    # Activations of the root (a fully_shard module without parameters) are
    # live for the whole step.
    more = predict_memory(model, activations={"": 1000})
    assert more["persistent"] == predict_memory(model)["persistent"] + 1000


def test_predict_memory_of_a_group_of_several_modules(mesh):
    """One fully_shard call over two modules: while one runs its backward the
    other's saved bytes count too; one module not measured, none is used."""
    model = _mlp(layers=3)
    fully_shard([model[0], model[1]], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert group_memory(model)["fqns"] == [("",), ("0", "1")]  # the root (model[2]) first

    def planner(backward: list[int]) -> dict[str, int]:
        return _reference(model, activation_bytes=[0, 300], backward_bytes=backward)

    # module 0's backward holds 100_000 (100 saved), module 1's 70_000 (200
    # saved): the group's is its 300 saved bytes and the larger excess, 99_900.
    both = {"0": Activations(100, 0, 100_000), "1": Activations(200, 0, 70_000)}
    got = predict_memory(model, activations=both)
    assert got == planner([0, 100_200])
    assert got != planner([0, 0])
    assert predict_memory(model, activations={**both, "1": Activations(200, 0)}) == planner([0, 0])


def test_predict_memory_before_and_after_the_first_step_agree(mesh):
    model = _mlp(layers=2)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = predict_memory(model)
    model(torch.randn(2, 64)).sum().backward()
    assert predict_memory(model) == before


def test_predict_memory_with_kept_unsharded_storage(mesh):
    """set_keep_unsharded_storage(True): the kept groups' unsharded bytes are
    live for the whole step, and gathering them allocates nothing more."""
    model = _mlp(layers=3)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = predict_memory(model)
    model[1].set_keep_unsharded_storage(True)
    columns = group_memory(model)
    padded = 64 * 64 + 64
    assert columns["kept_unsharded_bytes"] == [0, 4 * padded, 0]
    assert columns["unsharded_bytes"] == [4 * padded, 0, 4 * padded]
    kept = predict_memory(model)
    assert kept["persistent"] == before["persistent"] + 4 * padded
    assert kept["peak"] >= before["peak"]
    model.set_keep_unsharded_storage(False)
    assert predict_memory(model) == before


def test_predict_memory_on_meta(mesh):
    """Nothing allocated: a model sharded on the meta device is predicted too."""
    model = _mlp(layers=2, device="meta")
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    on_cpu = _mlp(layers=2)
    for block in on_cpu:
        fully_shard(block, mesh=mesh)
    fully_shard(on_cpu, mesh=mesh)
    assert predict_memory(model) == predict_memory(on_cpu)


def test_predict_memory_rejects_bad_input(mesh):
    with pytest.raises(ValueError, match=r"not sharded with fsdp_rs\.fully_shard"):
        predict_memory(_mlp())
    with pytest.raises(TypeError, match=r"nn\.Module"):
        predict_memory("model")
    model = _mlp(layers=2)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match=r"'0\.0', which is not a fully_shard module"):
        predict_memory(model, activations={"0.0": 4})
    with pytest.raises(ValueError, match=r"activations\['0'\] must be an int >= 0"):
        predict_memory(model, activations={"0": -1})
    with pytest.raises(ValueError, match=r"activations\['1'\]"):
        predict_memory(model, activations={"1": Activations(1, -1)})
    with pytest.raises(ValueError, match="resident_bytes"):
        predict_memory(model, resident_bytes=-1)


def test_exported():
    assert fsdp_rs.predict_memory is predict_memory
    assert fsdp_rs.activation_profile is activation_profile
    assert fsdp_rs.Activations is Activations
    assert fsdp_rs.ActivationProfile is ActivationProfile


def test_group_memory_sums_a_module_of_several_dtypes(mesh):
    """One fully_shard call over fp32 and bf16 parameters: one group per dtype
    driven as one, one entry holding both."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64).to(torch.bfloat16))
    fully_shard(model, mesh=mesh)
    columns = group_memory(model)
    numel = 64 * 64 + 64
    assert columns["fqns"] == [("",)]
    assert columns["sharded_bytes"] == [numel * 4 // 4 + numel * 2 // 4]
    assert columns["unsharded_gradient_bytes"] == [numel * 4 + numel * 2]
    # they reduce in turn, the bf16 group last: its input is what stays held
    last = state_of(model).group.groups[-1]
    assert last.orig_dtype == torch.bfloat16
    kept = last.grad_layout.plan.reduce_scatter_input_bytes
    assert columns["reduce_scatter_kept_bytes"] == [kept]
    assert kept < columns["reduce_scatter_input_bytes"][0]


def test_group_bytes_with_cpu_offload_leave_the_host_out():
    """On an accelerator with CPU offload, the sharded parameters and gradients
    are on the host: the device's bytes leave them out (on CPU, offload moves
    nothing). A stand-in group, as no accelerator is needed to check the rule."""
    from types import SimpleNamespace

    from fsdp_rs.runtime.memory.memory_plan import _group_bytes

    plan = fsdp_rs.plan_group(np.array([2], dtype=np.int64), np.array([8, 4], dtype=np.int64), 4, 0)
    layout = SimpleNamespace(plan=plan)

    def group(device: str, shard_device: str):
        return SimpleNamespace(
            plan=plan,
            grad_layout=layout,
            requires_grad=[True],
            device=torch.device(device),
            shard_device=torch.device(shard_device),
            keep_unsharded_storage=False,
            grad_dtype=torch.float32,  # the plan's (default) 4-byte dtypes
            accumulate_dtype=torch.float32,
        )

    on_device = _group_bytes(group("cuda", "cuda"), True, 0)
    offloaded = _group_bytes(group("cuda", "cpu"), True, 0)
    assert on_device["sharded_bytes"] == on_device["gradient_bytes"] == plan.sharded_bytes > 0
    assert offloaded["sharded_bytes"] == offloaded["gradient_bytes"] == 0
    assert {k: v for k, v in offloaded.items() if k not in ("sharded_bytes", "gradient_bytes")} == {
        k: v for k, v in on_device.items() if k not in ("sharded_bytes", "gradient_bytes")
    }
