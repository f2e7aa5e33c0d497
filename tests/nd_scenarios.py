"""N-D parallelism: ``fully_shard`` over the data-parallel (DP) dims of a device
mesh whose other dim carries tensor parallelism (TP), run with fsdp-rs and with
torch FSDP2 side by side in one spawned gloo process, over CPU meshes.

The parameters reach ``fully_shard`` already DTensors: either on the 1-D TP mesh
(``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel``, then ``fully_shard(..., mesh=mesh["dp"])``), or, for
torch's SPMD form, on the full mesh with ``Replicate()`` on the DP dims
(``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``).

Each scenario returns, per library (``"rs"``, ``"torch"``), JSON observations
that ``test_nd.py`` compares bit for bit: losses, the gradient norm, and per
parameter its ``placements`` (as ``str``, e.g. FSDP2's ``_StridedShard(dim=0,
sf=2)`` where TP and FSDP shard the same dim), its mesh dim names, its global and
local shape and stride, its ``full_tensor()`` values and its sharded gradient's
``full_tensor()``. The DCP scenario returns booleans instead (a checkpoint saved
by one library loads into the other), and the errors scenario the exception
class names.

Every shard is a whole number of 16-byte units ([Note: Gloo sums by buffer size]
in ``test_dropin.py``), and the blocks are MLPs (CPU DTensor has no sharding
strategy for flash attention).

Set ``ND_TEST_BOTH_TORCH=1`` to run torch FSDP2 under the ``"rs"`` key as well:
the tests then check that the scenarios themselves are deterministic (and run
where fsdp-rs cannot yet).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fsdp_rs
from scenario_common import CountingAllGather, CountingReduceScatter, eager_and_compiled
from spawned import run_named

# Every local shard a multiple of 16 bytes at dp <= 4, tp <= 2 (fp32).
DIM, HIDDEN, OUT, BATCH, SEQ = 16, 64, 16, 4, 4
BOTH_TORCH = os.environ.get("ND_TEST_BOTH_TORCH") == "1"
LIBS: dict[str, Callable] = {
    "rs": torch_fully_shard if BOTH_TORCH else fsdp_rs.fully_shard,
    "torch": torch_fully_shard,
}
HAS_DP_MESH_DIMS = hasattr(torch_fsdp, "DataParallelMeshDims")


# ------------------------------------------------------------------ models


class Block(nn.Module):
    """``x + w2(relu(w1(norm(x))))``."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm = norm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    """Blocks (LayerNorm, RMSNorm, ...), a final LayerNorm and a Linear head."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        norms = [nn.LayerNorm, nn.RMSNorm]
        self.blocks = nn.ModuleList(Block(norms[i % 2]) for i in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _net(seed: int = 0, device: str = "cpu") -> Net:
    torch.manual_seed(seed)
    with torch.device(device):
        return Net()


@functools.cache
def _nd_mesh(world_size: int, tp: int, replicate: int = 0) -> DeviceMesh:
    """One mesh object per shape in a process: DTensor's sharding propagation
    cache compares meshes by value, so a DTensor op (``nn.Parameter``'s detach)
    can hand back an equal mesh made earlier, and FSDP2's SPMD path requires
    the parameters' mesh to *be* the one passed to ``fully_shard``."""
    if replicate:  # HSDP
        shape = (replicate, world_size // (replicate * tp), tp)
        names = ("dp_replicate", "dp_shard", "tp")
    else:
        shape, names = (world_size // tp, tp), ("dp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names
    return mesh["dp"] if "dp" in names else mesh["dp_replicate", "dp_shard"]


def _tensor_parallel(model: Net, tp_mesh: DeviceMesh, sequence: bool = True) -> Net:
    """Megatron TP per block; with ``sequence`` the norms are SequenceParallel
    and the residual stream is sharded on the sequence dim between blocks,
    else the norms are replicated on the TP mesh and the stream is whole."""
    if sequence:
        norm, w1_in, w2_out = SequenceParallel(), Shard(1), Shard(1)
    else:
        norm = _Replicated()
        w1_in, w2_out = Replicate(), Replicate()
    for block in model.blocks:
        plan = {
            "norm": norm,
            "w1": ColwiseParallel(input_layouts=w1_in),
            "w2": RowwiseParallel(output_layouts=w2_out),
        }
        parallelize_module(block, tp_mesh, plan)
    head = ColwiseParallel(input_layouts=w1_in, output_layouts=Replicate())
    parallelize_module(model, tp_mesh, {"norm": norm, "head": head})
    return model


class _Replicated(SequenceParallel):
    """A norm with its parameters replicated on the TP mesh, taking and
    returning whole (replicated) activations."""

    def __init__(self) -> None:
        super().__init__(use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        (x,) = inputs
        return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)


def _fully_shard(lib: str, model: Net, mesh: DeviceMesh, **kwargs) -> Net:
    for block in model.blocks:
        LIBS[lib](block, mesh=mesh, **kwargs)
    LIBS[lib](model, mesh=mesh, **kwargs)
    return model


def _coordinates(mesh: DeviceMesh) -> tuple[int, int, int]:
    """(DP index, TP index, TP size) of this rank: the DP index flattens all
    dims but ``tp``."""
    names = mesh.mesh_dim_names
    coordinate = mesh.get_coordinate()
    dp = 0
    for name, c in zip(names, coordinate, strict=True):
        if name != "tp":
            dp = dp * mesh[name].size() + c
    return dp, coordinate[names.index("tp")], mesh["tp"].size()


def _inputs(mesh: DeviceMesh, step: int, sequence: bool = True) -> torch.Tensor:
    """This DP rank's batch at a step; with ``sequence``, this TP rank's chunk
    of the sequence dim."""
    dp, tp, tp_size = _coordinates(mesh)
    gen = torch.Generator().manual_seed(1000 * dp + step)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen)
    return x.chunk(tp_size, dim=1)[tp] if sequence else x


def _values(t: torch.Tensor) -> list[float]:
    return t.detach().double().flatten().tolist()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model: nn.Module) -> dict:
    """Per parameter: placements, mesh dims, shapes, strides, full values."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = {
            "type": type(p).__name__,
            "placements": str(getattr(p, "placements", None)),
            "mesh_dims": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else [],
            "shape": list(p.shape),
            "stride": list(p.stride()),
            "local_shape": list(local.shape),
            "local_stride": list(local.stride()),
            "dtype": str(p.dtype),
            "full": _values(_full(p)),
        }
    return out


def _grads(model: nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else {
            "placements": str(getattr(g, "placements", None)),
            "local_shape": list(g.to_local().shape) if isinstance(g, DTensor) else list(g.shape),
            "full": _values(_full(g)),
        }  # fmt: skip
    return out


def _train(
    model: nn.Module,
    batch: Callable[[int], torch.Tensor],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    steps: int,
    clip: bool = True,
) -> dict:
    """``steps`` AdamW steps (foreach=False), the gradients clipped by
    ``clip_grad_norm_``; the last step's gradients are observed before it."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, norms, grads = [], [], {}
    for step in range(steps):
        loss = loss_of(model(batch(step)))
        loss.backward()
        losses.append(loss.item())
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=False)
            norms.append(_full(norm).item())
        if step == steps - 1:
            grads = _grads(model)
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "grad_norms": norms, "grads": grads}


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# --------------------------------------------------------------- scenarios


