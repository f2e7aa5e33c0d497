"""Time the copy kernels under other launch settings (issue 18's bandwidth rows):
``BLOCK`` (elements per loop step of a program) and the warps per program
([Note: Launch settings] in ``fsdp_rs/kernels/_triton.py``), on ``bench
copy``'s groups, timed as ``bench copy`` times
(median of CUDA-event-timed calls, L2 flushed), next to a plain ``copy_`` of
the same bytes and FSDP2's torch copy::

    PYTHONPATH=python python tools/sweep_copy_kernels.py --device cuda [--case a --case b]

(every case by default).

Kernels: ``all_gather_copy_out`` (into the group's unsharded buffer),
``reduce_scatter_copy_in`` (from per-parameter gradients) and
``reduce_scatter_copy_in_flat`` (from the group's unsharded gradient buffer,
the runtime's usual path). Each setting's output is compared bit for bit with
the shipped setting's before it is timed. The first row of each kernel is the
setting the kernel picks for the group (``launch_setting``). The Triton
launchers are called directly (on CPU under ``TRITON_INTERPRET=1``, tiny: a
check of this script, whose timings mean nothing).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch


def _settings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        block, warps = item.split(":")
        out.append((int(block), int(warps)))
    return out


def main() -> int:
    from fsdp_rs.bench import copy
    from fsdp_rs.bench.cli import dtype_triple
    from fsdp_rs.bench.copy import Dtypes, Group, _plain_copy, make_case

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--case", action="append", choices=sorted(copy.CASES))
    parser.add_argument("--scale", type=float, default=None)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--dtypes", default="fp32,bf16,fp32")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--settings",
        type=_settings,
        default=_settings("2048:4,4096:4,8192:4,4096:8,8192:8,16384:8,16384:16"),
        help="BLOCK:WARPS pairs to time besides the one each kernel picks",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    scale = args.scale or (0.25 if cuda else 0.001)
    repeat = args.repeat if cuda else 1
    timer = copy._timer(device, repeat)
    dtypes = Dtypes.from_names(dtype_triple(args.dtypes))
    print(f"{copy.device_name(device)}, W={args.world_size}, {dtypes}, scale {scale:g}, "
          f"median of {repeat} calls; ms, fraction of a plain copy of the same bytes")  # fmt: skip
    for key in args.case or sorted(copy.CASES):
        case = make_case(key, scale)
        if not copy.divides(case, args.world_size):
            continue
        g = Group.build(case, dtypes, args.world_size, 0, device)
        print(f"({key}) {case.name}")
        for name, (run, out, nbytes, torch_run) in _kernels(g).items():
            module = importlib.import_module(f"fsdp_rs.kernels.{name}")
            picks = module.launch_setting  # the launcher looks it up at each call
            own = picks(g.plan.row_numel, len(g.plan.tile_param), module.LONG_TILES)
            copy_s = timer(_plain_copy(nbytes, device)).median
            torch_s = timer(torch_run).median if torch_run else None
            expected = None
            for block, warps in [own, *[s for s in args.settings if s != own]]:
                module.launch_setting = lambda *_, setting=(block, warps): setting
                try:
                    out.fill_(7)
                    run()
                    if expected is None:
                        expected = out.clone()
                    equal = torch.equal(out, expected)
                    s = timer(run).median
                finally:
                    module.launch_setting = picks
                vs = f"  torch {torch_s * 1e3:.4f} ms ({torch_s / s:.2f}x)" if torch_s else ""
                print(
                    f"  {name:<28} BLOCK {block:>5} warps {warps:>2}: {s * 1e3:8.4f} ms"
                    f"  frac {copy_s / s:.2f}{vs}{'' if equal else '  OUTPUT DIFFERS'}",
                    flush=True,
                )
                if not equal:
                    return 1
    return 0


def _triton(name: str):
    """The Triton launcher of kernel ``name`` (on CPU too, under TRITON_INTERPRET=1)."""
    return getattr(importlib.import_module(f"fsdp_rs.kernels.{name}"), f"triton_{name}")


def _kernels(g) -> dict:
    """Per kernel: a call, the tensor it writes, the bytes it must move, and
    FSDP2's torch copy (None where the bench has no such step)."""
    from fsdp_rs.bench.copy import _BUILDERS, _ON_DIMS, _chunk_numel

    d, w, rows = g.dtypes, g.world_size, g.plan.row_numel
    out = {}
    # the launchers resolved here, not inside the timed calls
    copy_out, rs_copy_in, rs_copy_in_flat = map(
        _triton, ("all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_in_flat")
    )
    builder = _ON_DIMS.get("all_gather_copy_out") if g.case.dims else None
    bench = (builder or _BUILDERS["all_gather_copy_out"])(g, None)
    output = g.random(w, rows, dtype=d.param)
    target = g.empty(g.plan.unsharded_numel, dtype=d.param)
    tables = g.tables.copy_out_args()
    chunks = _chunk_numel(g) if g.case.dims else None
    extra = () if chunks is None else (chunks,)
    out["all_gather_copy_out"] = (
        lambda: copy_out(output, [target], *tables, *extra),
        target,
        2 * w * rows * d.param.itemsize,
        bench.torch,
    )
    if not g.case.dims:  # per-parameter and flat reduce-scatter copy-in
        rs = _BUILDERS["reduce_scatter_copy_in"](g, None)
        grads = [g.random(*s, dtype=d.param) for s in g.case.shapes]
        rs_in = g.empty(w, rows, dtype=d.reduce)
        rs_tables = g.tables.reduce_scatter_args()
        moved = sum(t.numel() for t in grads) * d.param.itemsize + w * rows * d.reduce.itemsize
        out["reduce_scatter_copy_in"] = (
            lambda: rs_copy_in(grads, rs_in, *rs_tables, 1.0),
            rs_in,
            moved,
            rs.torch,
        )
        buffer = g.random(g.plan.unsharded_numel, dtype=d.param)
        flat_in = g.empty(w, rows, dtype=d.reduce)
        flat_tables = g.tables.reduce_scatter_flat_args()
        out["reduce_scatter_copy_in_flat"] = (
            lambda: rs_copy_in_flat(buffer, flat_in, *flat_tables, 1.0),
            flat_in,
            buffer.numel() * d.param.itemsize + w * rows * d.reduce.itemsize,
            rs.torch,
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
