"""``torch.compile(model, fullgraph=True)`` with fsdp-rs's traced hooks
([Note: Traced hooks]): the whole model in one graph, the all-gathers and
reduce-scatters in it as functional collectives and the copies as
``torch.ops.fsdp_rs`` ops.

Spawned gloo ranks (W = 2, and W = 4 for one aot_eager scenario) train each
scenario of ``fullgraph_scenarios`` for five steps eagerly and compiled
(``fullgraph=True``). Checked per rank:

- compiled equals eager: losses and final parameters bit for bit with the eager
  and aot_eager backends; with inductor to rtol 1e-5 / atol 1e-6 in fp32 and
  rtol 1e-2 / atol 1e-3 in bf16 (as ``test_compile``);
- Dynamo compiles at the first step only (``error_on_recompile`` after it);
- the graphs' operations (aot_eager): each forward all-gathers and copies out
  once per group (``_c10d_functional.all_gather_into_tensor``, ``wait_tensor``,
  ``fsdp_rs.unshard_copy_out``); the backward reduce-scatters once per group
  (``fsdp_rs.reduce_scatter_copy_in_flat``, ``_c10d_functional.reduce_scatter_tensor``,
  ``fsdp_rs.post_reduce``), and with ``reshard_after_forward=True`` gathers
  again while the forward saves no unsharded parameter;
- ranks whose flags differ all raise in ``set_fullgraph_compile``, each rank's
  path named;
- the errors and fallbacks: ``set_fullgraph_compile`` names the groups it cannot
  trace; a flag the traced hooks do not follow makes ``fullgraph=True`` fail
  with the reason; memory no higher than eager (fake process group).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).parent))
from ci_legs import spawned_share
from compile_scenarios import BASE, INDUCTOR_TOLERANCE, LAYERS, sharded_model, tokens
from fullgraph_scenarios import SCENARIOS, cuda_worker, worker
from spawned import read_ranks, spawn_scenarios

WORLD_SIZE = 2
# this CI leg's share of the scenarios at W = 2; all of them outside CI ([Note: CI legs])
W2_SCENARIOS = spawned_share(list(SCENARIOS))
GROUPS = LAYERS + 1  # a group per block and the root's
GATHER = [
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.wait_tensor.default",
    "fsdp_rs.unshard_copy_out.default",
]
REDUCE = [
    "fsdp_rs.reduce_scatter_copy_in.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.wait_tensor.default",
    "fsdp_rs.post_reduce.default",
]
# HSDP: the all-reduce across replicas before the post-reduce
ALL_REDUCE = ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"]


def _expected_ops(spec: dict, world_size: int) -> tuple[list[str], list[str]]:
    """The op sequences a group's forward gather and backward reduction show:
    with HSDP (two replicas) of one shard each, no all-gather or reduce-scatter
    but the all-reduce; of several, both."""
    if world_size == 1:  # nothing to gather or reduce across ranks: the copies
        return GATHER[2:], [REDUCE[0], REDUCE[3]]
    if not spec["hsdp"]:
        return GATHER, REDUCE
    if world_size // 2 == 1:
        return GATHER[2:], [REDUCE[0], *ALL_REDUCE, REDUCE[3]]
    return GATHER, [*REDUCE[:3], *ALL_REDUCE, REDUCE[3]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fullgraph")
    spawn_scenarios(worker, WORLD_SIZE, W2_SCENARIOS, out)
    return read_ranks(out, WORLD_SIZE)


def _count(ops: list[str], sequence: list[str]) -> int:
    """How many times ``sequence`` occurs in ``ops`` as a subsequence, in order
    and without overlap (other ops may come between)."""
    count, k = 0, 0
    for op in ops:
        if op == sequence[k]:
            k += 1
            if k == len(sequence):
                count, k = count + 1, 0
    return count


# torch 2.13's partitioner (not 2.9's, not 2.15's): where a checkpointed block
# holds an op tagged random (SDPA), functionalize_rng_ops appends the saved RNG
# states after the saved opaque values (the parameters' DeviceMesh, which the
# backward needs for their DTensor gradients), so the runtime's slice of saved
# tensors holds the mesh and asserts (README, "torch.compile").
AC_BROKEN = ((2, 13),)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# At W = 4 the reduce-scatter sums more than two ranks: the traced reduction
# must add them in eager's order (its input laid out as eager's), bit for bit.
W4_SCENARIOS = [
    "aot_eager_raf",
    "aot_eager_hsdp",
    "aot_eager_shard1",
    "aot_eager_frozen_hsdp_offload",
]


@pytest.fixture(scope="module")
def results_w4(tmp_path_factory):
    out = tmp_path_factory.mktemp("fullgraph_w4")
    spawn_scenarios(worker, 4, W4_SCENARIOS, out)
    return read_ranks(out, 4)


@pytest.mark.parametrize("name", W2_SCENARIOS)
def test_fullgraph_parity(results, name):
    _check_parity(results, name)


# On a GPU (one NCCL rank): CPU offload copies the shard to the device and the
# reduced gradient back, which the CPU scenarios cannot show; inductor's GPU
# kernels; frozen weights beside trained biases in each group.
CUDA_SCENARIOS = [
    "aot_eager_offload_bf16",
    "inductor_raf",
    "aot_eager_frozen",
    "aot_eager_gathered",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fullgraph_parity_cuda(tmp_path):
    spawn_scenarios(cuda_worker, 1, CUDA_SCENARIOS, tmp_path)
    results = read_ranks(tmp_path, 1)
    for name in CUDA_SCENARIOS:
        _check_parity(results, name)
        if SCENARIOS[name]["backend"] == "aot_eager":
            _check_listing(results, name, 1)


@pytest.mark.parametrize("name", W4_SCENARIOS)
def test_fullgraph_parity_W4(results_w4, name):
    _check_parity(results_w4, name)
    _check_listing(results_w4, name, 4)
    for per_rank in results_w4:  # the last of four ranks differs: all four raise
        assert per_rank["disagreement"]["type"] == "RuntimeError", per_rank["disagreement"]


def _check_parity(results: list[dict], name: str) -> None:
    spec = SCENARIOS[name]
    if spec["rank_used"] or spec["drops"]:  # every rank raises; none waits in a collective
        for per_rank in results:
            assert "got a gradient on some ranks and none on others" in per_rank[name].get(
                "error", ""
            ), per_rank[name]
        return
    for rank, per_rank in enumerate(results):
        result = per_rank[name]
        if spec["ac"] and _torch_version() in AC_BROKEN:
            assert "tensors_saved_with_vc_check" in result.get("error", ""), result
            continue
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["dynamo_graphs"] == compiled["first_step"] >= 1, compiled
        # a parameter nothing used keeps no gradient, as in eager
        if spec["spare"]:
            assert eager["no_grad"] == ["spare", "blocks.0.spare"], eager["no_grad"]
        if spec["frozen"]:  # the blocks' matrices
            assert len(eager["no_grad"]) == 4 * LAYERS, eager["no_grad"]
        assert compiled["no_grad"] == eager["no_grad"], (rank, compiled["no_grad"])
        if spec["backend"] == "inductor":
            tol = INDUCTOR_TOLERANCE[spec["bf16"]]
            torch.testing.assert_close(compiled["losses"], eager["losses"], **tol)
            for a, b in zip(compiled["params"], eager["params"], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **tol)
        else:
            assert compiled["losses"] == eager["losses"], (rank, compiled["losses"])
            assert compiled["params"] == eager["params"], rank


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, s in SCENARIOS.items()
        if n in W2_SCENARIOS
        and s["backend"] == "aot_eager"
        and not s["gathered"]
        and s["nosync"] is None
        and not s["rank_used"]
        and not s["drops"]
    ],
)
def test_fullgraph_graph_listing(results, name):
    """The collectives and copies are in the graphs AOT autograd compiled."""
    spec = SCENARIOS[name]
    if spec["ac"] and _torch_version() in AC_BROKEN:
        pytest.skip("activation checkpointing under traced hooks fails in torch 2.13 (see parity)")
    _check_listing(results, name, WORLD_SIZE)


def _check_listing(results: list[dict], name: str, world_size: int) -> None:
    spec = SCENARIOS[name]
    gather, reduce = _expected_ops(spec, world_size)
    graphs = results[0][name]["compiled"]["graphs"]
    forward = [op for g in graphs if g["kind"] == "forward" for op in g["ops"]]
    backward = [op for g in graphs if g["kind"] == "backward" for op in g["ops"]]
    # with shard1, each fully_shard call has two groups: dim 1's and dim 0's
    groups = GROUPS * (2 if spec["shard1"] else 1)
    # frozen and sharded on dim 1, a block's dim-1 group holds its (frozen)
    # matrices alone: nothing to reduce
    reduced = groups - (LAYERS if spec["frozen"] and spec["shard1"] else 0)
    assert _count(forward, gather) == groups, forward
    assert _count(backward, reduce) == reduced, backward
    # gathered again: a module's groups together, each copied out where its
    # parameters are first read ([Note: Regathered on every rank])
    regathers = {op: backward.count(op) for op in gather if "wait_tensor" not in op}
    assert set(regathers.values()) == {groups if spec["raf"] else 0}, backward
    # Resharding after forward, the forward graph saves no unsharded parameter
    # (it is gathered again); else it keeps them, as eager does.
    saved = sum(g["saves_unsharded"] for g in graphs if g["kind"] == "forward")
    assert (saved == 0) if spec["raf"] else (saved > 0), saved


def test_set_fullgraph_compile_raises_on_every_rank_where_they_disagree(results):
    """Rank 1 has gradient sync off (eager hooks), rank 0 not (traced): both
    raise, naming each rank's path, instead of issuing other collectives."""
    for rank, per_rank in enumerate(results):
        raised = per_rank["disagreement"]
        assert raised["type"] == "RuntimeError", (rank, raised)
        message = raised["message"]
        assert "the ranks would not take the same path" in message, message
        assert "rank 0: traced hooks" in message, message
        assert "rank 1: eager hooks: gradient sync is off" in message, message


