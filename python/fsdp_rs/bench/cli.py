"""Command line of ``python -m fsdp_rs.bench``: one subcommand per benchmark.

Each subcommand has an ``_add_<name>`` function that declares its options and
sets ``run`` to the function that executes it and returns the exit status.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from collections.abc import Sequence

from fsdp_rs.bench.shapes import MIXES

__all__ = ["build_parser", "main"]

DEFAULT_PARAMS = (1_000, 10_000, 100_000, 1_000_000)
STEP_DEFAULT_PARAMS = (1_000, 10_000, 100_000)
INIT_TORCH_MAX_PARAMS = 100_000
# torch FSDP2 in `bench step` by default only up to these N: its AdamW step over
# DTensor parameters takes seconds a step above 1e3 (every round after the
# sharding caches are emptied: [Note: One process, two libraries]), and its
# forward + backward about 0.5 s a step at 1e4, minutes a round at 1e5.
STEP_TORCH_MAX_PARAMS = {"adamw": 1_000, "none": 10_000}
DEFAULT_BLOCK_PARAMS = 100
DEFAULT_WORLD_SIZE = 8
DEFAULT_REPEAT = 5
# Rounds of `bench step`: one round's overhead is the difference of two noisy
# step times and on a shared 2-core machine swings by +-50%, so the median
# needs many rounds where they are cheap (up to 1e4 params: seconds a round),
# and gets fewer where a round takes a minute.
STEP_ROUNDS_SMALL, STEP_ROUNDS_LARGE, STEP_SMALL_MAX_PARAMS = 15, 5, 10_000
COPY_CASES = ("a", "b", "c", "d", "e")  # fsdp_rs.bench.copy.CASES; `plan` must not import torch
COPY_DEFAULT_DTYPES = "fp32,bf16,fp32"
COPY_CUDA_REPEAT = 50
DTYPE_NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def positive_int(text: str) -> int:
    """An integer >= 1; accepts ``1000``, ``1_000`` and ``1e3``."""
    try:
        value = int(text)
    except ValueError:
        try:
            as_float = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not as_float.is_integer():
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        value = int(as_float)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def scale_fraction(text: str) -> float:
    """A float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def dtype_triple(text: str) -> tuple[str, str, str]:
    """``ORIG,PARAM,REDUCE`` (or one name for all three) as torch dtype names."""
    names = [n.strip().lower() for n in text.split(",")]
    if len(names) == 1:
        names *= 3
    if len(names) != 3:
        raise argparse.ArgumentTypeError(
            f"expected ORIG,PARAM,REDUCE (e.g. {COPY_DEFAULT_DTYPES}), got {text!r}"
        )
    unknown = [n for n in names if n not in DTYPE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {unknown[0]!r}; choose from fp32, bf16, fp16"
        )
    orig, param, reduce = (DTYPE_NAMES[n] for n in names)
    return orig, param, reduce


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="time the Rust planner against the pure-Python reference",
        description=(
            "Time fsdp_rs._core.plan_group (FSDP2) and plan_flat (FSDP1) from Python on N "
            "deterministic parameter shapes, against the pure-Python reference, and check "
            "both give the same tables. Exits 1 if any output differs."
        ),
    )
    p.add_argument(
        "--params",
        metavar="N",
        type=positive_int,
        action="append",
        help="parameters in the group; repeat for a sweep (default: 1e3 1e4 1e5 1e6)",
    )
    p.add_argument(
        "--world-size",
        metavar="W",
        type=positive_int,
        default=DEFAULT_WORLD_SIZE,
        help=f"data-parallel world size (default: {DEFAULT_WORLD_SIZE})",
    )
    p.add_argument("--rank", type=non_negative_int, default=0, help="rank to plan for (default: 0)")
    p.add_argument(
        "--mix",
        choices=MIXES,
        default="auto",
        help="shape mix; auto scales dense/MoE/adapter tensors with N and W (default: auto)",
    )
    p.add_argument("--seed", type=int, default=0, help="shape generator seed (default: 0)")
    p.add_argument(
        "--repeat",
        metavar="K",
        type=positive_int,
        default=DEFAULT_REPEAT,
        help=f"timed fsdp-rs calls per N; the median is reported (default: {DEFAULT_REPEAT})",
    )
    p.add_argument(
        "--reference-repeat",
        metavar="K",
        type=positive_int,
        help="timed reference calls per N (default: --repeat up to N=1e4, then 1)",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the reference (speedup and outputs_equal are then null)",
    )
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a log-log time-vs-N plot (PNG)")
    p.set_defaults(run=_run_plan, parser=p)


