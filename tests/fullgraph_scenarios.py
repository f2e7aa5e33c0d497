"""``torch.compile(..., fullgraph=True)`` of fully_shard models with traced
hooks ([Note: Traced hooks]), run by spawned gloo ranks (CPU).

Each scenario trains the compile scenarios' tied-weight transformer for
``STEPS`` steps twice: fsdp-rs eager (the reference) and fsdp-rs compiled with
``fullgraph=True`` after ``model.set_fullgraph_compile()``. The compiled run
records the operations of every graph AOT autograd compiled (collectives and
``fsdp_rs`` ops, auto-functionalized ones by the op inside), the sizes of the
tensors each forward graph saves for backward, and how many graphs Dynamo
compiled at the first step and at all (the later steps run with
``error_on_recompile``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from compile_scenarios import BASE, LAYERS, Model, init_rank, sharded_model, tokens
from spawned import finish, scenario_done

STEPS = 5

# ``how``: torch.compile(model) or model.compile(); ``backend``: "aot_eager"
# and "eager" (bit for bit), "inductor"; ``twice``: the first block runs twice
# per forward (the model unrolled); ``accumulate``: two backwards per step,
# both synced; ``hsdp``: a (2, W / 2) mesh of replicas and shards; ``shard1``:
# the matrices sharded on dim 1 (shard_placement_fn); ``flat``: fsdp_rs's
# FlatOptimizer(AdamW) with weight decay, not SGD; ``offload``: CPUOffloadPolicy;
# ``multi``: the last block and the final norm sharded by one fully_shard call;
# ``frozen``: the blocks' matrices frozen, their biases and norms trained;
# ``gathered``: the blocks' matrices all-gathered in bf16 by an all-gather
# extension (``extension_scenarios.Bf16Gathered``; their graphs are listed by
# ``test_extensions.py``); ``nosync``: with ``accumulate``, the first backward
# of each step without gradient sync ("sync") or, with ``hsdp``, without the
# all-reduce across replicas ("all_reduce"): the hooks run eager there and at
# the synced backward that sums those gradients in, so this compiles with
# ``fullgraph=False`` (a graph break at each); ``rank_used``: the root's
# spare parameter used on rank 0 only, which the traced backward
# refuses on every rank ([Note: Unused parameters under trace]); ``drops``:
# rank 1's forward drops the last block's output, whose backward runs all the
# same and refuses on every rank ([Note: Every group's backward on every
# rank]). The rest as in compile_scenarios.BASE.
FULLGRAPH_BASE = {
    **BASE,
    "how": "model",
    "twice": False,
    "accumulate": False,
    "spare": False,
    "hsdp": False,
    "shard1": False,
    "flat": False,
    "offload": False,
    "multi": False,
    "frozen": False,
    "gathered": False,
    "nosync": None,
    "rank_used": False,
    "drops": False,
}
_CONFIGS = {
    "aot_eager_raf": {"backend": "aot_eager"},
    "aot_eager_noraf_bf16": {"backend": "aot_eager", "raf": False, "bf16": True},
    "aot_eager_ac_noraf": {"backend": "aot_eager", "ac": True, "raf": False},
    "method_aot_eager_bf16_dynamic": {
        "how": "model_method",
        "backend": "aot_eager",
        "bf16": True,
        "dynamic": True,
    },
    "aot_eager_twice_accumulate": {
        "backend": "aot_eager",
        "loop": False,
        "twice": True,
        "accumulate": True,
    },
    "eager_bf16_raf": {"backend": "eager", "bf16": True},
    "aot_eager_accumulate_nosync": {
        "backend": "aot_eager",
        "accumulate": True,
        "nosync": "sync",
    },
    "aot_eager_hsdp_accumulate_noallreduce": {
        "backend": "aot_eager",
        "hsdp": True,
        "accumulate": True,
        "nosync": "all_reduce",
    },
    # ``spare``: a parameter in the root's group and one in a block's that the
    # forward never uses: no gradient for them, as in eager
    "aot_eager_spare": {"backend": "aot_eager", "spare": True},
    # the unused parameters stay as they are under a flat AdamW with weight decay
    "aot_eager_spare_flat": {"backend": "aot_eager", "spare": True, "flat": True},
    # HSDP, two replicas: at W = 2 of one shard each (no reduce-scatter, the
    # all-reduce alone), at W = 4 of two; with the unused parameters, whose
    # used-mask is compared across both mesh dims
    "aot_eager_hsdp": {"backend": "aot_eager", "hsdp": True, "spare": True},
    "aot_eager_shard1": {"backend": "aot_eager", "shard1": True},
    "aot_eager_multi": {"backend": "aot_eager", "multi": True},
    "aot_eager_gathered": {"backend": "aot_eager", "gathered": True},
    # CPUOffloadPolicy (on CPU the copies to and from the device are no-ops;
    # test_fullgraph_offload_cuda runs them on a GPU), bf16 params
    "aot_eager_offload_bf16": {"backend": "aot_eager", "offload": True, "bf16": True},
    # frozen and trained parameters in one group: no gradient for the frozen
    # ones, the trained ones reduced in the gradient layout (also with HSDP and
    # CPU offload, and sharded on dim 1 in bf16)
    "aot_eager_frozen": {"backend": "aot_eager", "frozen": True},
    "aot_eager_frozen_hsdp_offload": {
        "backend": "aot_eager",
        "frozen": True,
        "hsdp": True,
        "offload": True,
    },
    "aot_eager_frozen_shard1_bf16_noraf": {
        "backend": "aot_eager",
        "frozen": True,
        "shard1": True,
        "bf16": True,
        "raf": False,
    },
    "inductor_raf": {"backend": "inductor"},
    "inductor_frozen_bf16": {"backend": "inductor", "frozen": True, "bf16": True},  # LoRA's
    "inductor_bf16_noraf": {"backend": "inductor", "bf16": True, "raf": False},
    # last: the ranks stop in the middle of a backward
    "aot_eager_rank_used": {"backend": "aot_eager", "rank_used": True},
    # resharded after forward, the dropped block is gathered again on every
    # rank ([Note: Regathered on every rank]), its two groups in one order
    # with shard1; kept unsharded, it is not gathered again
    "aot_eager_drops": {"backend": "aot_eager", "drops": True},
    "aot_eager_drops_shard1_bf16": {
        "backend": "aot_eager",
        "drops": True,
        "shard1": True,
        "bf16": True,
    },
    "eager_drops": {"backend": "eager", "drops": True},
    "inductor_drops": {"backend": "inductor", "drops": True},
    "aot_eager_noraf_drops": {"backend": "aot_eager", "raf": False, "drops": True},
}
SCENARIOS: dict[str, dict[str, Any]] = {k: {**FULLGRAPH_BASE, **v} for k, v in _CONFIGS.items()}


class TwiceModel(Model):
    """The model with its first block called twice."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first, second = self.blocks
        return self.out(self.norm(second(first(first(self.embed(tokens))))))