def test_set_fullgraph_compile_raises_where_the_ranks_train_different_parameters(results):
    """Rank 1 froze a parameter rank 0 trains: both raise, naming it with each
    rank's requires_grad, instead of reducing in other layouts."""
    for rank, per_rank in enumerate(results):
        raised = per_rank["trains_disagreement"]
        assert raised["type"] == "RuntimeError", (rank, raised)
        message = raised["message"]
        assert "the ranks train different parameters" in message, message
        named = f"requires_grad of {raised['param']} is rank 0: True, rank 1: False."
        assert named in message, message


def _model(world_size: int, **spec):
    from fsdp_rs import MixedPrecisionPolicy, fully_shard

    return sharded_model({**BASE, **spec}, fully_shard, MixedPrecisionPolicy, world_size)


def test_set_fullgraph_compile_refuses_what_it_cannot_trace(fake_pg):
    from fsdp_rs import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard([model[0], model[1]])  # the root: several modules
    with pytest.raises(ValueError, match="is the root and shards several modules"):
        model[0].set_fullgraph_compile()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard([model[0], model[1]])
    fully_shard(model)  # what the message asks for: their parent is the root
    model.set_fullgraph_compile()
    from extension_scenarios import PairV1

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].weight = torch.nn.Parameter(PairV1(model[0].weight.detach(), model[0].weight.detach()))
    fully_shard(model[0])
    fully_shard(model)
    # [Note: Extensions under trace] an extension whose class is rebuilt as
    # another by __tensor_unflatten__, or set on a plain local tensor
    with pytest.raises(
        ValueError, match=r"Linear: PairV1\.__tensor_unflatten__ .* makes a TwoTensor"
    ):
        model.set_fullgraph_compile()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    local = model[0].weight._local_tensor
    local.fsdp_pre_all_gather = lambda mesh: ((local,), None)
    local.fsdp_post_all_gather = lambda outputs, metadata, dtype, out=None: (outputs[0], ())
    with pytest.raises(ValueError, match="weight is set on its local tensor"):
        model.set_fullgraph_compile()
    from extension_scenarios import PairKept

    class Unrebuildable(PairKept):
        @staticmethod
        def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
            raise RuntimeError("no")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    weight = model[0].weight.detach()
    model[0].weight = torch.nn.Parameter(Unrebuildable(weight, weight.clone()))
    fully_shard(model[0])
    fully_shard(model)
    with pytest.raises(ValueError, match="__tensor_flatten__ raised RuntimeError: no"):
        model.set_fullgraph_compile()
    model = _model(fake_pg)
    model.set_fullgraph_compile()  # the root now: a nested module is not one
    with pytest.raises(ValueError, match="must be called on the root"):
        model.blocks[0].set_fullgraph_compile()
    with pytest.raises(TypeError, match="takes a bool for enabled"):
        model.set_fullgraph_compile("yes")


