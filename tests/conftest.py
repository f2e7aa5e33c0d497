"""Shared test set-up: Triton kernels run in the interpreter on CPU-only machines.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined,
so it is set here, before the tests import ``fsdp_rs.kernels``. With a CUDA
device the kernels compile and run for real.

The tests import ``fsdp_rs`` from wherever the interpreter finds it: the source
tree after ``maturin develop``, site-packages after installing a wheel (nothing
here puts ``python/`` on ``sys.path``). The header says which; with
``FSDP_RS_TEST_INSTALLED=1`` (what ``.ci/gpu`` sets) a source-tree import stops
the run.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SOURCE_TREE = Path(__file__).resolve().parents[1] / "python"


def _fsdp_rs_location() -> tuple[Path, bool]:
    """Where ``fsdp_rs`` is imported from, and whether that is this source tree."""
    import fsdp_rs

    where = Path(fsdp_rs.__file__).resolve().parent
    return where, where.is_relative_to(SOURCE_TREE)


def pytest_report_header(config):
    where, from_source = _fsdp_rs_location()
    if torch.cuda.is_available():
        device = f"CUDA ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible)"
    else:
        device = "no CUDA device (Triton kernels interpreted)"
    kind = "source tree" if from_source else "installed"
    return [f"fsdp_rs: {where} ({kind})", f"torch {torch.__version__}: {device}"]


def pytest_sessionstart(session):
    if os.environ.get("FSDP_RS_TEST_INSTALLED") == "1":
        where, from_source = _fsdp_rs_location()
        if from_source:
            pytest.exit(
                f"FSDP_RS_TEST_INSTALLED=1 but fsdp_rs is imported from the source tree "
                f"({where}); uninstall the editable install or unset PYTHONPATH",
                returncode=4,
            )


@pytest.fixture
def fake_pg():
    """Rank 0 of a fake process group of 2 (no data moves: collectives write
    nothing, so tests on it check shapes, calls and state, not values); a
    module may define its own."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield 2
    dist.destroy_process_group()
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    """Keep the tests of the CI leg running, if any ([Note: CI legs] in
    ``ci_legs.py``)."""
    from ci_legs import select

    keep, drop = select(items)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
