"""Step time of the demo transformer sharded per block, eager and compiled
(issue 17's table): fsdp-rs eager, fsdp-rs level 1 (``torch.compile(model)``,
hooks eager), fsdp-rs level 2 (``set_fullgraph_compile()``, then
``torch.compile(model, fullgraph=True)``) and torch FSDP2 with each block
compiled (``block.compile()``), all with inductor, on 2 gloo ranks (CPU) or
with ``--device cuda`` on one NCCL rank per visible GPU::

    PYTHONPATH=python python tools/compile_step_time.py [--dim 256] [--layers 4] [--device cuda]

Prints per setting rank 0's median step time (forward, backward, AdamW step)
over the timed steps, taken in turns with the other settings after every
setting's warm-up, its ratio to fsdp-rs eager, and its last loss (the settings
train the same model on the same tokens).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

# FSDP2 second: a run cut short by a time limit still has the baseline
SETTINGS = ("fsdp-rs eager", "FSDP2 per-block compile", "fsdp-rs level 1", "fsdp-rs level 2")


class _Setting:
    """One setting's model, compiled as the setting says, its optimizer, its
    step count (each setting trains its own copy on the same token sequence)
    and its timed steps."""

    def __init__(self, setting: str, args: argparse.Namespace) -> None:
        from fsdp_rs.demo import Transformer

        if setting.startswith("FSDP2"):
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_rs import fully_shard
        torch.manual_seed(0)
        model = Transformer(args.vocab, args.dim, args.layers, args.heads)
        mesh = init_device_mesh(args.device, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.run: nn.Module = model
        if setting == "fsdp-rs level 1":
            self.run = torch.compile(model)
        elif setting == "fsdp-rs level 2":
            model.set_fullgraph_compile()
            self.run = torch.compile(model, fullgraph=True)
        elif setting.startswith("FSDP2"):
            for block in model.blocks:
                block.compile()
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.steps, self.times, self.loss = 0, [], float("nan")

    def step(self, args: argparse.Namespace, timed: bool) -> None:
        g = torch.Generator().manual_seed(self.steps * 1000 + dist.get_rank())
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        tokens = tokens.to(args.device)
        dist.barrier()
        start = time.perf_counter()
        logits = self.run(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)
        self.steps += 1
        self.loss = loss.item()


def _measure(args: argparse.Namespace, say) -> dict[str, _Setting]:
    """Every setting built and warmed up (compiled), then timed in turns.

    [Note: Interleaved step times]
    A shared machine's speed drifts over minutes (this 2-core VM's eager step read
    398 ms, then 590 ms two minutes later), more than the settings differ. So
    the settings are timed in rounds, each round giving every setting
    ``--steps`` steps in turn, and each row is also given as a ratio to eager
    fsdp-rs, which drifts with it."""
    settings: dict[str, _Setting] = {}
    for name in SETTINGS:
        try:
            settings[name] = _Setting(name, args)
            for _ in range(args.warmup):
                settings[name].step(args, timed=False)
        except Exception as e:  # one setting failing still leaves the others' rows
            settings.pop(name, None)
            say(f"{name:<26} FAILED: {type(e).__name__}: {e}"[:2000])
    for _ in range(args.rounds):
        for setting in settings.values():
            for _ in range(args.steps):
                setting.step(args, timed=True)
    return settings


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # ranks of one host keep their compiled code apart (pytorch/pytorch#188390)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"/tmp/torchinductor_step_time_rank{rank}"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=args.world_size)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
        torch.set_num_threads(1)

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    settings = _measure(args, say)
    base = settings.get("fsdp-rs eager")
    for name, setting in settings.items():
        median = statistics.median(setting.times)
        ratio = "" if base is None else f"   {median / statistics.median(base.times):.3f} x eager"
        say(f"{name:<26} {median * 1e3:8.1f} ms/step{ratio}   last loss {setting.loss:.6f}")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past gloo's teardown ([Note: Leaving a spawned rank])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="per setting per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
        args.world_size = torch.cuda.device_count()
        where = f"{args.world_size} NCCL rank(s) on {torch.cuda.get_device_name(0)}"
    else:
        args.world_size = 2
        where = "2 gloo ranks (CPU, 1 thread each)"
    print(
        f"torch {torch.__version__}, {where}, demo transformer "
        f"{args.layers}x{args.dim}, batch {args.batch}x{args.seq}, inductor, median of "
        f"{args.rounds} rounds of {args.steps} steps after {args.warmup} "
        "([Note: Interleaved step times])"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
