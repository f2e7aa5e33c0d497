"""Exception classes shared by the runtime, and the type checks of the public
arguments that take a bool or a number.

[Note: Argument types]
FSDP2 stores a setter's argument as it is given, so ``set_requires_gradient_sync
("False")`` turns gradient sync on (a non-empty string is true) and a typo shows
up, if ever, as wrong training. fsdp-rs refuses, at the call, every value of
another type than the argument takes, with a ``TypeError`` naming the method,
the argument and the type given. A bool argument takes ``True`` or ``False``
only (not 0 or 1, not a NumPy bool): the point is to catch a value that merely
looks like one. Where FSDP2 itself raises another class for a wrong value
(``ValueError`` from ``set_reshard_after_forward``), the error is of that class
too, so that code written against FSDP2 still catches it. The checks run where
the setters run, never per step.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = [
    "FSDPArgumentTypeError",
    "FSDPMeshError",
    "FSDPUsageError",
    "check_bool",
    "check_real",
]


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


class FSDPArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type where FSDP2 raises a ``ValueError``
    (``set_reshard_after_forward(2)``): a ``TypeError``, as every wrong type
    in fsdp-rs ([Note: Argument types]), and a ``ValueError`` too."""


def check_bool(method: str, name: str, value: Any, error: type[TypeError] = TypeError) -> None:
    """``value`` (argument ``name`` of ``method``) is ``True`` or ``False``; see
    [Note: Argument types]."""
    if not isinstance(value, bool):
        raise error(
            f"{method} takes a bool for {name}, got {type(value).__name__} ({value!r}); "
            "pass True or False"
        )


def check_real(method: str, name: str, value: Any) -> None:
    """``value`` is a real number (an int or a float, a NumPy one included; not
    a bool); see [Note: Argument types]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{method} takes a number (int or float) for {name}, got {type(value).__name__} "
            f"({value!r})"
        )
