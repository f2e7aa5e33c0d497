"""Plan tables as torch tensors on the buffers' device, built once per group."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from fsdp_rs._core import GroupPlan
from fsdp_rs.kernels._checks import check_layout_tables, keep_host, keep_param_numel

__all__ = ["GroupTables"]


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    t = t.to(device)
    keep_host(t, array)  # checks read the host's copy, not the device's
    return t


@dataclass(frozen=True)
class GroupTables:
    """The plan tables the copy ops take, in their argument order.

    On CPU the tensors share the plan's memory (zero copy; keep the plan alive,
    which ``plan`` does); elsewhere they are one upload per table."""

    plan: GroupPlan
    row_offsets: torch.Tensor
    unsharded_offsets: torch.Tensor
    padded_numel: torch.Tensor
    tile_param: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor

    @classmethod
    def from_plan(cls, plan: GroupPlan, device: torch.device | str = "cpu") -> GroupTables:
        device = torch.device(device)
        # The planner's arrays are read-only views of Rust memory; torch warns that
        # it cannot mark tensors read-only. The ops never write their tables. (One
        # warnings context for all six: entering one costs about 5 us.)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            padded_numel = _tensor(plan.padded_sharded_numel, device)
            keep_param_numel(padded_numel, plan.numel)  # for the ops' size checks
            tables = cls(
                plan,
                _tensor(plan.row_offsets, device),
                _tensor(plan.unsharded_offsets, device),
                padded_numel,
                _tensor(plan.tile_param, device),
                _tensor(plan.tile_start, device),
                _tensor(plan.tile_len, device),
            )
        # Checked once here; the runtime's op calls trust them ([Note: Trusted calls]).
        check_layout_tables("GroupTables", *tables.copy_out_args())
        return tables

    def copy_out_args(self) -> tuple[torch.Tensor, ...]:
        """Table arguments of ``all_gather_copy_out``."""
        return (
            self.row_offsets,
            self.unsharded_offsets,
            self.padded_numel,
            self.tile_param,
            self.tile_start,
            self.tile_len,
        )

    # The inverse copy reads the buffer layout through the same tables.
    reduce_scatter_flat_args = copy_out_args
    """Table arguments of ``reduce_scatter_copy_in_flat``."""

    def reduce_scatter_args(self) -> tuple[torch.Tensor, ...]:
        """Table arguments of ``reduce_scatter_copy_in``."""
        return (
            self.row_offsets,
            self.padded_numel,
            self.tile_param,
            self.tile_start,
            self.tile_len,
        )