def _run_plan(args: argparse.Namespace) -> int:
    from fsdp_rs.bench import report
    from fsdp_rs.bench.plan import bench_plan, environment

    if args.rank >= args.world_size:
        args.parser.error(f"--rank must be < --world-size ({args.world_size}), got {args.rank}")
    if args.plot and not report.matplotlib_available():
        args.parser.error(report.MATPLOTLIB_HINT)

    env = environment()
    records = []
    for n in args.params or DEFAULT_PARAMS:
        record = bench_plan(
            n,
            args.world_size,
            rank=args.rank,
            mix=args.mix,
            seed=args.seed,
            repeat=args.repeat,
            reference=not args.no_reference,
            reference_repeat=args.reference_repeat,
        )
        print(
            f"N={n} W={args.world_size}: {record.shape_mix}, "
            f"{record.total_elements:.3e} elements (shapes in {record.shape_gen_s * 1e3:.1f} ms)",
            file=sys.stderr,
            flush=True,
        )
        for difference in record.differences:
            print(f"  MISMATCH {difference}", file=sys.stderr)
        records.append({**record.as_dict(), **env})

    print(report.plan_tables(records))
    if args.json:
        report.write_json(records, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        report.plot_plan_times(records, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)

    mismatched = [
        r["n_params"]
        for r in records
        if r["outputs_equal"] is False or r["flat_outputs_equal"] is False
    ]
    if mismatched:
        print(f"error: fsdp-rs and the reference differ for N in {mismatched}", file=sys.stderr)
        return 1
    return 0


def _add_copy(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "copy",
        help="time the fsdp-rs copy ops against FSDP2's torch copies",
        description=(
            "Time the fsdp-rs ops all_gather_copy_in, all_gather_copy_out, "
            "reduce_scatter_copy_in and post_reduce (assign and accumulate), called as the "
            "runtime calls them, against the torch copies FSDP2 does for the same step and a "
            "plain copy_ of the same bytes, on five parameter groups: (a) 8 x 64M elements, "
            "(b) a 7B transformer layer, (c) 10,000 x 4096 elements, (d) 2,000 MoE experts x "
            "3 matrices, (e) 3 stacked experts sharded on dim 1. On CPU the fsdp-rs ops run "
            "their plain-torch CPU impls. Exits 1 if any output differs from torch's."
        ),
    )
    p.add_argument(
        "--world-size",
        metavar="W",
        type=positive_int,
        action="append",
        help=f"data-parallel world size; repeat for several (default: {DEFAULT_WORLD_SIZE})",
    )
    p.add_argument(
        "--case",
        choices=COPY_CASES,
        action="append",
        help="parameter group; repeat for several (default: every case)",
    )
    p.add_argument(
        "--dtypes",
        metavar="ORIG,PARAM,REDUCE",
        type=dtype_triple,
        action="append",
        help=(
            "mixed precision: orig (sharded param), param (all-gather) and reduce dtypes, "
            f"each fp32, bf16 or fp16; repeat for several (default: {COPY_DEFAULT_DTYPES})"
        ),
    )
    p.add_argument(
        "--scale",
        metavar="F",
        type=scale_fraction,
        help=(
            "in (0, 1]: shrink dim 0 of every param (cases a, b) or the number of params "
            "(c, d, never below 100) (default: 1 on CUDA, 1/32 on CPU)"
        ),
    )
    p.add_argument(
        "--repeat",
        metavar="K",
        type=positive_int,
        help=(
            f"timed calls per measurement; the median is reported (default: {DEFAULT_REPEAT} "
            f"on CPU, {COPY_CUDA_REPEAT} on CUDA)"
        ),
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="device to run on (default: cuda if available, else cpu)",
    )
    p.add_argument(
        "--steps",
        action="store_true",
        help=(
            "also time the ops with their collectives as a training step runs them "
            "(unshard: copy-in, all-gather, copy-out; reduce: copy-in, reduce-scatter, "
            "post-reduce) against FSDP2's, on the default process group: one rank in "
            "this process with --world-size 1, or torchrun's ranks"
        ),
    )
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of speedup per case/op (PNG)")
    p.set_defaults(run=_run_copy, parser=p)


def _run_copy(args: argparse.Namespace) -> int:
    import torch

    from fsdp_rs.bench import copy, report
    from fsdp_rs.bench.plan import environment

    if args.plot and not report.matplotlib_available():
        args.parser.error(report.MATPLOTLIB_HINT)
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        args.parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    on_cpu = device.type == "cpu"
    scale = args.scale if args.scale is not None else (copy.CPU_DEFAULT_SCALE if on_cpu else 1.0)
    repeat = args.repeat or (DEFAULT_REPEAT if on_cpu else COPY_CUDA_REPEAT)
    worlds = args.world_size or [DEFAULT_WORLD_SIZE]
    if args.steps:
        from fsdp_rs.bench.copy_step import ensure_process_group

        if len(worlds) > 1:
            args.parser.error("--steps: one --world-size, the process group's")
        try:
            ensure_process_group(device, worlds[0])
        except ValueError as e:
            args.parser.error(str(e))
    mixes = [copy.Dtypes.from_names(d) for d in args.dtypes or [dtype_triple(COPY_DEFAULT_DTYPES)]]
    if on_cpu:
        print("CPU: the fsdp-rs ops run their plain-torch CPU impls (not the Triton kernels)")
    env = environment()
    records = []
    for world_size in worlds:
        for dtypes in mixes:
            print(
                f"copy ops on {device.type} ({copy.device_name(device)}), W={world_size}, "
                f"rank 0, dtypes: {dtypes}, scale {scale:g}, median of {repeat} calls"
            )
            found = _copy_records(args, copy, world_size, dtypes, scale, device, repeat)
            records += [{**r, "scale": scale, **env} for r in found]
            if len(worlds) * len(mixes) > 1:
                print(report.copy_table(found), flush=True)

    if len(worlds) * len(mixes) == 1:
        print(report.copy_table(records))
    if args.json:
        report.write_json(records, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        report.plot_copy_speedups(records, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)

    mismatched = [
        f"W={r['world_size']} {r['param_dtype']}:{r['case']}:{r['op']}"
        for r in records
        if not r["outputs_equal"]
    ]
    if mismatched:
        print(f"error: fsdp-rs and torch outputs differ for {mismatched}", file=sys.stderr)
        return 1
    return 0


def _copy_records(args, copy, world_size, dtypes, scale, device, repeat) -> list[dict]:
    """The records of every case asked for at one world size and dtype mix."""
    records = []
    for key in args.case or COPY_CASES:
        case = copy.make_case(key, scale)
        if not copy.divides(case, world_size):
            if args.case:
                args.parser.error(f"--case {key} shards dim 1 evenly: W must divide 64")
            print(f"  ({key}) skipped: W={world_size} does not divide its dim 1")
            continue
        print(
            f"  ({key}) {case.name}: {len(case.shapes)} params, {case.numel:.3e} elements",
            flush=True,
        )
        ops = copy.OPS
        if args.steps and not case.dims:  # (Shard(1) groups: the op rows only)
            from fsdp_rs.bench.copy_step import STEPS

            ops = (*ops, *STEPS)
        for record in copy.bench_case(case, dtypes, world_size, device, repeat, ops=ops):
            if not record["outputs_equal"]:
                print(
                    f"  MISMATCH W={world_size} case {key} {record['op']}: fsdp-rs != torch",
                    file=sys.stderr,
                )
            records.append(record)
    return records


def _short(n: int) -> str:
    """1e4 for 10000."""
    return f"{n:.0e}".replace("e+0", "e")


def _add_training_options(p: argparse.ArgumentParser, default_params: Sequence[int]) -> None:
    shown = " ".join(map(_short, default_params))
    p.add_argument(
        "--params",
        metavar="N",
        type=positive_int,
        action="append",
        help=f"parameter tensors in the model; repeat for a sweep (default: {shown})",
    )
    p.add_argument(
        "--world-size",
        metavar="W",
        type=positive_int,
        default=DEFAULT_WORLD_SIZE,
        help=f"fake process group size (default: {DEFAULT_WORLD_SIZE})",
    )
    p.add_argument(
        "--block-params",
        metavar="K",
        type=positive_int,
        default=DEFAULT_BLOCK_PARAMS,
        help=(
            "parameter tensors per block; each block is one fully_shard group "
            f"(default: {DEFAULT_BLOCK_PARAMS})"
        ),
    )
    p.add_argument("--seed", type=int, default=0, help="parameter init seed (default: 0)")
    p.add_argument(
        "--tp",
        metavar="T",
        type=positive_int,
        default=1,
        help=(
            "tensor-parallel size: a (W/T, T) mesh, every parameter a DTensor sharded on "
            "dim 0 over T, fully_shard over the other dim; T must divide W and 8 (default: 1)"
        ),
    )
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")


def _add_init(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "init",
        help="time fully_shard: fsdp-rs against torch FSDP2",
        description=(
            "Time fully_shard (per block, then the root) on a model of N small parameter "
            "tensors, fsdp-rs and torch FSDP2 side by side, on a fake process group "
            "(rank 0 of W; no communication); with --tp 1 also the floor: the copy, view, "
            "DTensor and swap every FSDP makes per parameter, made bare "
            "(fsdp_rs.bench.floor)."
        ),
    )
    _add_training_options(p, DEFAULT_PARAMS)
    p.add_argument(
        "--torch-max-params",
        metavar="N",
        type=positive_int,
        default=INIT_TORCH_MAX_PARAMS,
        help=(
            "time torch FSDP2 only up to N parameters; it takes about 0.35 ms per parameter "
            f"(default: {INIT_TORCH_MAX_PARAMS:.0e})"
        ),
    )
    p.set_defaults(run=_run_training, parser=p, bench="init")


def _add_step(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "step",
        help="time the per-step bookkeeping: fsdp-rs against torch FSDP2",
        description=(
            "Time a training step (zero_grad(set_to_none=True), forward, backward, an AdamW "
            "step: fsdp-rs's through FlatOptimizer) of the same model unsharded, sharded by "
            "fsdp-rs and by torch FSDP2 per block, and by fsdp-rs's auto_shard (the planner's "
            "groups), on a fake process group (rank 0 of W), in rounds (per model one "
            "untimed and two timed steps); the bookkeeping overhead is the median over rounds "
            "of a library's step time minus the unsharded one, per parameter and per group. "
            "With --optimizer none and --tp 1 also the floor: the hooks, collectives, "
            "copies and swaps every FSDP makes per group and step, made bare "
            "(fsdp_rs.bench.floor)."
        ),
    )
    _add_training_options(p, STEP_DEFAULT_PARAMS)
    p.add_argument(
        "--model",
        choices=("blocks", "linears"),
        default="blocks",
        help=(
            "blocks: blocks of --block-params small tensors; linears: --params / 2 "
            "nn.Linear(8, 8) modules, each its own group (pytorch/pytorch#173680's shape; "
            "--block-params is ignored) (default: blocks)"
        ),
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "none"),
        default="adamw",
        help="the step's optimizer: foreach AdamW, or none (forward + backward only)",
    )
    p.add_argument(
        "--torch-max-params",
        metavar="N",
        type=positive_int,
        help=(
            "time torch FSDP2 only up to N parameters (its columns are '-' above); "
            f"default: {STEP_TORCH_MAX_PARAMS['adamw']:.0e} with the AdamW step, "
            f"{STEP_TORCH_MAX_PARAMS['none']:.0e} with --optimizer none"
        ),
    )
    p.add_argument(
        "--repeat",
        metavar="K",
        type=positive_int,
        help=(
            "rounds (per model: one untimed, two timed steps); medians over rounds are "
            f"reported (default: {STEP_ROUNDS_SMALL} up to N={_short(STEP_SMALL_MAX_PARAMS)}, "
            f"then {STEP_ROUNDS_LARGE})"
        ),
    )
    p.set_defaults(run=_run_training, parser=p, bench="step")


def _run_training(args: argparse.Namespace) -> int:
    from fsdp_rs.bench import report, training
    from fsdp_rs.bench.plan import environment

    if args.world_size % args.tp or 8 % args.tp:
        args.parser.error(f"--tp {args.tp} must divide --world-size ({args.world_size}) and 8")
    env = environment()
    records = []
    default = DEFAULT_PARAMS if args.bench == "init" else STEP_DEFAULT_PARAMS
    mesh = f"mesh (dp={args.world_size // args.tp}, tp={args.tp})" if args.tp > 1 else "1-D"
    blocks = f"blocks of {args.block_params} params"
    if args.bench == "step" and args.model == "linears":
        blocks = "nn.Linear(8, 8) modules (2 params each)"
    elif args.bench == "step":
        blocks += f", optimizer {args.optimizer}"
    print(
        f"{args.bench}: fake process group W={args.world_size} (rank 0), {mesh}, {blocks}, "
        "one fully_shard group per block plus the root (auto: auto_shard's groups); "
        "each N in a fresh process",
        flush=True,
    )
    # Each N in a fresh interpreter: what an earlier N left in the heap (torch
    # FSDP2 at 1e5 creates and frees tens of millions of objects) slowed the
    # next one, fsdp-rs at 1e6 by a third.
    spawn = multiprocessing.get_context("spawn")
    for n in args.params or default:
        model = (n, args.world_size, args.block_params)
        if args.bench == "init":
            torch_too = n <= args.torch_max_params
            measure, measure_args = training.bench_init, (*model, torch_too)
        else:
            default_rounds = STEP_ROUNDS_SMALL if n <= STEP_SMALL_MAX_PARAMS else STEP_ROUNDS_LARGE
            measure, measure_args = training.bench_step, (*model, args.repeat or default_rounds)
        options = {"seed": args.seed, "tp": args.tp}
        if args.bench == "step":
            cap = args.torch_max_params or STEP_TORCH_MAX_PARAMS[args.optimizer]
            options.update(model=args.model, optimizer=args.optimizer, torch_too=n <= cap)
        with spawn.Pool(1) as worker:
            record = worker.apply(measure, measure_args, options)
        print(f"  N={n}: done", file=sys.stderr, flush=True)
        records.append({**record, **env})

    table = report.init_table if args.bench == "init" else report.step_table
    print(table(records))
    if args.json:
        report.write_json(records, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _add_memory(subparsers) -> None:
    p = subparsers.add_parser(
        "memory",
        help="memory per phase of a training step, fsdp-rs vs torch FSDP2",
        description=(
            "Train the same model (an MLP or a transformer; one fully_shard per block plus "
            "the root, AdamW) under "
            "fsdp-rs and under torch FSDP2 in one process and print the memory of the "
            "last step per phase (after init, forward, peak, optimizer step, zero_grad) "
            "side by side. CPU: a fake process group (rank 0 of W) and MemTracker; "
            "CUDA (--device cuda): one GPU with a fake process group and the allocator's "
            "statistics. The peak rows also print the planner's predicted peak for "
            "fsdp-rs (made before the first step) and its error against the measured one."
        ),
    )
    p.add_argument("--world-size", type=int, default=4, metavar="W", help="(default: 4)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dim", type=int, default=1024, help="layer width (default: 1024)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default: 4)")
    p.add_argument(
        "--model",
        choices=("mlp", "transformer"),
        default="mlp",
        help="blocks of Linear + ReLU, or fsdp_rs.demo's transformer (vocabulary 1024, "
        "64 tokens a sequence, dim // 64 heads) (default: mlp)",
    )
    p.add_argument("--config", action="append", help="one of the configs; repeat (default: all)")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.set_defaults(run=_run_memory, parser=p)


def _run_memory(args: argparse.Namespace) -> int:
    import json

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_rs.bench.memory import CONFIGS, records

    if args.world_size < 2:
        args.parser.error("--world-size must be at least 2")
    unknown = sorted(set(args.config or []) - set(CONFIGS))
    if unknown:
        args.parser.error(f"unknown --config {unknown}; choose from {sorted(CONFIGS)}")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    names = args.config or [n for n, (w, _) in CONFIGS.items() if w <= args.world_size]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        recs = records(
            args.world_size, device, names, dim=args.dim, layers=args.layers, model=args.model
        )
    finally:
        dist.destroy_process_group()
    print(f"memory: {recs[0]['model']}, W={args.world_size} (rank 0), {device.type}, MiB")
    print(
        f"{'config':26s} {'phase':10s} {'fsdp-rs':>9s} {'torch':>9s} {'ratio':>6s} "
        f"{'predicted':>9s} {'error':>7s}"
    )
    for r in recs:
        line = (
            f"{r['config']:26s} {r['phase']:10s} {r['fsdp_rs_bytes'] / 2**20:9.2f} "
            f"{r['torch_bytes'] / 2**20:9.2f} {r['ratio']:6.3f}"
        )
        if r["predicted_bytes"] is not None:
            error = r["predicted_bytes"] / r["fsdp_rs_bytes"] - 1
            line += f" {r['predicted_bytes'] / 2**20:9.2f} {error:+7.2%}"
        if r.get("fsdp_rs_requested_bytes") is not None:  # CUDA: [Note: Requested bytes]
            a, b = r["fsdp_rs_requested_bytes"], r["torch_requested_bytes"]
            line += f"  requested {a / 2**20:.2f} / {b / 2**20:.2f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    return 0


def _add_optim(subparsers) -> None:
    p = subparsers.add_parser(
        "optim",
        help="optimizer step: unsharded, FSDP2, fsdp-rs per parameter, fsdp-rs flat",
        description=(
            "Time the optimizer step of bench step's model (blocks of 100 parameter "
            "tensors) side by side: the unsharded model's, torch FSDP2 + the "
            "per-parameter optimizer, fsdp-rs + the per-parameter optimizer, fsdp-rs + "
            "fsdp_rs.optim.FlatOptimizer; then a whole training step (forward, backward, "
            "clip, step, zero_grad) under FSDP2 and under fsdp-rs + flat. One process, "
            "torch's fake process group (rank 0 of W). Checks that the two fsdp-rs "
            "models end with equal shards."
        ),
    )
    p.add_argument(
        "--params",
        type=positive_int,
        action="append",
        metavar="N",
        help="parameter tensors; repeat (default: 1e3 and 1e4)",
    )
    p.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, metavar="W")
    p.add_argument("--block-params", type=positive_int, default=DEFAULT_BLOCK_PARAMS)
    p.add_argument(
        "--optimizer",
        default="adamw",
        help=("adamw, adamw-foreach (torch's CUDA default, forced), adam or sgd (default: adamw)"),
    )
    p.add_argument("--repeat", type=positive_int, default=DEFAULT_REPEAT)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--columns",
        default="plain,torch,fsdp_rs,flat,step",
        help=(
            "comma-separated columns to time: plain, torch (FSDP2), fsdp_rs (per "
            "parameter), flat, step (the whole training step, FSDP2 against flat, and the "
            "unsharded model's with plain); flat and torch or fsdp_rs are required "
            "(default: all)"
        ),
    )
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.set_defaults(run=_run_optim, parser=p)