def test_set_fullgraph_compile_takes_groups_sharded_on_dim_1(fake_pg):
    """The shard1 scenario's model: its matrices are sharded on dim 1 (in a
    ShardDimGroup per fully_shard call, beside the plain group of its vectors)
    and the traced hooks take them, with the chunk table the eager copies use."""
    from fsdp_rs.runtime.variants.shard_dim import ShardDimGroup

    model = _model(fake_pg, shard1=True)
    placements = {n: p.placements for n, p in model.named_parameters()}
    assert placements["blocks.0.mlp.0.weight"] == (Shard(1),), placements
    assert placements["norm.weight"] == (Shard(0),), placements
    model.set_fullgraph_compile()
    states = [model._state, *(block._state for block in model.blocks)]
    for state in states:
        kinds = sorted(type(t.group).__name__ for t in state.traced_groups)
        assert kinds == ["FSDPParamGroup", "ShardDimGroup"], kinds
        for traced in state.traced_groups:
            dim1 = isinstance(traced.group, ShardDimGroup)
            assert (traced.chunk_numel is not None) == dim1


def test_fullgraph_names_a_flag_it_does_not_follow(fake_pg):
    """Gradient sync off: the traced hooks cannot accumulate without reducing, so
    the hooks run eager and fullgraph=True says why."""
    model = _model(fake_pg, loop=False)
    model.set_fullgraph_compile()
    model.set_requires_gradient_sync(False)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="gradient sync is off"):
        compiled(tokens(0, 0))


