"""torchao's float8 training with float8 all-gather (``Float8LinearConfig(
enable_fsdp_float8_all_gather=True)``: each Float8Linear weight's
``fsdp_pre_all_gather`` casts its shard to float8, the all-gather moves
float8, its ``fsdp_post_all_gather`` wraps the result) and
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step, on
CPU with gloo: first with fsdp-rs in place of FSDP2 by the switch (the
user's ``fully_shard`` imported from ``torch.distributed.fsdp`` after it),
then with torch's FSDP2 ([Note: Both libraries in one rank] in
``client_common.py``).

gloo cannot all-gather float8 tensors ("Invalid scalar type"): torch's
FSDP2 gathers in the inputs' dtype, so its run here gathers them viewed as
bytes (``BytesAllGather``, FSDP2's ``set_custom_all_gather``), which moves
the same bits. fsdp-rs gathers float8 on gloo as it is."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from clients.client_common import (
    fsdp_rs_switched,
    full,
    full_grads,
    full_state,
    sharded_by,
    summary,
    torch_fsdp2_back,
)
from spawned import run_named

STEPS, DIM, HIDDEN, BATCH = 3, 32, 64, 16


class BytesAllGather(AllGather):
    """FSDP2's all-gather of any dtype as bytes (gloo has no float8)."""

    dtypes: ClassVar[set] = set()  # the dtypes it gathered

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        BytesAllGather.dtypes.add(str(input_tensor.dtype))
        return dist.all_gather_into_tensor(
            output_tensor.view(torch.uint8),
            input_tensor.view(torch.uint8),
            group=group,
            async_op=async_op,
        )


def _train(rank: int, bytes_all_gather: bool) -> dict:
    # fsdp-rs's after the switch, as the user's code finds them
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(
                nn.Linear(DIM, HIDDEN, bias=False), nn.GELU(), nn.Linear(HIDDEN, DIM, bias=False)
            )
            for _ in range(2)
        ],
        nn.LayerNorm(DIM),
    )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    if bytes_all_gather:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(BytesAllGather())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record: dict = {"losses": [], "norms": [], "grads": []}
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(BATCH, DIM, generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        record["losses"].append(loss.detach())
        record["grads"].append(full_grads(model))
        record["norms"].append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
    record["state"] = full_state(model)
    weight = model[0][0].weight
    return {
        "record": record,
        "sharded_by": sharded_by(model),
        "float8": type(model[0][0]).__name__ == "Float8Linear"
        and type(weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor",
    }


def float8_all_gather(world_size: int, rank: int) -> dict:
    fsdp_rs_switched()
    rs = _train(rank, bytes_all_gather=False)
    torch_fsdp2_back()
    ref = _train(rank, bytes_all_gather=True)
    out = summary(rs, ref)
    out["float8"] = {"rs": rs["float8"], "torch": ref["float8"]}
    out["torch_gathered"] = sorted(BytesAllGather.dtypes)
    return out


SCENARIOS = {"float8_all_gather": (float8_all_gather, {})}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