def _run_optim(args: argparse.Namespace) -> int:
    import torch

    from fsdp_rs.bench.optim import OPTIMIZERS, bench_optim, check_columns
    from fsdp_rs.bench.report import write_json

    if args.optimizer not in OPTIMIZERS:
        args.parser.error(
            f"unknown --optimizer {args.optimizer!r}; choose from {sorted(OPTIMIZERS)}"
        )
    if args.world_size < 1:
        args.parser.error("--world-size must be at least 1")
    columns = tuple(c.strip() for c in args.columns.split(",") if c.strip())
    try:
        check_columns(columns)
    except ValueError as e:
        args.parser.error(f"--columns: {e}")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    print(f"optim: {args.optimizer}, W={args.world_size} (rank 0), {device.type}, ms per step")
    head = ("params", "plain", "FSDP2", "rs", "rs flat", "flat vs FSDP2", "step FSDP2")
    tail = ("step rs flat", "step speedup", "step plain", "equal")
    print(" ".join(f"{h:>13s}" for h in (*head, *tail)))

    def ms(s):
        return f"{'-':>13s}" if s is None else f"{s * 1e3:13.2f}"

    def times(x):
        return f"{'-':>12s} " if x is None else f"{x:12.1f}x"

    def progress(line: str) -> None:  # each column as it ends: a time limit keeps them
        print(f"  ({line})", file=sys.stderr, flush=True)

    recs = []
    for n in args.params or (1_000, 10_000):
        r = bench_optim(
            n,
            args.world_size,
            args.block_params,
            args.optimizer,
            args.repeat,
            device,
            columns,
            progress=progress,
        )
        recs.append(r)
        cols = [r["plain_s"], r["torch_s"], r["fsdp_rs_s"], r["fsdp_rs_flat_s"]]
        print(
            f"{r['n_params']:>13d} "
            + " ".join(map(ms, cols))
            + f" {times(r['flat_speedup'])}{ms(r['step_torch_s'])}"
            + f" {ms(r['step_fsdp_rs_flat_s'])} {times(r['step_speedup'])}"
            + f"{ms(r['step_plain_s'])}{r['equal']!s:>13s}",
            flush=True,
        )
        if args.json:  # after each size, for the same reason
            write_json(recs, args.json)
    return 0 if all(r["equal"] for r in recs) else 1


