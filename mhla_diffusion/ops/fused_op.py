"""The fused MHLA forward and its backward as ``torch.library`` custom ops (issue 49, item 1).

``torch.compile`` sees each as one opaque node: Dynamo traces through :func:`mhla_attention_fused`'s
checks (plain Python on shapes) to a call of ``torch.ops.mhla.fused_attention``, whose fake
implementation gives the output's shape and dtype without running anything, and AOTAutograd puts
``torch.ops.mhla.fused_attention_backward`` into the backward graph. Neither op syncs with the host
or branches on tensor values, so a compiled transformer keeps the Triton kernels with
``fullgraph=True`` and CUDA graphs can capture the launches.

The ops take the :class:`~mhla_diffusion.ops.block_layout.BlockPlan` as its tensors (``gather``,
``scatter``, optional ``valid``) and its ``grid`` and ``layout`` as int lists, and rebuild the plan
from them (no index is recomputed).

Where each op runs:

* CUDA: the Triton kernels (:func:`~mhla_diffusion.ops.triton_mhla._fused_forward`); the forward op
  also returns the block summaries it computed and their mixing, which autograd keeps for the backward (1.2 U a
  layer at Wan2.1-1.3B's 21x30x50 tokens, one bf16 copy of ``q`` being 1 U), and the backward is the fused Triton
  backward of :mod:`mhla_diffusion.ops.triton_mhla_backward` on them (neither recomputed from ``k, v`` nor mixed
  again: 1.2 U of traffic less than mixing again), or the eager operator recomputed and differentiated where that
  module does not import.
* CPU with ``TRITON_INTERPRET=1`` in the environment: the same kernels through Triton's interpreter
  (slow; tests).
* CPU otherwise: the eager operator (:func:`~mhla_diffusion.ops.triton_mhla._eager_forward`) and its
  gradients, so the op can be compiled and checked on any machine.

The op signatures use ``typing``'s ``Optional``/``List``/``Tuple`` (not ``from __future__ import
annotations``), which every ``torch.library.custom_op`` since torch 2.4 reads.
"""

import functools
import os
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .block_layout import BlockPlan
from .triton_mhla import (
    _RECORDERS,
    _augmented,
    _check_inputs,
    _compute_dtype,
    _default_dot_dtype,
    _eager_forward,
    _fused_forward,
    _launch_arguments,
    folds_key_sums,
    triton,
)

__all__ = ["fused_attention", "fused_attention_backward", "mhla_attention_fused"]


