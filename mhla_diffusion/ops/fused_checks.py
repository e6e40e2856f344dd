"""Argument checks of the fused Triton operator (:func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused` and its
backward): one-line ``ValueError`` s that name the problem and the fix, before anything is launched."""

from __future__ import annotations

import math

import torch

from .attention import normalization_mode, validate_attention_inputs
from .block_layout import BlockPlan

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

#: The products' dtypes the kernels take, by their name in ``triton.language``.
_DOT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_rotary(name: str, table: torch.Tensor | None, q: torch.Tensor) -> None:
    """``cos``/``sin`` must be Diffusers' ``(1, N, 1, D)`` tables on ``q``'s device."""
    if table is None:
        return
    b, n, _, d = q.shape
    if (
        not isinstance(table, torch.Tensor)
        or table.ndim != 4
        or table.shape[0] != 1
        or table.shape[2] != 1
        or table.shape[1] != n
        or table.shape[3] != d
    ):
        raise ValueError(
            f"`{name}` must be Diffusers' RoPE table of shape (1, {n}, 1, {d}) for q {tuple(q.shape)}, "
            f"got {tuple(getattr(table, 'shape', ()))}"
        )
    if table.device != q.device:
        raise ValueError(f"`{name}` is on {table.device} but q is on {q.device}: move the RoPE tables to q's device")


def _check_inputs(q, k, v, plan, mixing, cos, sin, normalize, dot_dtype) -> str:
    """Validate the fused operator's arguments (one-line ``ValueError``s); returns the normalize mode."""
    if (
        isinstance(plan, BlockPlan)
        and isinstance(q, torch.Tensor)
        and q.ndim == 4
        and math.prod(plan.grid) != q.shape[1]
    ):
        raise ValueError(
            f"`plan` was built for grid {plan.grid} ({math.prod(plan.grid)} tokens) but q has N={q.shape[1]}: "
            f"build it with block_plan(grid, layout, device) for these inputs"
        )
    validate_attention_inputs(q, k, v, getattr(plan, "grid", ()), getattr(plan, "layout", ()), mixing, None, None, plan)
    mode = normalization_mode(normalize)
    if mode == "scalar_mixed_denominator":
        raise NotImplementedError(
            "mhla_attention_fused does not implement normalize='scalar_mixed_denominator' (released DiT): "
            "use mhla_diffusion.ops.attention.mhla_attention for it"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise ValueError(f"`{name}` must be a floating-point tensor, got {t.dtype}")
    if (cos is None) != (sin is None):
        raise ValueError("`cos` and `sin` must be given together (both RoPE tables) or both left None")
    _check_rotary("cos", cos, q)
    _check_rotary("sin", sin, q)
    if cos is not None and q.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head dim, got D={q.shape[-1]}: pass cos=sin=None or use an even D")
    if dot_dtype is not None and dot_dtype not in _DOT_DTYPES:
        raise ValueError(f"`dot_dtype` must be torch.float32, torch.bfloat16 or torch.float16, got {dot_dtype}")
    if dot_dtype == torch.bfloat16 and q.device.type == "cpu":
        raise ValueError(
            "`dot_dtype=torch.bfloat16` is wrong under Triton's interpreter (CPU tensors): its bf16 tl.dot "
            "multiplies raw bit patterns; pass torch.float32 (or None)"
        )
    if q.device.type == "meta":
        return mode
    if triton is None:
        raise RuntimeError("mhla_attention_fused needs Triton, which does not import here: use mhla_attention")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"mhla_attention_fused runs on CUDA (or CPU through Triton's interpreter), got {q.device}")
    return mode
