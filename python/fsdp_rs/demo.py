"""Training demo: a small transformer sharded with fsdp-rs and with torch FSDP2.

Run with ``torchrun --nproc-per-node 2 -m fsdp_rs.demo`` (CPU, gloo). Both runs
start from the same weights and see the same per-rank data; rank 0 prints the
loss of every step side by side, the time of ``fully_shard`` over the model and
the mean step time (forward, backward, optimizer step) of each.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight  # weight tying
        nn.init.normal_(self.embed.weight, std=dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def _train(fully_shard: Callable, args: argparse.Namespace) -> tuple[list[float], float, float]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(args.vocab, args.dim, args.layers, args.heads)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # CPU even next to a GPU
    start = time.perf_counter()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    init_s = time.perf_counter() - start
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, step_s = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
    warm = step_s[1:] or step_s
    return losses, init_s, sum(warm) / len(warm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_rs.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc-per-node 2 -m fsdp_rs.demo")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # DTensor creation imports it once: not timed
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp_rs
    import fsdp_rs.runtime  # imported before timing, as torch's FSDP2 is

    ours = _train(fsdp_rs.fully_shard, args)
    theirs = _train(torch_fully_shard, args)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"small transformer, {args.layers} blocks, dim {args.dim}, W={world}, gloo on CPU")
        print(f"{'step':>4}  {'fsdp-rs loss':>13}  {'torch FSDP2 loss':>16}  equal")
        for step, (a, b) in enumerate(zip(ours[0], theirs[0], strict=True)):
            print(f"{step:>4}  {a:>13.6f}  {b:>16.6f}  {'yes' if a == b else 'no'}")
        print(f"fully_shard (all blocks + root): fsdp-rs {ours[1] * 1e3:.1f} ms, "
              f"torch FSDP2 {theirs[1] * 1e3:.1f} ms")  # fmt: skip
        print(f"mean step time (after the first): fsdp-rs {ours[2] * 1e3:.1f} ms, "
              f"torch FSDP2 {theirs[2] * 1e3:.1f} ms")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
