"""Profiler labels and debug logs under FSDP2's names, and no cost when neither
is on ([Note: Labels and logs] in ``runtime/step/observe.py``)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from torch import nn

import fsdp_rs
from fsdp_rs.runtime.step import observe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fsdp_rs.fully_shard(model[0])
    fsdp_rs.fully_shard(model[2])
    fsdp_rs.fully_shard(model)
    return model


def _step(model: nn.Module) -> None:
    model(torch.randn(2, 4)).sum().backward()


EXPECTED = {
    "FSDP::root_pre_forward",
    "FSDP::pre_forward (0)",
    "FSDP::all_gather (0)",
    "FSDP::all_gather_copy_out (0)",
    "FSDP::post_forward (0)",
    "FSDP::pre_backward (2)",
    "FSDP::post_backward_reduce (2)",
    "FSDP::root_post_backward_callback",
    "fsdp_rs::gradient_agreement",
}


def test_profiler_sees_fsdp2s_labels(fake_pg) -> None:
    model = _model()
    _step(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model)
    names = {e.name for e in prof.events()}
    assert EXPECTED <= names, sorted(EXPECTED - names)


def test_plan_check_labelled_at_the_first_forward(fake_pg) -> None:
    model = _model()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model)
    assert "fsdp_rs::plan_check" in {e.name for e in prof.events()}


def test_debug_log_names_the_phases(fake_pg, caplog) -> None:
    model = _model()
    _step(model)
    with caplog.at_level(logging.DEBUG, logger="torch.distributed.fsdp"):
        _step(model)
    logged = {r.getMessage() for r in caplog.records if r.name == observe.LOG.name}
    assert EXPECTED <= logged, sorted(EXPECTED - logged)
    assert logging.getLogger("torch.distributed.fsdp.fully_shard") is observe.LOG  # FSDP2's


def test_nothing_labelled_or_logged_when_off(fake_pg, monkeypatch) -> None:
    model = _model()
    _step(model)

    def refuse(*args, **kwargs):
        raise AssertionError("labelled without a profiler or the debug log")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    monkeypatch.setattr(observe.LOG, "debug", refuse)
    for _ in range(2):
        _step(model)


_FSDP2_LOGGING_SCRIPT = """
import logging
import torch
import torch.distributed as dist
from torch import nn
import fsdp_rs
logging.getLogger("torch.distributed.fsdp.fully_shard").setLevel(logging.DEBUG)
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{port}")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
for layer in model:
    fsdp_rs.fully_shard(layer)
fsdp_rs.fully_shard(model)
model(torch.randn(4, 4)).sum().backward()
dist.destroy_process_group()
"""


def test_fsdp2s_logging_contract() -> None:
    """What torch's own ``test_fully_shard_logging.py`` checks of FSDP2, with
    fsdp-rs: ``TORCH_LOGS=fsdp`` and FSDP2's logger set to DEBUG by the user
    log every phase of every group, the first layer's post-backward (run by the
    root's end-of-backward callback) included."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).parent))
    from spawned import free_port

    env = dict(os.environ, TORCH_LOGS="fsdp")
    script = _FSDP2_LOGGING_SCRIPT.format(port=free_port())
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
        for layer in (0, 1):
            assert f"FSDP::{phase} ({layer})" in out.stderr, (phase, layer, out.stderr[-3000:])
    assert "FSDP::root_pre_forward" in out.stderr
    assert "FSDP::root_post_backward" in out.stderr
