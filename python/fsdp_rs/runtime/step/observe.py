"""Profiler labels and debug logs of a step's phases, under FSDP2's names.

[Note: Labels and logs]
Users find where a step goes from profiler traces and from ``TORCH_LOGS=+fsdp``
(pytorch/pytorch#173680 is read off such a trace), so fsdp-rs labels its
phases as FSDP2 does: ``FSDP::root_pre_forward``, ``FSDP::pre_forward``,
``FSDP::all_gather``, ``FSDP::all_gather_copy_out``, ``FSDP::post_forward``,
``FSDP::pre_backward``, ``FSDP::post_backward``,
``FSDP::post_backward_reduce``, ``FSDP::root_post_backward_callback`` and the
prefetches (``FSDP::forward_prefetch for <fqn>``), each group's with its
modules' names under the root in parentheses; and its own phases
``fsdp_rs::plan_check`` and ``fsdp_rs::gradient_agreement``. The same names
go to FSDP2's own logger, ``torch.distributed.fsdp.fully_shard``, at DEBUG,
which ``TORCH_LOGS=+fsdp`` (torch's ``fsdp`` log, registered for
``torch.distributed.fsdp``; ``+`` for DEBUG, where FSDP2 logs these too) turns
on, and so does code that sets that logger's level for FSDP2 (torch's
``test_fully_shard_logging.py`` does, and passes with fsdp-rs in place).
A group whose post-backward the root's end-of-backward callback runs (its
inputs took no gradient) is labelled ``FSDP::post_backward`` inside it, as
in FSDP2.

Neither may cost a step that is not observed. A hook reads ``Context.logs``
and the profiler's flag (``PROFILING``, a C call: together about 0.1 us) and
takes the labelled path only then; the log level is read once per root
forward into ``Context.logs``. While a labelled hook runs,
``Context.labelling`` is set so that the phases inside it (the all-gather,
the reduction) label themselves after one attribute read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LOG", "PROFILING", "logs_enabled", "phase", "rare"]

LOG = logging.getLogger("torch.distributed.fsdp.fully_shard")  # FSDP2's
PROFILING = torch._C._autograd._profiler_enabled


def logs_enabled() -> bool:
    """Whether the debug log is on (read once per root forward)."""
    return LOG.isEnabledFor(logging.DEBUG)


def label(name: str, fqn: str | None) -> str:
    """FSDP2's label: the phase, then the modules' names in parentheses."""
    return f"{name} ({fqn})" if fqn else name


@contextlib.contextmanager
def phase(context: Any, name: str, fqn: str | None = None) -> Iterator[None]:
    """Label the block ``name`` (with ``fqn``) in the profiler and the log;
    the phases inside label themselves while it runs."""
    text = label(name, fqn)
    if context.logs:
        LOG.debug("%s", text)
    outer = context.labelling
    context.labelling = True
    try:
        with torch.profiler.record_function(text):
            yield
    finally:
        context.labelling = outer


@contextlib.contextmanager
def rare(name: str) -> Iterator[None]:
    """Label a phase that runs once per step or less (the plan check, the
    gradient agreement): it reads the profiler flag and the log level itself."""
    if not (PROFILING() or logs_enabled()):
        yield
        return
    LOG.debug("%s", name)
    with torch.profiler.record_function(name):
        yield
