"""One chunk of a block-causal MHLA stream on the fused Triton kernels, as a ``torch.library`` custom op.

The fused forward (:mod:`~mhla_diffusion.ops.triton_mhla`) runs in three steps: the chunk's block summaries
(kernel 1), their mixing ``S̃ = W S`` (a PyTorch product), the queries against ``S̃`` (kernel 2). A stream's chunk
only adds rows to the mixing: the blocks the state carries (the fold and the recent rows, already summaries) enter
``S̃`` as extra mixed rows, ``S̃_o = Σ_c W[o, c] S_c + Σ_j W[o, M_carried + j] S_j``, and the kernels see nothing
else. The op returns the chunk's own summaries and key sums too, from which the state after the chunk is made.

Where it runs, as :mod:`~mhla_diffusion.ops.fused_op`'s ops: the kernels on CUDA (and on a CPU with
``TRITON_INTERPRET=1``, through Triton's interpreter: tests); otherwise the eager
:func:`~mhla_diffusion.ops.causal_chunk.causal_chunk_output`, so the op compiles and checks on any machine. The op has a
fake implementation, so ``torch.compile`` keeps it as one node. It is inference-only: a chunk that needs gradients
runs the eager operator (:func:`~mhla_diffusion.ops.causal.mhla_causal_step` chooses).

The op signature uses ``typing``'s ``Optional``/``List``/``Tuple`` (not ``from __future__ import annotations``).
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .attention import without_autocast
from .block_layout import BlockPlan
from .causal_chunk import causal_chunk_output
from .fused_op import _plan, _runs_kernels
from .rope_tables import rotary_operand
from .triton_mhla import (
    _RECORDERS,
    _compute_dtype,
    _default_dot_dtype,
    _launch_arguments,
    _launch_output,
    _launch_summaries,
    _mix,
)

__all__ = ["fused_causal_chunk", "fused_causal_traffic"]


def _sum_dtype(q: Tensor, v: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)


def _fused_causal_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: BlockPlan,
    weights: Tensor,
    carried: List[Tensor],
    carried_sums: Optional[Tensor],
    cos: Optional[Tensor],
    sin: Optional[Tensor],
    feature_eps: float,
    normalize: str,
    eps: float,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Kernel 1 on the chunk, the mixing with the carried blocks as extra rows, kernel 2."""
    dot_dtype = _default_dot_dtype(q, v)
    rope = None if cos is None else rotary_operand(cos, sin, _compute_dtype(q.dtype, k.dtype, v.dtype), plan.grid)
    summaries, key_sums = _launch_summaries(k, v, plan, rope, feature_eps, normalize, dot_dtype)
    width = sum(part.shape[2] for part in carried)
    mixed, mixed_sums = _mix(weights[..., width:], summaries, key_sums)  # the chunk's own blocks
    _add_carried(mixed, mixed_sums, weights[..., :width], carried, carried_sums)
    out = _launch_output(q, plan, rope, mixed, mixed_sums, v.dtype, v.shape[-1], feature_eps, eps, dot_dtype)
    return out, summaries, key_sums


def _add_carried(
    mixed: Tensor, mixed_sums: Optional[Tensor], weights: Tensor, carried: List[Tensor], carried_sums: Optional[Tensor]
) -> None:
    """``S̃ += Σ_c W[:, c] S_c`` and ``z̃ += Σ_c W[:, c] z_c`` over the carried blocks, in place (the mixed summaries
    of :func:`~mhla_diffusion.ops.triton_mhla._mix`, read by their strides). ``weights``: the carried blocks'
    columns ``(.., M_c, C)``; the products in the carried blocks' (wide) dtype, added once."""
    if not carried:
        return
    with without_autocast(mixed.device):
        batch, heads, m, d, dv = mixed.shape
        weights = weights.to(carried[0].dtype).expand(batch, heads, *weights.shape[-2:])
        weights = weights.reshape(batch * heads, m, -1)
        extra, start = None, 0
        for part in carried:  # one float32 accumulator: each part's product added in place
            cols = weights[..., start : start + part.shape[2]]
            start += part.shape[2]
            x = part.reshape(batch * heads, part.shape[2], d * dv)
            extra = torch.bmm(cols, x) if extra is None else extra.baddbmm_(cols, x)
        mixed.add_(extra.view(batch, heads, m, d, dv))  # rounded once to the mixed summaries' dtype
        if mixed_sums is not None:
            sums = torch.bmm(weights.to(carried_sums.dtype), carried_sums.reshape(batch * heads, -1, d))
            mixed_sums.add_(sums.view(batch, heads, m, d))


