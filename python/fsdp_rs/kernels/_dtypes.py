"""Which dtypes each copy accepts, and the integer views raw copies move.

[Note: Raw copies]
FSDP2 all-gathers parameters of any dtype: a frozen ``float8_e4m3fn`` weight
next to float32 ones, an integer or bool tensor registered as a parameter with
``requires_grad=False``, complex parameters. A copy that only moves bytes
therefore accepts every dtype (quantized ones aside, which are not plain
memory): the all-gather copy-in into the same dtype, the all-gather copy-out
(which never casts), and the reduce-scatter copy-ins and the post-reduce when
a call neither casts, divides nor accumulates. Casting, dividing and
accumulating stay with the ``FLOAT_DTYPES``, where both torch and Triton have
the arithmetic; a zero (padding, alignment gaps, a missing gradient) is all
zero bits in every dtype, so the raw paths fill them as they are.

Both implementations copy such a tensor as its same-width integer view
(``bits``): torch's CPU ``index_select`` has no kernel for uint16/32/64 or the
``bits*`` dtypes, Triton has no complex element type and its interpreter no
float8 load, and an integer moves the same bits whatever they mean (torch
itself copies a bool as a bool, making any nonzero byte a 1; an integer view
keeps the byte). A 16-byte element (complex128) has no integer of
its width: the torch references copy it as it is (every op they use supports
complex128), the kernels as two int64 words (``words``), scaling the element
offsets of their tables by it. The four float dtypes are passed as they are,
so their kernels are the same with or without this note.

[Note: Complex gradients]
FSDP2 trains complex parameters: it divides their gradients (``div_`` by a
real factor, before and after the reduce-scatter, as for fp16: [Note: Gradient
division] in ``runtime/comm/collectives.py``) and accumulates them (``+=``) with
torch's complex ops. The copies that divide or accumulate therefore also take
``COMPLEX_DTYPES``, without a cast (complex to complex of the same dtype), and
do that arithmetic with the same torch ops on the whole tensor, on every
device: a complex division by a real number is not two real divisions (torch
divides by the complex number ``(factor, 0)``, whose rounding and signed zeros
differ), and Triton has no complex type. The bytes move as in [Note: Raw
copies]; only the arithmetic is torch's, so it matches FSDP2's bit for bit.
"""

from __future__ import annotations

import torch

__all__ = [
    "COMPLEX_DTYPES",
    "FLOAT_DTYPES",
    "FLOAT_NAMES",
    "bits",
    "bits_dtype",
    "is_copyable",
    "words",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FLOAT_NAMES = "float32, bfloat16, float16 and float64"
# Divided and accumulated (never cast) with torch's own ops: [Note: Complex gradients]
COMPLEX_DTYPES = (torch.complex64, torch.complex128)

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_QUANTIZED = frozenset((torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4))


def is_copyable(dtype: torch.dtype) -> bool:
    """Whether a copy can move ``dtype`` as raw bits ([Note: Raw copies])."""
    return dtype not in _QUANTIZED and (dtype.itemsize in _INTS or dtype.itemsize == 16)


def bits_dtype(dtype: torch.dtype, words_too: bool = False) -> torch.dtype:
    """The dtype ``bits`` views a ``dtype`` tensor as."""
    if dtype in FLOAT_DTYPES:
        return dtype
    width = _INTS.get(dtype.itemsize)
    if width is not None:
        return width
    return torch.int64 if words_too else dtype


def bits(t: torch.Tensor, words_too: bool = False) -> torch.Tensor:
    """``t`` itself for a float dtype; else its same-width integer view, which
    has the same shape. A 16-byte dtype stays as it is, unless ``words_too``
    (for the kernels): then its int64 view, the last dim doubled."""
    dtype = bits_dtype(t.dtype, words_too)
    return t if dtype == t.dtype else t.view(dtype)


def words(dtype: torch.dtype) -> int:
    """int64 words per element of a 16-byte dtype; 1 for every other dtype
    (which ``bits`` views element for element)."""
    return 2 if dtype.itemsize == 16 else 1