def _plan(gather: Tensor, scatter: Tensor, valid: Optional[Tensor], grid: List[int], layout: List[int]) -> BlockPlan:
    """The :class:`BlockPlan` whose tensors and settings these are (no index recomputed)."""
    m = 1
    for blocks in layout:
        m *= blocks
    return BlockPlan(m, gather.shape[0] // m, gather, scatter, valid, tuple(grid), tuple(layout))


def _runs_kernels(device: torch.device) -> bool:
    """Whether the ops launch the Triton kernels on ``device`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
    rather than the eager operator."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kept_summaries(summaries: Tensor, key_sums: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The forward's block summaries as the op returns them for its backward: their transposed storage
    ``(B, H, M, Dv (+ 1), D)`` (one more row when the key sums are folded in, see
    :func:`~mhla_diffusion.ops.triton_mhla._summary_buffers`) and the key sums ``(B, H, M, D)`` where they lie
    apart (float16 summaries; an empty tensor when folded or without a denominator)."""
    folded = _augmented(summaries, key_sums)
    if folded is not None:
        return folded, summaries.new_empty(0)
    return summaries.transpose(-1, -2), key_sums if key_sums is not None else summaries.new_empty(0)


def _summaries_from(storage: Tensor, key_sums: Tensor, value_dim: int, normalize: str):
    """``(S, z)`` ``(B, H, M, D, Dv)``, ``(B, H, M, D)`` (``z`` ``None`` without a denominator) from what
    :func:`_kept_summaries` returned."""
    if storage.shape[-2] == value_dim + 1:
        return storage[..., :value_dim, :].transpose(-1, -2), storage[..., value_dim, :]
    return storage.transpose(-1, -2), key_sums if normalize == "denominator" else None


def _kept_shapes(q: Tensor, k: Tensor, v: Tensor, layout: List[int], normalize: str):
    """Shapes and dtypes of :func:`_kept_summaries`' tensors where the kernels run."""
    m = 1
    for blocks in layout:
        m *= blocks
    batch, _, heads, d = q.shape
    dtype = _compute_dtype(k.dtype, v.dtype)
    norm = normalize == "denominator"
    fold = folds_key_sums(dtype, norm)
    storage = ((batch, heads, m, v.shape[-1] + fold, d), dtype)
    sums = ((batch, heads, m, d), torch.float32) if norm and not fold else ((0,), dtype)
    return storage, sums


@functools.lru_cache(maxsize=None)
def _triton_backward() -> Optional[Callable]:
    """The fused Triton backward, ``mhla_attention_fused_backward(grad_out, q, k, v, mixing, cos, sin, plan,
    feature_eps, normalize, eps, dot_dtype) -> (dq, dk, dv, dmixing)``, where it exists; else ``None``."""
    try:
        from . import triton_mhla_backward
    except ImportError:
        return None
    return getattr(triton_mhla_backward, "mhla_attention_fused_backward", None)


#: Whether this PyTorch has the dispatcher's private key-set guard :func:`_autograd_inside_op` uses (every release
#: from 2.4 to 2.14 does); without it the eager recompute takes the public ``torch.func.vjp`` (:func:`_eager_grads`).
_FORCED_KEYS = all(
    hasattr(torch._C, name)
    for name in ("_dispatch_tls_local_exclude_set", "_dispatch_tls_local_include_set", "_ForceDispatchKeyGuard")
)


@contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Autograd on inside a custom op's kernel, which the dispatcher calls with autograd's dispatch key
    excluded (so nothing it computes would record a graph): the eager recompute of the backward needs it.
    Private dispatcher API, used only where :data:`_FORCED_KEYS` says it exists."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _eager_grads(forward: Callable[..., Tensor], inputs: tuple[Tensor, ...], grad_out: Tensor) -> tuple[Tensor, ...]:
    """The gradients of ``forward(*inputs)`` against ``grad_out``, computed inside a custom op's kernel: by autograd
    with the dispatch key put back (:func:`_autograd_inside_op`), or, where PyTorch lacks that private guard, by the
    public ``torch.func.vjp`` (whose wrapped tensors fail only under dispatch modes that read storage, such as
    ``torch.library.opcheck``'s schema check)."""
    if _FORCED_KEYS:
        with _autograd_inside_op():
            leaves = [t.detach().requires_grad_() for t in inputs]
            out = forward(*leaves)
            return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    out, vjp = torch.func.vjp(forward, *inputs)
    return vjp(grad_out.to(out.dtype))


@torch.library.custom_op("mhla::fused_attention", mutates_args=())
def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mixing: Tensor,
    cos: Optional[Tensor],
    sin: Optional[Tensor],
    gather: Tensor,
    scatter: Tensor,
    valid: Optional[Tensor],
    grid: List[int],
    layout: List[int],
    feature_eps: float,
    normalize: str,
    eps: float,
    dot_dtype: torch.dtype,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused forward on validated inputs: ``(B, N, H, Dv)`` in ``v``'s dtype, contiguous, then the block
    summaries it was computed from and their mixing, kept for the backward (:func:`_kept_summaries` of ``S, z``
    and of ``S̃, z̃``; four empty tensors where the eager operator runs, whose backward recomputes).

    ``q, k`` ``(B, N, H, D)`` raw projections, ``v`` ``(B, N, H, Dv)``, ``mixing`` ``(M, M)`` or
    ``(H, M, M)``, ``cos, sin`` ``(1, N, 1, D)`` or ``None``; ``gather`` ``(M * P,)``, ``scatter``
    ``(N,)`` int64 and ``valid`` ``(M, P)`` bool or ``None``: the plan of ``grid`` cut by ``layout``;
    ``normalize`` ``"denominator"`` or ``"none"``. Call :func:`mhla_attention_fused`, which checks them.
    """
    plan = _plan(gather, scatter, valid, grid, layout)
    if _runs_kernels(q.device):
        out, summaries, key_sums, mixed, mixed_sums = _fused_forward(
            q, k, v, plan, mixing, cos, sin, feature_eps, normalize, eps, dot_dtype
        )
        return (out, *_kept_summaries(summaries, key_sums), *_kept_summaries(mixed, mixed_sums))
    out = _eager_forward(q, k, v, plan, mixing, cos, sin, feature_eps, normalize, eps)
    return out.to(v.dtype).contiguous(), *(q.new_empty(0) for _ in range(4))


@fused_attention.register_fake
def _fused_attention_fake(
    q, k, v, mixing, cos, sin, gather, scatter, valid, grid, layout, feature_eps, normalize, eps, dot_dtype
):
    out = v.new_empty((*q.shape[:3], v.shape[-1]))
    if not _runs_kernels(q.device):
        return out, *(q.new_empty(0) for _ in range(4))
    shapes = _kept_shapes(q, k, v, layout, normalize)  # S, z and their mixing S̃, z̃ are laid out alike
    return out, *(q.new_empty(shape, dtype=dtype) for _ in range(2) for shape, dtype in shapes)


@torch.library.custom_op("mhla::fused_attention_backward", mutates_args=())
def fused_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mixing: Tensor,
    cos: Optional[Tensor],
    sin: Optional[Tensor],
    kept: Tensor,
    kept_sums: Tensor,
    kept_mixed: Tensor,
    kept_mixed_sums: Tensor,
    gather: Tensor,
    scatter: Tensor,
    valid: Optional[Tensor],
    grid: List[int],
    layout: List[int],
    feature_eps: float,
    normalize: str,
    eps: float,
    dot_dtype: torch.dtype,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dmixing)`` of :func:`fused_attention` for ``grad_out`` ``(B, N, H, Dv)``,
    each contiguous in its input's shape and dtype; ``kept, kept_sums, kept_mixed, kept_mixed_sums``: the block
    summaries and their mixing the forward returned; the other arguments as :func:`fused_attention` took them.

    The fused Triton backward where the forward runs the kernels and that backward exists (it takes the kept
    summaries and their mixing rather than recomputing or mixing again); else the eager operator recomputed and
    differentiated (in the inputs' dtype)."""
    plan = _plan(gather, scatter, valid, grid, layout)
    backward = _triton_backward() if _runs_kernels(q.device) else None
    if backward is not None:
        saved = None
        if kept.numel():
            saved = (
                *_summaries_from(kept, kept_sums, v.shape[-1], normalize),
                *_summaries_from(kept_mixed, kept_mixed_sums, v.shape[-1], normalize),
            )
        grads = backward(grad_out, q, k, v, mixing, cos, sin, plan, feature_eps, normalize, eps, dot_dtype, saved=saved)
    else:

        def forward(q: Tensor, k: Tensor, v: Tensor, mixing: Tensor) -> Tensor:
            return _eager_forward(q, k, v, plan, mixing, cos, sin, feature_eps, normalize, eps)

        grads = _eager_grads(forward, (q, k, v, mixing), grad_out)
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v, mixing)))


