"""The runtime's layout (issue 52): no import cycles and no private name imported
across files (``tools/runtime_layout.py``); and what the eager and the traced
root hooks share, checked on both paths."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.utils import _to_kwargs
from torch.nn.utils.rnn import pack_padded_sequence

from fsdp_rs.runtime.step.containers import to_device

ROOT = Path(__file__).resolve().parent.parent


def test_no_cycles_no_private_imports():
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "runtime_layout.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "import cycles: 0" in run.stdout.replace("\n  ", " ")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor


def _inputs():
    packed = pack_padded_sequence(torch.ones(3, 2, 4), torch.tensor([3, 2]))
    args = (
        torch.ones(2),
        [torch.zeros(3), {"a": torch.ones(1)}],
        Batch(torch.ones(2), torch.ones(2)),
    )
    return args, {"packed": packed, "n": 3}


def _devices(tree):
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x.device.type)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(tree)
    return out


def test_root_input_move_is_fsdp2s_on_both_paths():
    """The one ``to_device`` the eager and traced root hooks call moves what
    torch's ``_to_kwargs`` (FSDP2's move) moves, dataclasses left as they are,
    and traces without a graph break."""
    meta = torch.device("meta")
    args, kwargs = _inputs()
    expected = _to_kwargs(args, kwargs, meta, False)
    expected = (expected[0][0], expected[1][0])
    eager = to_device(args, kwargs, meta)
    traced = torch.compile(lambda a, k: to_device(a, k, meta), backend="eager", fullgraph=True)(
        args, kwargs
    )
    want = _devices(expected)
    assert "cpu" in want and "meta" in want  # the dataclass stays; the rest moves
    assert _devices(eager) == want
    assert _devices(traced) == want
    assert eager[0][2] is args[2]  # a dataclass is not entered, as FSDP2
    assert eager[1]["packed"].batch_sizes.device.type == "cpu"  # PackedSequence.to keeps it
    same = (torch.ones(1),), {}
    assert to_device(*same, torch.device("cpu"))[0] is same[0]  # nothing to move: as passed
