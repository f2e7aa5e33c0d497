"""``auto_shard`` against the same ``fully_shard`` calls written by hand
([Note: Module grouping]), run by spawned gloo ranks: both models start from
the same weights and train the same steps in one process; each scenario
returns whether their losses and final parameters are equal bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from spawned import run_named

DIM = 16


class Blocks(nn.Module):
    """``n`` tiny blocks and a head; ``reverse`` calls the blocks last to first
    (forward order differs from registration order)."""

    def __init__(self, n: int, reverse: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM)) for _ in range(n)
        )
        self.head = nn.Linear(DIM, 4)
        self.reverse = reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
        return self.head(x)


def _train(model: nn.Module, rank: int, steps: int = 4) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def auto_vs_hand(world_size: int, rank: int, reverse: bool, bf16: bool) -> dict:
    from fsdp_rs import MixedPrecisionPolicy, auto_shard, auto_shard_groups, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    torch.manual_seed(0)
    auto = Blocks(12, reverse)
    torch.manual_seed(0)
    hand = Blocks(12, reverse)
    example = (torch.zeros(2, DIM),) if reverse else None
    budget = 3000 if not bf16 else 1500  # two blocks a group either way
    groups = auto_shard_groups(auto, group_bytes=budget, example_inputs=example, mp_policy=mp)
    auto_shard(auto, group_bytes=budget, example_inputs=example, mp_policy=mp)
    # the same grouping by hand: the planner's groups, named in `hand`
    names = {id(m): n for n, m in auto.named_modules()}
    by_name = dict(hand.named_modules())
    for group in groups:
        fully_shard([by_name[names[id(m)]] for m in group], mp_policy=mp)
    fully_shard(hand, mp_policy=mp)
    a, h = _train(auto, rank), _train(hand, rank)
    params = [
        torch.equal(p.full_tensor(), q.full_tensor())
        for p, q in zip(auto.parameters(), hand.parameters(), strict=True)
    ]
    return {
        "sizes": [len(g) for g in groups],
        "first": [names[id(g[0])] for g in groups],
        "losses_equal": a == h,
        "losses": a,
        "params_equal": all(params),
    }


SCENARIOS = {
    "registration": (auto_vs_hand, {"reverse": False, "bf16": False}),
    "forward_order_bf16": (auto_vs_hand, {"reverse": True, "bf16": True}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
