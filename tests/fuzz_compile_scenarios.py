"""Differential fuzzing of torch.compile: the fuzz's seeded random models and
training loops (``fuzz_scenarios.config``) trained by fsdp-rs eager and by
fsdp-rs compiled, on gloo; losses, each step's whole gradients and the final
parameters compared bit for bit.

What a seed draws on top of its fuzz run: the compile level (1: hooks eager,
[Note: Eager hooks under torch.compile]; 2: ``set_fullgraph_compile()``,
[Note: Traced hooks]), the backend (``aot_eager`` or ``eager``: both compute
what eager computes, op for op) and ``dynamic`` (None or True). Compiled with
``fullgraph=False``: what the traced hooks do not follow (micro-steps without
sync, an explicit ``unshard()``, a ``requires_grad`` flipped, an evaluation
forward) must still train as eager does, by running the eager hooks there.

``python tests/fuzz_compile_scenarios.py FIRST LAST [W]`` runs seeds
FIRST..LAST-1 and prints each one that differs with its configuration."""

from __future__ import annotations

import random
import sys

import torch
import torch.distributed as dist

from fuzz_scenarios import config as fuzz_config
from fuzz_scenarios import first_difference, train


def config(seed: int, world_size: int = 2) -> dict:
    """The fuzz run of ``seed`` and how it is compiled (plain data)."""
    r = random.Random(seed * 104729 + 17)
    return fuzz_config(seed, world_size) | {
        "level": r.choice([1, 2]),
        "backend": r.choice(["aot_eager", "aot_eager", "eager"]),
        "dynamic": r.choice([None, None, True]),
    }


def may_refuse(cfg: dict) -> bool:
    """Whether the traced hooks may stop the run with an error on every rank:
    branches on alternate ranks leave a parameter without a gradient on some
    ranks only, which a traced backward refuses ([Note: Unused parameters
    under trace]) where eager agrees on it ([Note: Gradient agreement])."""
    branches = any(b["branch"] for b in cfg["blocks"])
    return cfg["level"] == 2 and cfg["rank_branch"] and branches


REFUSAL = "a parameter got a gradient on some ranks and none on others"


def _compiler(cfg: dict):
    def compiled(model):
        if cfg["level"] == 2:
            model.set_fullgraph_compile()
        return torch.compile(model, backend=cfg["backend"], dynamic=cfg["dynamic"])

    return compiled


def run_seed(world_size: int, rank: int, seed: int) -> dict:
    """One seed on this rank: where compiled fsdp-rs differs from eager, or
    what it raised; None where equal."""
    cfg = config(seed, world_size)
    eager = train(cfg, "rs", rank)
    dist.barrier()
    torch._dynamo.reset()
    # every call the loop makes may be its own graph (grad mode, the phase, the
    # flags the traced hooks do not follow): none may fall back for the limit
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        try:
            compiled = train(cfg, "rs", rank, compiled=_compiler(cfg))
        except Exception as e:
            torch._dynamo.reset()
            text = f"{type(e).__name__}: {e}"
            short = text if len(text) < 900 else text[:300] + text[-600:]
            return {"vs_eager": None, "error": short}
    torch._dynamo.reset()
    return {"vs_eager": first_difference(eager, compiled)}


def run(world_size: int, rank: int, name: str) -> dict:
    result = run_seed(world_size, rank, int(name.removeprefix("seed")))
    dist.barrier()
    return result


def problem(cfg: dict, results: list[dict]) -> str | None:
    """What is wrong with one seed's results on every rank, or None: compiled
    differs from eager, or raised other than the refusal ``may_refuse`` allows
    (raised by every rank alike)."""
    errors = [r.get("error") for r in results]
    if any(errors):
        refused = all(e and REFUSAL in e for e in errors)
        if not (refused and may_refuse(cfg)):
            return f"raised: {errors}"
        return None
    differs = [r["vs_eager"] for r in results if r["vs_eager"]]
    return f"compiled differs from eager: {differs}" if differs else None


if __name__ == "__main__":
    from spawned import run_seeds_cli

    names, ranks, world_size = run_seeds_cli(run, sys.argv)
    refused = 0
    for name in names:
        cfg = config(int(name.removeprefix("seed")), world_size)
        results = [r.get(name, {"vs_eager": "missing"}) for r in ranks]
        found = problem(cfg, results)
        refused += any(r.get("error") for r in results) and not found
        if found:
            print(name, found, cfg)
    print(f"{len(names)} seeds run, {refused} refused as allowed")