def _add_modules(subparsers) -> None:
    p = subparsers.add_parser(
        "modules",
        help="many tiny modules on 2 gloo ranks: DDP, FSDP2, fsdp-rs per block, root, auto",
        description=(
            "pytorch/pytorch#173680's shape on real ranks: 2 spawned CPU processes (gloo, "
            "one thread each) train a model of N blocks Sequential(Linear(d, d), "
            "LayerNorm(d)) with AdamW under each column from the same weights and data: "
            "ddp (torch DDP), fsdp2 (torch fully_shard per block, then the root), fsdp_rs "
            "(fsdp_rs.fully_shard per block, then the root), fsdp_rs_root (the root alone), "
            "fsdp_rs_auto (fsdp_rs.auto_shard up to --group-bytes), fsdp_rs_hand "
            "(fsdp_rs.fully_shard over the groups auto_shard_groups plans, then the "
            "root). Prints per column the median step time (the "
            "slower rank's), its ratio to DDP's, the groups, the collectives of one step, "
            "the final loss, and with --memory the peak of live tensors per rank over "
            "sharding and warm-up (MemTracker). Exits 1 if the sharded columns' losses differ."
        ),
    )
    p.add_argument("--blocks", type=positive_int, default=300, metavar="N", help="(default: 300)")
    p.add_argument("--dim", type=positive_int, default=16, metavar="D", help="(default: 16)")
    p.add_argument(
        "--steps", type=positive_int, default=10, help="timed steps per column (default: 10)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed steps first (default: 2)"
    )
    p.add_argument(
        "--group-bytes",
        type=positive_int,
        default=2**20,
        metavar="B",
        help="unsharded bytes per group of fsdp_rs_auto and fsdp_rs_hand (default: 1048576)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    p.add_argument(
        "--optimizer",
        choices=("flat", "adamw"),
        default="flat",
        help=(
            "flat: the fsdp-rs columns step AdamW through fsdp_rs.optim.FlatOptimizer, the "
            "others torch's AdamW; adamw: torch's AdamW everywhere (default: flat)"
        ),
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help=(
            "also each rank's peak of live tensors over sharding and the warm-up steps "
            "(MemTracker; those then run about 3 times slower, the timed steps do not)"
        ),
    )
    p.add_argument(
        "--columns",
        help=(
            "comma-separated subset of ddp,fsdp2,fsdp_rs,fsdp_rs_root,fsdp_rs_auto,"
            "fsdp_rs_hand (default: all)"
        ),
    )
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.set_defaults(run=_run_modules, parser=p)