def tp_mlp(
    world_size: int,
    rank: int,
    tp: int = 2,
    replicate: int = 0,
    sequence: bool = True,
    mp: bool = False,
    steps: int = 3,
    **shard_kwargs,
) -> dict:
    """TP (and sequence parallel norms) per block, ``fully_shard`` per block
    and on the root over the DP mesh, then AdamW steps with clipping."""
    if mp:
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    mesh = _nd_mesh(world_size, tp, replicate)
    out = {}
    for lib in LIBS:
        model = _tensor_parallel(_net(), mesh["tp"], sequence)
        _fully_shard(lib, model, _dp_mesh(mesh), **shard_kwargs)
        sharded = _params(model)
        trained = _train(model, lambda step: _inputs(mesh, step, sequence), _mse, steps)
        out[lib] = {"sharded": sharded, **trained, "params": _params(model)}
    return out


def _eager_and_compiled(
    build: Callable[[], nn.Module], batch, steps: int = 3, compiler: str = "aot_eager"
) -> dict:
    """``scenario_common.eager_and_compiled`` of ``steps`` steps of ``_train``
    on ``batch(step)``: losses, gradient norms, the last step's sharded
    gradients and the trained parameters per mode."""

    def train(model: nn.Module, run: nn.Module, after_first) -> dict:
        def counted(step: int) -> torch.Tensor:
            if step == 1 and after_first is not None:
                after_first()
            return batch(step)

        trained = _train(run, counted, _mse, steps)
        prefix = "_orig_mod."  # the compiled wrapper's names
        grads = {k.removeprefix(prefix): v for k, v in trained["grads"].items()}
        return {**trained, "grads": grads, "params": _params(model)}

    return eager_and_compiled(build, train, compiler)


