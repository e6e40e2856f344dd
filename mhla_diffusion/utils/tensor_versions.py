"""How often a tensor was written in place, where PyTorch can tell: the caches that keep a result for a tensor
they have seen (converted RoPE tables, text conditioning, metric features) read it to notice a write into that
tensor since.

PyTorch keeps the count as ``Tensor._version``: a private name (present in every release this project supports,
not a documented API), and none at all for inference tensors. :func:`write_count` is the one place that reads
it, and answers ``None`` where it cannot (an inference tensor, or a PyTorch without the counter): a cache then
cannot tell a write from none and recomputes instead of reusing (the public fallback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the utils package imports no torch (tests/cli/test_imports.py)
    import torch

__all__ = ["write_count"]


def write_count(tensor: torch.Tensor) -> int | None:
    """The in-place write count of ``tensor`` (or of its storage through any view), or ``None`` where PyTorch keeps
    none (inference tensors) or has no counter."""
    if tensor.is_inference():
        return None
    try:
        count = getattr(tensor, "_version", None)
    except RuntimeError:  # some tensor subclasses refuse it
        return None
    return count if isinstance(count, int) else None