@pytest.mark.parametrize(
    "setting",
    [
        ("set_manual_backward_finalization", "backward finalization is manual"),
        ("set_keep_unsharded_storage", "keeps its unsharded storage"),
    ],
)
def test_fullgraph_names_manual_finalization_and_kept_storage(fake_pg, setting):
    """Manual backward finalization (the traced reductions have no end of
    backward to defer) and kept unsharded storage (the traced gathers make
    fresh parameters): the hooks run eager and fullgraph=True says why."""
    method, words = setting
    model = _model(fake_pg, loop=False)
    model.set_fullgraph_compile()
    getattr(model, method)(True)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=words):
        compiled(tokens(0, 0))


def test_fullgraph_names_all_reduce_off(fake_pg):
    """HSDP with the all-reduce across replicas off: the gradients stay partial
    until a later backward, which the traced hooks cannot do, so they run eager
    and fullgraph=True says why."""
    model = _model(fake_pg, loop=False, hsdp=True)
    model.set_fullgraph_compile()
    model.set_requires_all_reduce(False)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="all-reduce across replicas is off"):
        compiled(tokens(0, 0))


def test_fullgraph_off_again_is_level_one(fake_pg):
    """set_fullgraph_compile(False) restores the eager hooks: fullgraph=True
    fails at the first hook as before, and the root's forward is its own."""
    model = _model(fake_pg, loop=False)
    model.set_fullgraph_compile()
    assert "forward" in vars(model)
    model.set_fullgraph_compile(False)
    assert "forward" not in vars(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="set_fullgraph_compile"):
        compiled(tokens(0, 0))


