"""Round-to-nearest-even float32 -> bfloat16 in Triton's interpreter, for precision tests.

The interpreter converts float32 to bfloat16 by cutting the low 16 bits (truncation), where a GPU rounds to
nearest even: a bf16 error measured under the interpreter would then be about twice a GPU's, and a path that
rounds more often would look worse than it is. :func:`round_to_nearest_bf16` patches the interpreter's one
conversion routine (``triton.runtime.interpreter._convert_float``, a private name: tests only) with PyTorch's
own rounding while the context is open.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


def _rounding(original):
    import triton.language as tl

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    return convert


@contextmanager
def round_to_nearest_bf16() -> Iterator[None]:
    """While open, the interpreter's float32 -> bfloat16 casts (``.to(tl.bfloat16)``, stores into bf16
    tensors) round to nearest even, as a GPU does."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._convert_float
    interpreter._convert_float = _rounding(original)
    try:
        yield
    finally:
        interpreter._convert_float = original