def _run_modules(args: argparse.Namespace) -> int:
    from fsdp_rs.bench import report
    from fsdp_rs.bench.modules import COLUMNS, SHARDED, WORLD_SIZE, bench_modules
    from fsdp_rs.bench.plan import environment

    if args.columns is None:
        columns = COLUMNS
    else:
        columns = tuple(dict.fromkeys(c.strip() for c in args.columns.split(",") if c.strip()))
        unknown = [c for c in columns if c not in COLUMNS]
        if unknown or not columns:
            args.parser.error(f"--columns: unknown {unknown}; choose from {','.join(COLUMNS)}")
    print(
        f"modules: {args.blocks} blocks Linear({args.dim}, {args.dim}) + LayerNorm, "
        f"W={WORLD_SIZE} gloo ranks on CPU, {args.warmup} warm-up + {args.steps} timed "
        f"steps, median step (slower rank), collectives of one step, optimizer "
        f"{args.optimizer}",
        flush=True,
    )
    records = bench_modules(
        columns,
        blocks=args.blocks,
        dim=args.dim,
        steps=args.steps,
        warmup=args.warmup,
        group_bytes=args.group_bytes,
        seed=args.seed,
        memory=args.memory,
        optimizer=args.optimizer,
    )
    env = environment()
    records = [{**r, **env} for r in records]
    print(report.modules_table(records))
    if args.json:
        report.write_json(records, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    sharded = [r for r in records if r["column"] in SHARDED]
    differ = [r["column"] for r in sharded if not r["losses_equal"]]
    if differ:
        print(
            f"error: the losses of {differ} differ from {sharded[0]['losses_equal_to']}'s",
            file=sys.stderr,
        )
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_rs.bench",
        description="fsdp-rs microbenchmarks.",
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_plan(subparsers)
    _add_copy(subparsers)
    _add_init(subparsers)
    _add_step(subparsers)
    _add_memory(subparsers)
    _add_optim(subparsers)
    _add_modules(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m fsdp_rs.bench``; returns the exit status (argparse exits 2 on bad input)."""
    args = build_parser().parse_args(argv)
    return args.run(args)
