"""Where ``FlatOptimizer.step`` spends its host time (issue 16's 1e4 target):
bench optim's model on a fake process group, gradients set once, then the
step timed whole and by phase, and a cProfile of a few steps::

    PYTHONPATH=python python tools/profile_flat_step.py [--params 10000] [--device cuda]

Phases, per step (ms): ``layout`` (the param groups against the fsdp-rs
groups), ``check`` (each group's whole-buffer test: is every ``.grad`` still
its buffer's view, one C-level pass per group), ``runs`` (the rest of
``_runs``: the run gradients set), ``shadow`` (torch's own step over the runs)
and ``rest`` (the run bookkeeping around it). On CUDA each timing ends with a
``torch.cuda.synchronize()``, so ``shadow`` includes the kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch


def main() -> None:
    from fsdp_rs.bench.optim import OPTIMIZERS, _grads_ready
    from fsdp_rs.bench.training import BenchModel, fake_process_group, shard_model
    from fsdp_rs.optim import FlatOptimizer
    from fsdp_rs.optim.flat import _entry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--block-params", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--optimizer", default="adamw-foreach", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    fake_process_group(args.world_size)
    model = BenchModel(args.params, args.block_params).to(device)
    shard_model(model, "fsdp_rs")
    _grads_ready(model, torch.zeros(4, device=device))
    cls, kwargs = OPTIMIZERS[args.optimizer]
    opt = FlatOptimizer(model.parameters(), cls, **kwargs)
    opt.step()  # states made
    sync()

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        sync()
        return out, (time.perf_counter() - start) * 1e3

    whole = []
    for _ in range(args.steps):
        whole.append(timed(opt.step)[1])

    def phased() -> tuple[dict[str, float], int, int]:
        """One step, taken apart as ``step()`` runs it."""
        out = {}
        (groups, _others), out["layout"] = timed(opt._layout)
        _, out["check"] = timed(lambda: [gs.sb.whole_grad_buffer() for gs in groups])
        stepped, t = timed(lambda: [run for gs in groups for run in opt._runs(gs)])
        out["runs"] = t - out["check"]  # _runs checks again
        _, out["shadow"] = timed(lambda: opt._shadow_step([_entry(run) for run in stepped]))

        def rest():
            for run in stepped:
                run.param.grad = None
                run.buf.counts[run.first : run.last + 1] += 1

        out["rest"] = timed(rest)[1]
        return out, len(groups), len(stepped)

    phases: dict[str, list[float]] = {}
    for _ in range(args.steps):
        one, n_groups, n_runs = phased()
        for name, ms in one.items():
            phases.setdefault(name, []).append(ms)
    print(
        f"torch {torch.__version__}, {device}, {args.params} params in {n_groups} groups, "
        f"{n_runs} runs, {args.optimizer}; median ms of {args.steps} steps"
    )
    print(f"  step (as users call it) {statistics.median(whole):8.3f}")
    for name, values in phases.items():
        print(f"  {name:<22} {statistics.median(values):8.3f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(5):
        opt.step()
    sync()
    profile.disable()
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
