"""Profiler labels and debug logs under FSDP2's names, and no cost when neither
is on ([Note: Labels and logs] in ``runtime/observe.py``)."""

from __future__ import annotations

import logging

import torch
from torch import nn

import fsdp_rs
from fsdp_rs.runtime import observe


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
    assert logging.getLogger("torch.distributed.fsdp.fsdp_rs") is observe.LOG


def test_nothing_labelled_or_logged_when_off(fake_pg, monkeypatch) -> None:
    model = _model()
    _step(model)

    def refuse(*args, **kwargs):
        raise AssertionError("labelled without a profiler or the debug log")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    monkeypatch.setattr(observe.LOG, "debug", refuse)
    for _ in range(2):
        _step(model)