def tp_fullgraph(
    world_size: int, rank: int, tp: int = 2, sequence: bool = True, mp: bool = False
) -> dict:
    """fsdp-rs over TP, eager and compiled whole with ``fullgraph=True``
    (``_eager_and_compiled``)."""
    if BOTH_TORCH:
        return {"skipped": "torch FSDP2 has no set_fullgraph_compile"}
    kwargs = {}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    mesh = _nd_mesh(world_size, tp)

    def build() -> nn.Module:
        model = _tensor_parallel(_net(), mesh["tp"], sequence)
        return _fully_shard("rs", model, mesh["dp"], **kwargs)

    return _eager_and_compiled(build, lambda step: _inputs(mesh, step, sequence))


def tp_strided(world_size: int, rank: int, tp: int = 2) -> dict:
    """Colwise weights are sharded on dim 0 by TP and by FSDP: each parameter's
    placements and local shard, and whether ``full_tensor()`` gives back the
    original weight exactly."""
    original = {n: p.detach().clone() for n, p in _net().named_parameters()}
    mesh = _nd_mesh(world_size, tp)
    out = {}
    for lib in LIBS:
        model = _fully_shard(lib, _tensor_parallel(_net(), mesh["tp"]), mesh["dp"])
        params = _params(model)
        for name, p in model.named_parameters():
            params[name]["local"] = _values(p.to_local())
            params[name]["is_original"] = torch.equal(p.full_tensor(), original[name])
        out[lib] = {"params": params}
    return out


