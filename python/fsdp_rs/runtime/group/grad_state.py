"""What a group holds of gradients that no reduction has taken yet, one small
object per form.

[Note: Unreduced gradients]
Between backwards a group may hold gradients that wait for a later reduction,
in one of three forms (``GradientReduction._unsynced``, at most one at a time),
besides the pre-placed gradients of a backward in progress ([Note: Pre-placed
gradients]):

- ``KeptOnParams``: after a backward without gradient sync whose gradients
  autograd left in the accumulation dtype, they stay as the unsharded
  parameters' ``.grad`` (the pre-placed aliases included) and autograd adds
  the next backward's into them in place, as FSDP2 keeps them.
- ``Accumulated``: one tensor per trainable parameter (None where none came
  yet), in the accumulation dtype, where a backward's gradients could not stay
  on the parameters (another dtype: cast once, as FSDP2's
  ``unsharded_accumulated_grad``; or earlier ones accumulated elsewhere), and
  those kept on parameters that were made again since (adoption). The next
  backward's are added per parameter.
- ``AccumulatedBuffer``: gradients of backwards that pre-placed, as one buffer
  in the unsharded gradient layout (a copy of the pre-placed buffer in the
  accumulation dtype, or that buffer itself when the parameters are made
  again) with a had-gradient flag per parameter; the next backward that
  pre-places adds its buffer into it in one op, one that does not turns it
  into ``Accumulated`` first.

The synced backward that reduces adds this backward's gradients to them and
reduces the sum once; ``reset_iter_state()`` drops them. Separately, with
HSDP's all-reduce held back (``set_requires_all_reduce(False)``) the group
keeps its summed reduce-scatter outputs as a ``PartialReduce`` until a
backward all-reduces ([Note: Partial gradients of a module called twice]).
Where each form is made, and the memory each costs against FSDP2: [Note:
Reduction memory].
"""

from __future__ import annotations

import torch

__all__ = ["Accumulated", "AccumulatedBuffer", "KeptOnParams", "PartialReduce"]


class KeptOnParams:
    """Gradients left on the unsharded parameters ``params`` (their ``.grad``)."""

    __slots__ = ("params",)

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params


class Accumulated:
    """One gradient per trainable parameter (None: none yet), in the
    accumulation dtype."""

    __slots__ = ("grads",)

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        self.grads = grads


class AccumulatedBuffer:
    """A buffer in the unsharded gradient layout, and whether each trainable
    parameter had a gradient in it."""

    __slots__ = ("buffer", "had")

    def __init__(self, buffer: torch.Tensor, had: list[bool]) -> None:
        self.buffer = buffer
        self.had = had


class PartialReduce:
    """[No all-reduce] the reduce-scatter output summed over backwards whose
    all-reduce across replicas was held back, and which parameters this rank
    had a gradient for in them."""

    __slots__ = ("had", "output")

    def __init__(self, output: torch.Tensor, had: list[bool]) -> None:
        self.output = output
        self.had = had