def fused_causal_traffic(carried: List[Tuple[int, ...]], carried_dtype: torch.dtype, **launch) -> dict:
    """Bytes a stream chunk's fused launch moves, term by term: :func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`
    of the chunk's kernels and mixing (``launch``: its arguments), plus the carried blocks mixed in (shapes
    ``carried``, ``(B, H, C_i, D, Dv)`` in ``carried_dtype``), counted op by op on meta tensors."""
    from .traffic import count_traffic
    from .triton_mhla import _summary_buffers, fused_traffic

    terms = fused_traffic(**launch)
    batch, heads, d, dv, m = (
        launch["batch"],
        launch["heads"],
        launch["head_dim"],
        launch["value_dim"],
        launch["num_blocks"],
    )
    norm = launch["normalize"] == "denominator"
    compute = _compute_dtype(launch["dtype"])
    mixed, mixed_sums = _summary_buffers(batch, heads, m, d, dv, compute, norm, torch.device("meta"))
    width = sum(shape[2] for shape in carried)
    weights = torch.empty((heads, m, width) if launch["per_head_mixing"] else (m, width), device="meta")
    parts = [torch.empty(shape, dtype=carried_dtype, device="meta") for shape in carried]
    sums = torch.empty((batch, heads, width, d), dtype=carried_dtype, device="meta") if norm else None
    count = count_traffic(lambda: _add_carried(mixed, mixed_sums, weights, parts, sums))
    terms["carried blocks mixed in (PyTorch): W S, W z"] = count.total
    return terms


@torch.library.custom_op("mhla::fused_causal_chunk", mutates_args=())
def _fused_causal_chunk_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weights: Tensor,
    carried: List[Tensor],
    carried_sums: Optional[Tensor],
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
) -> Tuple[Tensor, Tensor, Tensor]:
    """See :func:`fused_causal_chunk`; the plan comes as its tensors and its grid and layout as int lists. The key
    sums come back empty without a denominator."""
    plan = _plan(gather, scatter, valid, grid, layout)
    if _runs_kernels(q.device):
        out, summaries, key_sums = _fused_causal_forward(
            q, k, v, plan, weights, carried, carried_sums, cos, sin, feature_eps, normalize, eps
        )
    else:
        rotary = None if cos is None else (cos, sin)
        out, summaries, key_sums = causal_chunk_output(
            q, k, v, plan, weights, carried, carried_sums, normalize, eps, feature_eps, rotary
        )
    dtype = _sum_dtype(q, v)
    sums = q.new_empty(0, dtype=dtype) if key_sums is None else key_sums.to(dtype).contiguous()
    return out.to(v.dtype).contiguous(), summaries.to(dtype).contiguous(), sums


def _empty_outputs(q: Tensor, v: Tensor, num_blocks: int, normalize: str) -> Tuple[Tensor, Tensor, Tensor]:
    """Empty tensors shaped as the op's outputs (its fake implementation, and a meta call's result)."""
    batch, _, heads, d = q.shape
    dtype = _sum_dtype(q, v)
    sums = (batch, heads, num_blocks, d) if normalize == "denominator" else (0,)
    return (
        v.new_empty((*q.shape[:3], v.shape[-1])),
        q.new_empty((batch, heads, num_blocks, d, v.shape[-1]), dtype=dtype),
        q.new_empty(sums, dtype=dtype),
    )


@_fused_causal_chunk_op.register_fake
def _fused_causal_chunk_fake(
    q, k, v, weights, carried, carried_sums, cos, sin, gather, scatter, valid, grid, layout, feature_eps, normalize, eps
):
    m = 1
    for blocks in layout:
        m *= blocks
    return _empty_outputs(q, v, m, normalize)


def fused_causal_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: BlockPlan,
    weights: Tensor,
    carried: List[Tensor],
    carried_sums: Optional[Tensor],
    rotary: Optional[Tuple[Tensor, Tensor]],
    feature_eps: float,
    normalize: str,
    eps: float,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """One chunk of a stream through ``torch.ops.mhla.fused_causal_chunk``: as
    :func:`~mhla_diffusion.ops.causal_chunk.causal_chunk_output` (same arguments, the operator's own feature map
    ``ReLU(x) + feature_eps`` and RoPE ``rotary``), on checked inputs (:func:`~mhla_diffusion.ops.causal.
    mhla_causal_step` makes them). Returns the output ``(B, N_c, H, Dv)``, the chunk's block summaries ``(B, H,
    M_c, D, Dv)`` and key sums ``(B, H, M_c, D)`` (``None`` without a denominator), both in at least float32."""
    cos, sin = (None, None) if rotary is None else rotary
    if q.device.type == "meta":  # shapes only (counting traffic): record the launch, launch nothing
        width = sum(part.shape[2] for part in carried)
        for launches in _RECORDERS:
            launch = _launch_arguments(q, v, plan, weights[..., width:], cos, normalize, sin)
            launches.append({**launch, "carried": [tuple(p.shape) for p in carried], "carried_dtype": carried[0].dtype})
        out, summaries, key_sums = _empty_outputs(q, v, plan.num_blocks, normalize)
        return out, summaries, None if normalize != "denominator" else key_sums
    out, summaries, key_sums = torch.ops.mhla.fused_causal_chunk(
        q,
        k,
        v,
        weights,
        list(carried),
        carried_sums,
        cos,
        sin,
        plan.gather,
        plan.scatter,
        plan.valid,
        list(plan.grid),
        list(plan.layout),
        float(feature_eps),
        normalize,
        float(eps),
    )
    return out, summaries, None if normalize != "denominator" else key_sums
