"""pytest plugin for the torch-range legs (``.ci/torch-range``): tests that fail on
one torch version for a known, reported reason run as expected failures there,
and test files that cannot be collected there are left out, so that a leg fails
on anything new. Loaded with ``-p known_failures`` (``.ci/`` on ``PYTHONPATH``).

Each entry names the torch versions it applies to (``torch.__version__`` up to
the ``+`` local part, matched by prefix: ``"2.15"`` is every 2.15.x), the reason,
and whether it is strict: a strict expected failure that passes fails the leg
(XPASS(strict)), so whoever fixes the cause removes the entry. Failures that
depend on rounding luck (which way a 1-ulp difference falls on this machine's
CPU kernels) are not strict.
"""

from __future__ import annotations

import pytest
import torch

# [Note: Gloo ring chunks] gloo's reduce_scatter_tensor is an allreduce (ring) of a
# clone of the whole input, then a copy of the rank's chunk. The ring splits the
# buffer into numSegments = 2 * W segments (more for large buffers) of
# roundUp(ceil(bytes / numSegments), element size) bytes, and sums each pair of
# segments in one rank order. FSDP2's rows are the parameters' padded shards back
# to back; where a row has an odd numel the ring's chunks are one element longer
# than a row, so the first r elements of rank r's row are summed in rank r-1's
# order. fsdp-rs's rows are 16-byte aligned (even), its chunks are its rows, and
# those r elements can round 1 ulp apart from FSDP2's. Which way depends on the
# gradients, so on the CPU kernels of each torch build.
_GLOO_CHUNKS = (
    "gloo ring chunks ([Note: Gloo ring chunks] in .ci/known_failures.py): FSDP2's "
    "block rows have an odd numel (471 at W=4), so gloo sums their first elements "
    "in another rank's order; fsdp-rs's aligned rows do not; 1 ulp on this build"
)

# nodeid -> (torch version prefixes, reason, strict)
XFAIL: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "tests/test_fully_shard.py::test_training_parity[W4-transformer_compiled_blocks]": (
        ("2.9",),
        _GLOO_CHUNKS,
        False,
    ),
    # On some CI machines' CPUs (2026-11-28: losses equal, final parameters not;
    # the landed a8aa5fc fails them there too, and passed on the machine it
    # landed on): the MLP's rows (widths 16, 33, 7, 13, 5) have odd numels
    **{
        f"tests/test_fully_shard.py::test_training_parity[W4-{name}]": (
            ("2.15",),
            _GLOO_CHUNKS,
            False,
        )
        for name in (
            "mlp",
            "mlp_no_reshard",
            "mlp_reshard_int",
            "mlp_cpu_offload",
            "mlp_explicit_prefetch",
            "mlp_streams",
            "mlp_reshard_int_streams",
        )
    },
}

# torch 2.9's DTensor constructor is a Python function (a builtin from 2.13 on), and
# ``fully_shard`` makes each sharded parameter with it, so there its Python calls
# grow by one per parameter (tests/test_step_host_cost.py counts them). (A step no
# longer makes ``.grad`` views anew: [Note: Parked gradient buffers].)
XFAIL["tests/test_step_host_cost.py::test_fully_shard_python_calls_do_not_grow_with_parameters"] = (
    ("2.9",),
    "torch 2.9's DTensor.__new__ is Python: one call per sharded parameter",
    True,
)

# test file -> (torch version prefixes, reason): not collected there
IGNORE: dict[str, tuple[tuple[str, ...], str]] = {
    "tests/test_dropin.py": (
        ("2.9",),
        "tests/dropin_scenarios.py imports torch.distributed.fsdp.share_comm_ctx, "
        "which torch 2.9 lacks (ImportError at collection)",
    ),
}

TORCH = torch.__version__.split("+")[0]


def _applies(versions: tuple[str, ...]) -> bool:
    return any(TORCH == v or TORCH.startswith(v + ".") for v in versions)


def pytest_report_header(config):
    lines = [f"known failures on torch {TORCH} (.ci/known_failures.py):"]
    for path, (versions, reason) in IGNORE.items():
        if _applies(versions):
            lines.append(f"    not collected: {path}: {reason}")
    for nodeid, (versions, _reason, strict) in XFAIL.items():
        if _applies(versions):
            lines.append(f"    xfail{' (strict)' if strict else ''}: {nodeid}")
    return lines if len(lines) > 1 else [f"known failures on torch {TORCH}: none"]


def pytest_ignore_collect(collection_path, config):
    root = config.rootpath
    for path, (versions, _) in IGNORE.items():
        if _applies(versions) and collection_path == root / path:
            return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        entry = XFAIL.get(item.nodeid)
        if entry is not None and _applies(entry[0]):
            item.add_marker(pytest.mark.xfail(reason=entry[1], strict=entry[2]))
