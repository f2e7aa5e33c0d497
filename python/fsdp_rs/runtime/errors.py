"""Exception classes shared by the runtime."""

from __future__ import annotations

__all__ = ["FSDPMeshError", "FSDPUsageError"]


class FSDPUsageError(ValueError, AssertionError):
    """Misuse FSDP2 reports with an ``AssertionError`` (a second ``fully_shard``
    of one module, a 2-D mesh without dim names, ``copy.deepcopy``): to fsdp-rs
    a ``ValueError``, as all bad input, and an ``AssertionError`` too, so that
    code written against FSDP2 catches it."""


class FSDPMeshError(ValueError, TypeError, RuntimeError, AssertionError):
    """A parameter's DTensor mesh that does not combine with the data-parallel
    mesh. FSDP2 fails there inside ``DeviceMesh._concatenate`` (torch >= 2.13),
    with a ``TypeError`` or a ``RuntimeError`` depending on the meshes, or with
    an ``AssertionError`` (older torch); to fsdp-rs a ``ValueError`` naming the
    parameter, and each of those too, so that code written against FSDP2 catches
    it."""