@fused_attention_backward.register_fake
def _fused_attention_backward_fake(
    grad_out,
    q,
    k,
    v,
    mixing,
    cos,
    sin,
    kept,
    kept_sums,
    kept_mixed,
    kept_mixed_sums,
    gather,
    scatter,
    valid,
    grid,
    layout,
    feature_eps,
    normalize,
    eps,
    dot_dtype,
):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, mixing))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mixing, cos, sin, gather, scatter, valid, *settings = inputs
    _, *kept = output  # S, z and S̃, z̃ as _kept_summaries returns them
    ctx.mark_non_differentiable(*kept)
    ctx.save_for_backward(q, k, v, mixing, cos, sin, *kept, gather, scatter, valid)
    ctx.settings = settings  # grid, layout, feature_eps, normalize, eps, dot_dtype


def _backward(ctx, grad_out: Tensor, *_kept_grads):
    grads = torch.ops.mhla.fused_attention_backward(grad_out, *ctx.saved_tensors, *ctx.settings)
    needs = ctx.needs_input_grad
    return (*(g if need else None for g, need in zip(grads, needs[:4])), *(None,) * (len(needs) - 4))


fused_attention.register_autograd(_backward, setup_context=_setup_context)


def mhla_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    mixing: torch.Tensor,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    feature_eps: float = 1e-6,
    normalize: str = "denominator",
    eps: float = 1e-6,
    dot_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """MHLA from raw projections with the feature map, RoPE and block products fused in Triton.

    Args:
        q, k: raw query and key projections ``(B, N, H, D)`` (before the feature map); v ``(B, N, H, Dv)``.
            Any float dtype and any strides (read where they lie: slices of a fused qkv are not copied).
        plan: :func:`~mhla_diffusion.ops.block_layout.block_plan` of the token grid and layout on the inputs' device.
        mixing: ``(M, M)`` or per-head ``(H, M, M)``; row ``o`` weighs the key blocks for query block ``o``
            (applied in float32).
        cos, sin: Diffusers' Wan RoPE tables ``(1, N, 1, D)``: channel pairs ``(2i, 2i+1)`` rotate by angle
            ``i`` (see :func:`~mhla_diffusion.models.processors.base.apply_interleaved_rotary`), after the feature
            map, on the numerator path only. ``None``: no rotation.
        feature_eps: the feature map is ``phi(x) = relu(x) + feature_eps``.
        normalize: ``"denominator"`` (or ``True``): divide by ``max(phi(q_t) · z̃_b(t), 0) + eps``; ``"none"`` (or
            ``False``): no denominator. ``"scalar_mixed_denominator"`` raises ``NotImplementedError``.
        eps: added to the denominator.
        dot_dtype: operand dtype of the kernels' ``tl.dot`` (float32, bfloat16 or float16); ``None``: the
            inputs' half type on CUDA, else float32 (always float32 under the interpreter, whose bfloat16
            ``tl.dot`` is wrong). float32 dots run at IEEE precision (no TF32). Accumulation is float32.

    Returns:
        ``(B, N, H, Dv)`` in ``v``'s dtype, token order. Equals
        :func:`~mhla_diffusion.ops.naive.mhla_attention_reference` of ``phi(q), phi(k), v`` with
        ``q_rot = R(phi(q))``, ``k_rot = R(phi(k))``, to float32 accumulation (float64 inputs are computed
        in float32 too; bf16/fp16 inputs store the block summaries in their dtype, as the eager operator does;
        the rotation is computed from the grid position where an angle plan fits the tables, else the tables
        are read in that dtype: :mod:`~mhla_diffusion.ops.rope_tables`). Differentiable in ``q, k, v, mixing``.

    One custom op, ``torch.ops.mhla.fused_attention`` (its backward ``torch.ops.mhla.fused_attention_backward``),
    so ``torch.compile(fullgraph=True)`` keeps it as one node. The kernels run on CUDA, and on CPU tensors
    through Triton's interpreter when ``TRITON_INTERPRET=1`` is set; other CPU calls run the eager operator
    (see the module docstring). On ``meta`` tensors nothing is launched: an empty output (see
    :func:`~mhla_diffusion.ops.triton_mhla.recording_launches`).
    """
    mode = _check_inputs(q, k, v, plan, mixing, cos, sin, normalize, dot_dtype)
    if q.device.type == "meta":  # shapes only (counting traffic): nothing to launch
        for launches in _RECORDERS:
            launches.append(_launch_arguments(q, v, plan, mixing, cos, mode))
        return v.new_empty((*q.shape[:3], v.shape[-1]))
    if dot_dtype is None:
        dot_dtype = _default_dot_dtype(q, v)
    out, *_kept = torch.ops.mhla.fused_attention(
        q,
        k,
        v,
        mixing,
        cos,
        sin,
        plan.gather,
        plan.scatter,
        plan.valid,
        list(plan.grid),
        list(plan.layout),
        float(feature_eps),
        mode,
        float(eps),
        dot_dtype,
    )
    return out