@pytest.fixture
def one_gloo_rank():
    """One gloo rank in this process (a fake process group moves no data)."""
    from torch.distributed import HashStore

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fullgraph_eager_calls_stay_eager(one_gloo_rank):
    """With traced hooks on, calling the model without compile runs the eager
    state machine: same losses and gradients as a model without them, bit for
    bit."""
    runs = []
    for traced in (False, True):
        model = _model(1, loop=False)
        if traced:
            model.set_fullgraph_compile()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            loss = model(tokens(step, 0)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        # the eager unshard made the unsharded parameters (traced hooks never do)
        assert model.blocks[0]._state.group.unsharded_params is not None
        runs.append((losses, grads))
    assert runs[0][0] == runs[1][0]
    assert all(map(torch.equal, runs[0][1], runs[1][1]))


def test_fullgraph_computes_no_gradient_for_frozen_parameters(one_gloo_rank):
    """Frozen weights beside trained biases in each group: the backward graph
    computes no gradient for the frozen weights (one matmul, the second
    layer's input gradient, against three with every weight trained), and
    they get none. Freezing another parameter after set_fullgraph_compile()
    makes fullgraph=True name the change."""
    from torch._dynamo.backends.common import aot_autograd

    from fsdp_rs import fully_shard

    def backward_matmuls(frozen: bool) -> tuple[int, list[bool]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            layer.weight.requires_grad_(not frozen)
            fully_shard(layer)
        fully_shard(model)
        counts = []

        def backward(gm, example_inputs):
            ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            counts.append(sum("mm" in op for op in ops))
            return gm

        torch._dynamo.reset()
        model.set_fullgraph_compile()
        backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward)
        run = torch.compile(model, backend=backend, fullgraph=True)
        run(torch.randn(4, 8)).sum().backward()
        if frozen:
            model[0].bias.requires_grad_(False)
            with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad changed"):
                run(torch.randn(4, 8))
        return counts, [p.grad is None for p in model.parameters()]

    assert backward_matmuls(False) == ([3], [False] * 4)
    assert backward_matmuls(True) == ([1], [True, False, True, False])


def test_fullgraph_casts_float_inputs(one_gloo_rank):
    """Mixed precision casts a float input under traced hooks too (the cast
    rebuilds the argument containers, which Dynamo must trace): compiled equals
    eager bit for bit."""
    from fsdp_rs import MixedPrecisionPolicy, fully_shard
    from fsdp_rs.runtime.api.policies import fsdp2_has_grad_dtype_policy

    runs = []
    for traced in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.RMSNorm(8), torch.nn.Linear(8, 8)
        )
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        fully_shard(model[0], mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        run = model
        if traced:
            torch._dynamo.reset()
            run = _traced(model, "aot_eager")
        losses = []
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = run(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, [p.grad.to_local() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    # [Note: Gradients under trace are in the parameter dtype]: on torch >= 2.15
    # eager reduces RMSNorm's fp32 weight gradient as it is
    for i, (a, b) in enumerate(zip(runs[0][1], runs[1][1], strict=True)):
        if i == 2 and fsdp2_has_grad_dtype_policy():
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(a, b), i


def _traced(model, backend):
    model.set_fullgraph_compile()
    return torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.parametrize(
    "config",
    [
        {"backend": "aot_eager", "loop": False},
        {"backend": "aot_eager", "bf16": True, "raf": False},
        {"backend": "inductor", "loop": False},
        {"backend": "aot_eager", "loop": False, "gathered": True},
    ],
    ids=["aot_eager_raf", "aot_eager_bf16_noraf", "inductor_raf", "aot_eager_raf_extension"],
)
def test_fullgraph_memory_not_above_eager(fake_pg, config):
    """Bytes held after forward and at the step's peak, compiled with traced
    hooks against eager fsdp-rs ([Note: Measuring memory under compile])."""
    from compile_scenarios import step_memory

    spec = {**BASE, **config}
    _, *eager = step_memory(spec, fake_pg, None)
    graphs, *compiled = step_memory(spec, fake_pg, _traced)
    assert graphs >= 1, f"{config}: nothing was compiled"
    # Measured, compiled against eager, after forward / peak, B (torch 2.9.1,
    # 2.13 and 2.15, 2026-11-29): aot_eager with resharding equal, 66,388 /
    # 87,704; aot_eager bf16 without resharding 44,356 / 76,400 against 44,916 /
    # 79,072 (2.9.1: 77,528 against 77,536 at the peak); inductor with
    # resharding 65,956 / 87,272 against 66,388 / 87,704 (2.9.1: 87,480); the
    # blocks' matrices all-gathered by an extension ([Note: Extensions under
    # trace]), aot_eager with resharding 66,388 / 87,704 against 66,388 / 89,880.
    # Held to 1% of eager, not the project's +1 MiB floor, under which this toy
    # model hides a lot: a copy-out that made index temporaries inside the
    # backward graph once put the peak 21% above eager here.
    slack = eager[1] // 100
    for phase, a, b in zip(("after forward", "peak"), compiled, eager, strict=True):
        assert 0 < a <= b + slack, f"{config}: {phase}: {a} B compiled, {b} B eager"
