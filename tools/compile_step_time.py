"""Step time of the demo transformer sharded per block, eager and compiled
(issue 17's table): fsdp-rs eager, fsdp-rs level 1 (``torch.compile(model)``,
hooks eager), fsdp-rs level 2 (``set_fullgraph_compile()``, then
``torch.compile(model, fullgraph=True)``) and torch FSDP2 with each block
compiled (``block.compile()``), all with inductor, on 2 gloo ranks (CPU) or
with ``--device cuda`` on one NCCL rank per visible GPU::

    PYTHONPATH=python python tools/compile_step_time.py [--dim 256] [--layers 4] [--device cuda]

Prints per setting the median step time over the steps after the warm-up
(forward, backward, AdamW step), rank 0's, and the last loss of each rank-0
run (the settings train the same model on the same tokens).
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


def _run(setting: str, args: argparse.Namespace) -> tuple[float, float]:
    from fsdp_rs.demo import Transformer

    if setting.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_rs import fully_shard
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(args.vocab, args.dim, args.layers, args.heads)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run: nn.Module = model
    if setting == "fsdp-rs level 1":
        run = torch.compile(model)
    elif setting == "fsdp-rs level 2":
        model.set_fullgraph_compile()
        run = torch.compile(model, fullgraph=True)
    elif setting.startswith("FSDP2"):
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        tokens = tokens.to(args.device)
        dist.barrier()
        start = time.perf_counter()
        logits = run(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), loss.item()


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
    for setting in SETTINGS:
        try:
            median, loss = _run(setting, args)
        except Exception as e:  # one setting failing still leaves the others' rows
            if rank == 0:
                print(f"{setting:<26} FAILED: {type(e).__name__}: {e}"[:2000], flush=True)
            continue
        if rank == 0:
            print(f"{setting:<26} {median * 1e3:8.1f} ms/step   last loss {loss:.6f}", flush=True)
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
    parser.add_argument("--steps", type=int, default=10)
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
        f"{args.steps} steps after {args.warmup}"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
