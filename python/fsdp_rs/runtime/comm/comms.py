"""The collectives a group runs, when the user chose other than the default.

[Note: Comm objects]
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take the
objects torch's FSDP2 takes (its ``AllGather`` / ``ReduceScatter`` interface):
``allocate(size, *, dtype, device)`` makes the collective's buffer (fsdp-rs
asks for one flat buffer: the all-gather output, the reduce-scatter input and
output), and calling the object runs the collective on those buffers, with
the keywords FSDP2 passes: ``all_gather(output_tensor=, input_tensor=, group=,
async_op=)``, ``reduce_scatter(output_tensor=, input_tensor=, group=, op=)``.
So users' custom comm code runs unchanged. As in FSDP2, a custom all-gather
runs for a world of one too; a reduce-scatter over one rank is skipped. ``set_allocate_memory_from_
process_group_for_comm`` and ``set_symm_mem_for_comm`` install the comm
objects below, which differ from the default only in where the buffers live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_rs.runtime.comm.collectives import all_gather, reduce_scatter

__all__ = [
    "ProcessGroupAllGather",
    "ProcessGroupReduceScatter",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
    "is_builtin",
]


class _ProcessGroupAlloc:
    """Buffers from the process group's own allocator where its backend has one
    for the device (NCCL's, for zero-copy transfers), else ordinary ones."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        backend = self._group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


class _SymmMemAlloc:
    """Buffers in symmetric memory (NCCL), for its copy-engine and symmetric
    kernel collectives. On a device without a symmetric memory backend (the
    CPU) the first allocation raises torch's RuntimeError, as with FSDP2."""

    def __init__(self, group: dist.ProcessGroup, backend: str) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self._group = group
        self._symm_mem = symm_mem
        symm_mem.set_backend(backend)
        dist.barrier(group=group)  # every rank's communicator exists before a rendezvous

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        pool = self._symm_mem.get_mem_pool(device)  # reused: no rendezvous per buffer
        with torch.get_device_module(device).use_mem_pool(pool):
            return torch.empty(*size, dtype=dtype, device=device)


class ProcessGroupAllGather(_ProcessGroupAlloc):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False) -> Any:
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class ProcessGroupReduceScatter(_ProcessGroupAlloc):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> Any:
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class SymmMemAllGather(_SymmMemAlloc):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False) -> Any:
        # In place: the input is a slice of the output, so the output is registered.
        self._symm_mem.rendezvous(output_tensor, group=group.group_name)
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class SymmMemReduceScatter(_SymmMemAlloc):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> Any:
        self._symm_mem.rendezvous(input_tensor, group=group.group_name)
        self._symm_mem.rendezvous(output_tensor, group=group.group_name)
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


_BUILTIN = (
    ProcessGroupAllGather,
    ProcessGroupReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
)


def is_builtin(comm: object) -> bool:
    """None (the default) or one of the comm objects fsdp-rs installs itself."""
    return comm is None or isinstance(comm, _BUILTIN)