def tp_meta_init(world_size: int, rank: int, tp: int = 2) -> dict:
    """Built on the meta device, parallelized and sharded there, then
    ``to_empty`` and each shard set with ``distribute_tensor`` of a reference
    model's weight at the parameter's own mesh and placements; trained."""
    reference = dict(_net().named_parameters())
    mesh = _nd_mesh(world_size, tp)
    out = {}
    for lib in LIBS:
        model = _tensor_parallel(_net(device="meta"), mesh["tp"])
        _fully_shard(lib, model, mesh["dp"])
        meta = all(p.is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(distribute_tensor(reference[name].detach(), p.device_mesh, p.placements))
        trained = _train(model, lambda step: _inputs(mesh, step), _mse, steps=2)
        out[lib] = {"meta": meta, **trained, "params": _params(model)}
    return out


def _shared_dir(rank: int) -> str:
    """A fresh directory made by rank 0, its path sent to every rank."""
    path = [tempfile.mkdtemp(prefix="fsdp_rs_nd_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def dcp_2d(world_size: int, rank: int, tp: int = 2) -> dict:
    """A trained model's ``state_dict()`` saved with DCP by one library and
    loaded with DCP into the other's model (built at another seed): every
    parameter's ``full_tensor()`` then equals the saved model's; both ways."""
    mesh = _nd_mesh(world_size, tp)
    out = {}
    for source, target in (("rs", "torch"), ("torch", "rs")):
        saved = _fully_shard(source, _tensor_parallel(_net(0), mesh["tp"]), mesh["dp"])
        _train(saved, lambda step: _inputs(mesh, step), _mse, steps=1)
        path = _shared_dir(rank)
        try:
            dcp.save(saved.state_dict(), checkpoint_id=path)
            loaded = _fully_shard(target, _tensor_parallel(_net(1), mesh["tp"]), mesh["dp"])
            state = loaded.state_dict()
            dcp.load(state, checkpoint_id=path)
            loaded.load_state_dict(state)
            dist.barrier()
        finally:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        same = [
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(saved.parameters(), loaded.parameters(), strict=True)
        ]
        placements = [
            str(a.placements) == str(b.placements)
            for a, b in zip(saved.parameters(), loaded.parameters(), strict=True)
        ]
        # A loaded model trains on as the saved one.
        after = [_train(m, lambda step: _inputs(mesh, 10 + step), _mse, 1) for m in (saved, loaded)]
        out[f"{source}_to_{target}_equal"] = all(same) and all(placements)
        out[f"{source}_to_{target}_trains_equal"] = after[0] == after[1]
    return out


class _SpmdNet(nn.Module):
    """``Net``'s MLP without norms, its parameters DTensors on the full
    (dp, tp) mesh: ``Replicate()`` on dp, Megatron TP on tp. Takes the batch
    sharded on dp, returns this rank's rows."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_SpmdBlock() for _ in range(2))
        self.head = nn.Linear(DIM, OUT)
        colwise, rowwise = [Replicate(), Shard(0)], [Replicate(), Shard(1)]
        for name, p in list(self.named_parameters()):
            module_name, _, attr = name.rpartition(".")
            module = self.get_submodule(module_name)
            if module_name.endswith("w2"):
                placements = rowwise if attr == "weight" else [Replicate(), Replicate()]
            else:
                placements = colwise
            dtensor = distribute_tensor(p.detach(), mesh, placements)
            setattr(module, attr, nn.Parameter(dtensor))
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(x, self.mesh, [Shard(0), Replicate()], run_check=False)
        for block in self.blocks:
            x = block(x)
        out = self.head(x).redistribute(self.mesh, [Shard(0), Replicate()])
        return out.to_local()


class _SpmdBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w2(torch.relu(self.w1(x)))
        return x + h.redistribute(x.device_mesh, [Shard(0), Replicate()])


def spmd_dp_mesh_dims(world_size: int, rank: int, tp: int = 2, steps: int = 2) -> dict:
    """torch's SPMD form: ``fully_shard(block, mesh=full_mesh,
    dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` on parameters that are
    DTensors on the full mesh; trained as ``tp_mlp``."""
    if not HAS_DP_MESH_DIMS:
        return {"skipped": "this torch has no DataParallelMeshDims"}
    dims = torch_fsdp.DataParallelMeshDims(shard="dp")
    mesh = _nd_mesh(world_size, tp)
    out = {}
    for lib in LIBS:
        torch.manual_seed(0)
        model = _SpmdNet(mesh)
        for block in model.blocks:
            LIBS[lib](block, mesh=mesh, dp_mesh_dims=dims)
        LIBS[lib](model, mesh=mesh, dp_mesh_dims=dims)
        sharded = _params(model)
        dp, _, _ = _coordinates(mesh)

        def batch(step: int, dp=dp) -> torch.Tensor:
            gen = torch.Generator().manual_seed(1000 * dp + step)
            return torch.randn(BATCH, DIM, generator=gen)

        trained = _train(model, batch, _mse, steps)
        out[lib] = {"sharded": sharded, **trained, "params": _params(model)}
    return out


def spmd_fullgraph(
    world_size: int, rank: int, tp: int = 2, mp: bool = False, compiler: str = "aot_eager"
) -> dict:
    """fsdp-rs in torch's SPMD form (``spmd_dp_mesh_dims``), eager and compiled
    whole with ``fullgraph=True`` (``_eager_and_compiled``): the gradients
    autograd leaves ``Partial`` on the dp dim are summed by the reduce-scatter,
    as in eager."""
    if BOTH_TORCH:
        return {"skipped": "torch FSDP2 has no set_fullgraph_compile"}
    if not HAS_DP_MESH_DIMS:
        return {"skipped": "this torch has no DataParallelMeshDims"}
    dims = torch_fsdp.DataParallelMeshDims(shard="dp")
    mesh = _nd_mesh(world_size, tp)
    kwargs = {}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = _SpmdNet(mesh)
        for block in model.blocks:
            fsdp_rs.fully_shard(block, mesh=mesh, dp_mesh_dims=dims, **kwargs)
        return fsdp_rs.fully_shard(model, mesh=mesh, dp_mesh_dims=dims, **kwargs)

    dp, _, _ = _coordinates(mesh)

    def batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * dp + step)
        return torch.randn(BATCH, DIM, generator=gen)

    return _eager_and_compiled(build, batch, compiler=compiler)


class _DPNet(nn.Module):
    """An MLP whose parameters are DTensors replicated on every dim of a mesh
    that is all data parallel; takes this rank's rows, sharded on every dim."""

    def __init__(self, mesh: DeviceMesh, replicated_batch: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, OUT)
        replicated = [Replicate()] * mesh.ndim
        for module in (self.w1, self.w2, self.head):
            for name, p in list(module.named_parameters()):
                setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, replicated)))
        self.mesh = mesh
        self.batch = [Replicate() if replicated_batch else Shard(0)] * mesh.ndim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(x, self.mesh, self.batch, run_check=False)
        x = x + self.w2(torch.relu(self.w1(x)))
        return self.head(x).to_local()


def spmd_several_shard_dims(world_size: int, rank: int, steps: int = 2, hsdp: bool = False) -> dict:
    """``dp_mesh_dims`` naming two shard dims (torchtitan's FSDP over dp_shard x
    cp): they act as one flattened DP dim, in the sharded parameters' mesh too.
    ``hsdp``: a replicate dim and a shard dim instead."""
    if not HAS_DP_MESH_DIMS:
        return {"skipped": "this torch has no DataParallelMeshDims"}
    mesh, dims = _two_dp_dims(world_size, hsdp)
    out = {}
    for lib in LIBS:
        torch.manual_seed(0)
        model = _DPNet(mesh)
        LIBS[lib](model.w1, mesh=mesh, dp_mesh_dims=dims)
        LIBS[lib](model, mesh=mesh, dp_mesh_dims=dims)
        sharded = _params(model)

        def batch(step: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(1000 * rank + step)
            return torch.randn(BATCH, DIM, generator=gen)

        trained = _train(model, batch, _mse, steps)
        out[lib] = {"sharded": sharded, **trained, "params": _params(model)}
    return out


def spmd_replicate_only(world_size: int, rank: int, form: str = "1d", steps: int = 3) -> dict:
    """``dp_mesh_dims`` naming replicate dims only, FSDP2's DDP form ([Note:
    Replicate dims only]). ``form``: "1d" (the whole world one replicate dim),
    "two_dims" (two replicate dims, flattened into one), "tp" (replicate over dp
    beside Megatron TP), "mixed" (the blocks DDP, the root FSDP over the same dim),
    "bf16" ("1d" under bf16 mixed precision with fp32 reduction), "custom_comms"
    ("1d" with a user's all-gather and reduce-scatter, which neither library
    calls: nothing is sharded), "reshard_int" ("1d" with reshard_after_forward=2,
    which FSDP2 takes there and fsdp-rs reads as True)."""
    if not HAS_DP_MESH_DIMS:
        return {"skipped": "this torch has no DataParallelMeshDims"}
    replicate = torch_fsdp.DataParallelMeshDims(replicate="dp")
    kwargs: dict = {}
    if form == "two_dims":
        mesh = _dp_mesh_2d(world_size, ("dp_replicate", "dp_other"))
        replicate = torch_fsdp.DataParallelMeshDims(replicate=("dp_replicate", "dp_other"))
    elif form == "tp":
        mesh = _nd_mesh(world_size, 2)
    else:
        mesh = _dp_mesh_1d(world_size)
    if form == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if form == "reshard_int":
        kwargs["reshard_after_forward"] = 2
    root_dims = torch_fsdp.DataParallelMeshDims(shard="dp") if form == "mixed" else replicate
    out = {}
    for lib in LIBS:
        torch.manual_seed(0)
        model = _SpmdNet(mesh) if form == "tp" else _DPNet(mesh)
        blocks = model.blocks if form == "tp" else [model.w1]
        for block in blocks:
            LIBS[lib](block, mesh=mesh, dp_mesh_dims=replicate, **kwargs)
        LIBS[lib](model, mesh=mesh, dp_mesh_dims=root_dims, **kwargs)
        comms = []
        if form == "custom_comms":
            for module in [*blocks, model]:
                comms.append((CountingAllGather(), CountingReduceScatter()))
                module.set_custom_all_gather(comms[-1][0])
                module.set_custom_reduce_scatter(comms[-1][1])
        sharded = _params(model)
        dp = _coordinates(mesh)[0] if form == "tp" else rank

        def batch(step: int, dp=dp) -> torch.Tensor:
            gen = torch.Generator().manual_seed(1000 * dp + step)
            return torch.randn(BATCH, DIM, generator=gen)

        trained = _train(model, batch, _mse, steps)
        calls = [(ag.calls, rs.calls) for ag, rs in comms]
        out[lib] = {"sharded": sharded, **trained, "params": _params(model), "calls": calls}
    return out


@functools.cache
def _dp_mesh_1d(world_size: int) -> DeviceMesh:
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def spmd_fullgraph_several(
    world_size: int,
    rank: int,
    replicated_batch: bool = False,
    hsdp: bool = False,
    replicate_only: bool = False,
) -> dict:
    """``spmd_several_shard_dims`` eager and compiled whole with
    ``fullgraph=True`` (``_eager_and_compiled``). ``replicated_batch``: one
    batch on every rank, ``Replicate()`` on the DP dims, so the gradients are
    ``Replicate()`` there too (the reduce-scatter sums the copies, as eager).
    ``replicate_only``: one DP dim, replicated ([Note: Replicate dims only])."""
    if BOTH_TORCH:
        return {"skipped": "torch FSDP2 has no set_fullgraph_compile"}
    if not HAS_DP_MESH_DIMS:
        return {"skipped": "this torch has no DataParallelMeshDims"}
    if replicate_only:
        mesh = _dp_mesh_1d(world_size)
        dims = torch_fsdp.DataParallelMeshDims(replicate="dp")
    else:
        mesh, dims = _two_dp_dims(world_size, hsdp)

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = _DPNet(mesh, replicated_batch)
        fsdp_rs.fully_shard(model.w1, mesh=mesh, dp_mesh_dims=dims)
        return fsdp_rs.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)

    def batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * (0 if replicated_batch else rank) + step)
        return torch.randn(BATCH, DIM, generator=gen)

    return _eager_and_compiled(build, batch)


def _two_dp_dims(world_size: int, hsdp: bool) -> tuple[DeviceMesh, object]:
    """A (2, W / 2) mesh of two DP dims and its ``DataParallelMeshDims``:
    (dp_shard, cp), both sharded, or with ``hsdp`` (dp_replicate, dp_shard)."""
    if hsdp:
        dims = torch_fsdp.DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
        return _dp_mesh_2d(world_size, ("dp_replicate", "dp_shard")), dims
    dims = torch_fsdp.DataParallelMeshDims(shard=("dp_shard", "cp"))
    return _dp_mesh_2d(world_size, ("dp_shard", "cp")), dims


@functools.cache
def _dp_mesh_2d(world_size: int, names: tuple[str, str]) -> DeviceMesh:
    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=names)


def _error_name(fn: Callable) -> list[str] | None:
    """The names of the classes the raised exception is an instance of (its
    own first), or None."""
    try:
        fn()
    except Exception as e:
        return [c.__name__ for c in type(e).__mro__]
    return None


def _linear_on(mesh: DeviceMesh, placements: list) -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(DIM, HIDDEN)
    for name, p in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return model


def errors(world_size: int, rank: int) -> dict:
    """The exception class each library raises (``None``: nothing) at
    ``fully_shard`` for a DTensor parameter on a mesh unrelated to the DP mesh
    (a 1-D mesh over all ranks, unnamed or named: FSDP2 raises from
    ``DeviceMesh._concatenate``, TypeError and RuntimeError) and, in the SPMD
    form, for ``dp_mesh_dims`` naming a dim the mesh lacks, a plain parameter,
    a parameter sharded on the DP dim, and ``reshard_after_forward`` as an int
    with a shard dim."""
    mesh = _nd_mesh(world_size, world_size // 2)
    unnamed = init_device_mesh("cpu", (world_size,))
    named = init_device_mesh("cpu", (world_size,), mesh_dim_names=("other",))
    cases: dict[str, Callable[[str], object]] = {
        "unrelated_unnamed_mesh": lambda lib: LIBS[lib](
            _linear_on(unnamed, [Shard(0)]), mesh=mesh["dp"]
        ),
        "unrelated_named_mesh": lambda lib: LIBS[lib](
            _linear_on(named, [Shard(0)]), mesh=mesh["dp"]
        ),
    }
    if HAS_DP_MESH_DIMS:
        dims = torch_fsdp.DataParallelMeshDims(shard="dp")
        missing = torch_fsdp.DataParallelMeshDims(shard="dp_shard")
        cases |= {
            "spmd_missing_dim": lambda lib: LIBS[lib](
                _linear_on(mesh, [Replicate(), Shard(0)]), mesh=mesh, dp_mesh_dims=missing
            ),
            "spmd_plain_param": lambda lib: LIBS[lib](
                nn.Linear(DIM, HIDDEN), mesh=mesh, dp_mesh_dims=dims
            ),
            "spmd_sharded_on_dp": lambda lib: LIBS[lib](
                _linear_on(mesh, [Shard(0), Replicate()]), mesh=mesh, dp_mesh_dims=dims
            ),
            "spmd_reshard_int": lambda lib: LIBS[lib](
                _linear_on(mesh, [Replicate(), Replicate()]),
                mesh=mesh,
                dp_mesh_dims=dims,
                reshard_after_forward=2,
            ),
        }
    out = {}
    for lib in reversed(list(LIBS)):  # FSDP2 first
        out[lib] = {case: _error_name(functools.partial(fn, lib)) for case, fn in cases.items()}
        dist.barrier()
    return out


def clip_mixed_meshes(world_size: int, rank: int, tp: int = 2) -> dict:
    """``fsdp_rs.clip_grad_norm_`` on a model whose block MLPs are tensor
    parallel and whose norms and head are not: the sharded gradients live on
    the (dp, tp) mesh and on the dp mesh, which torch's own ``clip_grad_norm_``
    refuses to stack. The total norm must be that of the full gradients, and
    every gradient scaled by torch's clip coefficient."""
    mesh = _nd_mesh(world_size, tp)
    model = _net()
    for block in model.blocks:
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(block, mesh["tp"], plan)
    _fully_shard("rs", model, mesh["dp"])
    _mse(model(_inputs(mesh, 0, sequence=False))).backward()
    params = list(model.parameters())
    before = [p.grad.full_tensor().double() for p in params]
    expected = torch.stack([g.pow(2).sum() for g in before]).sum().sqrt().item()
    total = _full(fsdp_rs.clip_grad_norm_(params, 0.5)).item()
    coef = min(1.0, 0.5 / (total + 1e-6))
    scaled = max(
        (p.grad.full_tensor().double() - g * coef).abs().max().item()
        for p, g in zip(params, before, strict=True)
    )
    meshes = sorted({str(p.grad.device_mesh.mesh_dim_names) for p in params})
    return {"total": total, "expected": expected, "scaled_error": scaled, "meshes": meshes}


SCENARIOS: dict[str, tuple[Callable, dict]] = {
    "tp_mlp": (tp_mlp, {}),
    "tp_mlp_keep": (tp_mlp, {"reshard_after_forward": False}),
    "tp_mlp_bf16": (tp_mlp, {"mp": True}),
    "tp_mlp_replicated_norm": (tp_mlp, {"sequence": False}),
    "tp_strided": (tp_strided, {}),
    "tp_fullgraph": (tp_fullgraph, {}),
    "tp_fullgraph_bf16_replicated_norm": (tp_fullgraph, {"sequence": False, "mp": True}),
    "tp_meta_init": (tp_meta_init, {}),
    "hsdp_tp": (tp_mlp, {"replicate": 2, "steps": 2, "min_world": 4}),
    "hsdp_tp_shard": (tp_mlp, {"replicate": 1, "steps": 2, "min_world": 4}),
    "dcp_2d": (dcp_2d, {"min_world": 4}),
    "spmd_dp_mesh_dims": (spmd_dp_mesh_dims, {"tp": 1}),
    "spmd_dp_mesh_dims_tp": (spmd_dp_mesh_dims, {"min_world": 4}),
    "spmd_several_shard_dims": (spmd_several_shard_dims, {"min_world": 4}),
    "spmd_fullgraph": (spmd_fullgraph, {"tp": 1}),
    "spmd_fullgraph_tp": (spmd_fullgraph, {"min_world": 4}),
    "spmd_fullgraph_inductor": (spmd_fullgraph, {"tp": 1, "compiler": "inductor"}),
    "spmd_fullgraph_tp_bf16": (spmd_fullgraph, {"mp": True, "min_world": 4}),
    "spmd_fullgraph_several": (spmd_fullgraph_several, {"min_world": 4}),
    "spmd_hsdp": (spmd_several_shard_dims, {"hsdp": True, "min_world": 4}),
    "spmd_replicate_only": (spmd_replicate_only, {}),
    "spmd_replicate_only_bf16": (spmd_replicate_only, {"form": "bf16"}),
    "spmd_replicate_only_mixed": (spmd_replicate_only, {"form": "mixed"}),
    "spmd_replicate_only_custom_comms": (spmd_replicate_only, {"form": "custom_comms"}),
    "spmd_replicate_only_reshard_int": (spmd_replicate_only, {"form": "reshard_int"}),
    "spmd_replicate_only_two_dims": (spmd_replicate_only, {"form": "two_dims", "min_world": 4}),
    "spmd_replicate_only_tp": (spmd_replicate_only, {"form": "tp", "min_world": 4}),
    "spmd_fullgraph_replicate_only": (spmd_fullgraph_several, {"replicate_only": True}),
    "spmd_fullgraph_hsdp": (spmd_fullgraph_several, {"hsdp": True, "min_world": 4}),
    "spmd_fullgraph_replicated_batch": (
        spmd_fullgraph_several,
        {"replicated_batch": True, "min_world": 4},
    ),
    "dp_only_2d_mesh_1_tp": (tp_mlp, {"tp": 1}),
    "errors": (errors, {}),
    "clip_mixed_meshes": (clip_mixed_meshes, {"min_world": 4}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)


__all__ = ["BOTH_TORCH", "LIBS", "SCENARIOS", "run"]
