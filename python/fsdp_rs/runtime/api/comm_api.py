"""``FSDPModule`` methods that choose how a group communicates: custom comm
objects, where collective buffers live, reduce-scatter groups and buffering,
unused parameters (``share_comm_ctx``: in ``fully_shard``). Semantics as torch FSDP2's
(torch 2.13), whatever torch is installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fsdp_rs.runtime.api.errors import check_bool
from fsdp_rs.runtime.comm.comms import (
    ProcessGroupAllGather,
    ProcessGroupReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
    is_builtin,
)

if TYPE_CHECKING:
    from fsdp_rs.runtime.group.param_group import FSDPParamGroup

__all__ = ["CommSettings"]


def _check_comm(comm: Any, kind: str, method: str) -> None:
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{method}: expected a {kind} comm object (torch's "
            f"torch.distributed.fsdp._fully_shard._fsdp_api.{kind} interface: "
            f"allocate(size, *, dtype, device) and __call__), got {type(comm).__name__}"
        )


class CommSettings:
    """Mixed into ``FSDPModule``; see [Note: Comm objects]."""

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        raise NotImplementedError  # FSDPModule's

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this module's all-gathers with ``comm`` (an FSDP2 ``AllGather``)."""
        _check_comm(comm, "AllGather", "set_custom_all_gather")
        for group in self._groups(False):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this module's reduce-scatters with ``comm`` (an FSDP2 ``ReduceScatter``)."""
        _check_comm(comm, "ReduceScatter", "set_custom_reduce_scatter")
        for group in self._groups(False):
            group.reduce_scatter_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate the collectives' buffers with the process group's allocator
        where its backend has one (NCCL: zero-copy transfers); not with custom comms."""
        check_bool("set_allocate_memory_from_process_group_for_comm", "enable", enable)
        for group in self._groups(False):
            _check_not_custom(group, "set_allocate_memory_from_process_group_for_comm")
            pg = group.info.shard_group
            if pg is None:  # nothing sharded: no collective to allocate for
                continue
            group.all_gather_comm = ProcessGroupAllGather(pg) if enable else None
            rs_pg = group.reduce_scatter_group or pg
            group.reduce_scatter_comm = ProcessGroupReduceScatter(rs_pg) if enable else None

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """All-gather buffers in symmetric memory (and reduce-scatter ones with
        ``set_force_sum_reduction_for_comms``: NCCL's symmetric reduce-scatter
        only sums); not with custom comms. A collective on a device without a
        symmetric memory backend raises torch's RuntimeError, as with FSDP2."""
        for group in self._groups(False):
            _check_not_custom(group, "set_symm_mem_for_comm")
            if group.info.shard_group is None:  # nothing sharded: no collective
                continue
            group.all_gather_comm = SymmMemAllGather(group.info.shard_group, backend)
            if group.force_sum_reduction:
                rs_pg = group.reduce_scatter_group or group.info.shard_group
                group.reduce_scatter_comm = SymmMemReduceScatter(rs_pg, backend)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for the trainable parameters without a gradient, so every
        one gets a ``.grad`` (zeros where no rank had one). fsdp-rs keeps the
        ranks' collectives paired without it ([Note: Gradient agreement]); this
        only decides which parameters get a ``.grad``, as in FSDP2."""
        method = "set_reduce_scatter_unused_params"
        check_bool(method, "reduce_scatter_unused_params", reduce_scatter_unused_params)
        check_bool(method, "recurse", recurse)
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter inputs may be in flight (default 1): more lets
        the next copy-in skip waiting for a slow reduce-scatter, for their memory.
        Without device streams (CPU) collectives finish in order and none wait."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, "
                f"got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers: max_input_buffers must be >= 1, got "
                f"{max_input_buffers} (1 is the default: one buffer in flight)"
            )
        check_bool("set_reduce_scatter_max_input_buffers", "recurse", recurse)
        for group in self._groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter on a process group of its own over the shard ranks (one
        per rank set), so that it can overlap the all-gathers; False goes back
        to the shard group. Collective: call it on every rank of the mesh."""
        check_bool("set_separate_reduce_scatter_group", "enable", enable)
        check_bool("set_separate_reduce_scatter_group", "recurse", recurse)
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            if not enable or group.info.shard_group is None:  # None: nothing sharded
                group.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.info.shard_group))
            if ranks not in made:
                made[ranks] = group.reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True
                )
            group.reduce_scatter_group = made[ranks]


def _check_not_custom(group: FSDPParamGroup, method: str) -> None:
    for comm in (group.all_gather_comm, group.reduce_scatter_comm):
        if not is_builtin(comm):
            raise RuntimeError(
                f"{method}: this module has a custom comm ({type(comm).__name__}) from "
                "set_custom_all_gather / set_custom_reduce_scatter, which decides its own "
                "buffers; use one or the other"
            )