class SpareModel(Model):
    """The model with a parameter in the root's group and one in the first
    block's that its forward never uses."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.spare = torch.nn.Parameter(torch.ones(5))
        self.blocks[0].spare = torch.nn.Parameter(torch.ones(3, 4))


class RankUsedModel(SpareModel):
    """The model whose spare parameter (the root's) only rank 0 uses."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        if dist.get_rank() == 0:
            out = out + self.spare.sum()
        return out


class DropsModel(Model):
    """The model whose last block's output only rank 0 uses."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        *first, last = self.blocks
        x = self.embed(tokens)
        for block in first:
            x = block(x)
        y = last(x)
        if dist.get_rank() == 0:
            x = y
        return self.out(self.norm(x))


def _model(spec: dict, world_size: int) -> Model:
    from fsdp_rs import MixedPrecisionPolicy, fully_shard

    cls = TwiceModel if spec["twice"] else SpareModel if spec["spare"] else Model
    cls = RankUsedModel if spec["rank_used"] else DropsModel if spec["drops"] else cls
    return sharded_model(spec, fully_shard, MixedPrecisionPolicy, world_size, cls)


def _op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    if "auto_functionalized" in str(target):  # the mutating op it wraps
        target = node.args[0]
    name = str(target)
    return name if "c10d" in name or "fsdp_rs" in name else None


_VIEWS = (
    "view",
    "as_strided",
    "t.default",
    "transpose",
    "permute",
    "alias",
    "reshape",
    "split",
    "getitem",
)


def _from_unshard(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an unsharded buffer (``fsdp_rs.unshard_copy_out``'s
    output) or a view of one: what a forward graph must not save for backward
    when it reshards after forward."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        name = str(node.target)
        if "unshard_copy_out" in name:
            return True
        source = node.args[0] if node.args else None
        if "getitem" in name and "unshard_copy_out" in str(getattr(source, "target", "")):
            # its last output is the group's token, empty ([Note: Every
            # group's backward on every rank]); the others, its parameters
            return node.args[1] < len(source.args[9])
        if not any(v in name for v in _VIEWS) or not node.args:
            return False
        node = node.args[0]
    return False


class ListingBackend:
    """aot_eager or eager that records, per compiled graph, the collective and
    fsdp_rs ops it runs and how many of its outputs (for a forward graph: what
    it saves for backward) are unsharded buffers or views of them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dynamo_graphs = 0
        self.graphs: list[dict] = []

    def _record(self, kind: str):
        def compiler(gm: torch.fx.GraphModule, inputs: list) -> Callable:
            ops = [op for n in gm.graph.nodes if n.op == "call_function" and (op := _op_name(n))]
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            unsharded = sum(map(_from_unshard, (a for a in out if isinstance(a, torch.fx.Node))))
            self.graphs.append({"kind": kind, "ops": ops, "saves_unsharded": unsharded})
            return gm

        return compiler

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> Callable:
        self.dynamo_graphs += 1
        if self.name == "eager":
            return self._record("dynamo")(gm, inputs)
        if self.name == "inductor":
            return torch._dynamo.lookup_backend("inductor")(gm, inputs)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def boxed(kind):
            return lambda g, i: make_boxed_func(self._record(kind)(g, i))

        return aot_autograd(
            fw_compiler=boxed("forward"),
            bw_compiler=boxed("backward"),
            partition_fn=min_cut_rematerialization_partition,
        )(gm, inputs)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the data of an all-gather extension's subclass (``gathered``)."""
    return getattr(t, "_data", t)


def train(spec: dict, world_size: int, rank: int, compiled: bool) -> dict:
    """Losses and final full parameters; compiled, what was compiled."""
    model = _model(spec, world_size)
    torch._dynamo.reset()
    backend = ListingBackend(spec["backend"]) if compiled else None
    run: Any = model
    if compiled:
        model.set_fullgraph_compile()
        fullgraph = spec["nosync"] is None
        options = {"backend": backend, "fullgraph": fullgraph, "dynamic": spec["dynamic"]}
        if spec["how"] == "model":
            run = torch.compile(model, **options)
        else:
            model.compile(**options)
    if spec["flat"]:  # weight decay would move a parameter given a zero gradient
        from fsdp_rs.optim import FlatOptimizer

        opt = FlatOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first_step = [], 0
    micro = 2 if spec["accumulate"] else 1
    for step in range(STEPS):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for k in range(micro):
                if spec["nosync"] == "sync":
                    model.set_requires_gradient_sync(k == micro - 1)
                elif spec["nosync"] == "all_reduce":
                    model.set_requires_all_reduce(k == micro - 1)
                x = tokens(micro * step + k, rank).to(spec.get("device", "cpu"))
                loss = run(x).float().pow(2).mean()
                loss.backward()
                losses.append(loss.item())
        no_grad = [name for name, p in model.named_parameters() if p.grad is None]
        opt.step()
        opt.zero_grad()
        if step == 0 and backend is not None:
            first_step = backend.dynamo_graphs
    result: dict[str, Any] = {
        "losses": losses,
        "params": [_plain(p.full_tensor()).float().tolist() for p in model.parameters()],
        "no_grad": no_grad,  # parameters without a gradient at the last step
    }
    if backend is not None:
        result.update(
            dynamo_graphs=backend.dynamo_graphs, first_step=first_step, graphs=backend.graphs
        )
    return result


def disagreement(world_size: int, rank: int) -> dict:
    """``set_fullgraph_compile`` where the last rank turned gradient sync off:
    what each rank raised ([Note: One decision for all ranks])."""
    model = _model(FULLGRAPH_BASE, world_size)
    model(tokens(0, rank))  # lazy init (its plan check) before the flags differ
    if rank == world_size - 1:
        model.set_requires_gradient_sync(False)
    try:
        model.set_fullgraph_compile()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def trains_disagreement(world_size: int, rank: int) -> dict:
    """``set_fullgraph_compile`` where the last rank froze a parameter the
    others train: what each rank raised ([Note: One decision for all ranks])."""
    model = _model(FULLGRAPH_BASE, world_size)
    model(tokens(0, rank))
    name, param = next(model.blocks[0].named_parameters())
    if rank == world_size - 1:
        param.requires_grad_(False)
    try:
        model.set_fullgraph_compile()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "param": f"blocks.0.{name}"}
    return {"type": None}


def worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    init_rank(rank, world_size, port)
    results: dict[str, Any] = {
        "disagreement": disagreement(world_size, rank),
        "trains_disagreement": trains_disagreement(world_size, rank),
    }
    _train_each(results, names, world_size, rank, "cpu", out_dir)
    finish(out_dir, rank, results)


def cuda_worker(rank: int, world_size: int, port: int, names: list[str], out_dir: str) -> None:
    """``worker``'s scenarios on CUDA over NCCL (one GPU per rank)."""
    torch.cuda.set_device(rank)
    init_rank(rank, world_size, port, backend="nccl")
    results: dict[str, Any] = {}
    _train_each(results, names, world_size, rank, "cuda", out_dir)
    finish(out_dir, rank, results)


def _train_each(
    results: dict, names: list[str], world_size: int, rank: int, device: str, out_dir: str
) -> None:
    """Each scenario trained eagerly and compiled on ``device``, into ``results``."""
    for name in names:
        try:
            spec = {**SCENARIOS[name], "device": device}
            results[name] = {
                "eager": train(spec, world_size, rank, compiled=False),
                "compiled": train(spec, world_size, rank, compiled=True),
            }
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        scenario_done(out_dir, rank, results)


__all__ = ["LAYERS", "SCENARIOS", "STEPS", "cuda_worker", "worker"]
