"""A fused MHLA backward in Triton (issue 49, item 3): ``dq, dk, dv`` and the mixing gradient of
:func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused`, with float32 accumulation.

Per batch ``b`` and head ``h``, with ``phi(x) = relu(x) + feature_eps``, ``q̂ = R(phi(q))``, ``k̂ = R(phi(k))``
(``R`` Wan's interleaved RoPE), block sums ``S_j = Σ_{s∈j} k̂_s v_sᵀ`` ``(D, Dv)``, ``z_j = Σ_{s∈j} phi(k_s)``,
the mixing ``S̃_o = Σ_j W[o, j] S_j``, ``z̃_o = Σ_j W[o, j] z_j`` and, for a query ``t`` of block ``o``,
``den_t = max(phi(q_t) · z̃_o, 0) + eps`` (1 without a denominator; the guard of
:mod:`~mhla_diffusion.ops.attention`) and ``out_t = q̂_t S̃_o / den_t``, the gradient of ``out`` against ``g`` is,
with ``g'_t = g_t / den_t`` (and the ``dz̃``, ``z̃`` terms below zero where ``phi(q_t) · z̃_o < 0``: ``den_t`` is the
constant ``eps`` there):

- ``dS̃_o = Σ_{t∈o} q̂_tᵀ g'_t``, ``dz̃_o = -Σ_{t∈o} (g'_t · out_t) phi(q_t)``;
- ``dphi(q_t) = Rᵀ(S̃_o g'_t) - (g'_t · out_t) z̃_o`` and ``dq = dphi(q) [q > 0]``;
- ``dS = Wᵀ dS̃``, ``dz = Wᵀ dz̃``, ``dW[o, j] = Σ_{b,h} <dS̃_o, S_j> + <dz̃_o, z_j>`` (per head: ``Σ_b``);
- for a key ``s`` of block ``j``: ``dv_s = dS_jᵀ k̂_s``, ``dphi(k_s) = Rᵀ(dS_j v_s) + dz_j``, ``dk = dphi(k) [k > 0]``.

It launches, in order:

1. nothing where the forward kept the summaries ``S``, ``z`` and their mixing ``S̃``, ``z̃`` (the custom op saves
   them: 1.2 U a layer at Wan2.1-1.3B's 21x30x50 tokens, against 2.7 U for rereading ``k, v`` in the summaries
   kernel and 1.2 U for mixing again); else the forward's mixing ``S̃ = W S``, ``z̃ = W z`` in PyTorch
   (:func:`~mhla_diffusion.ops.triton_mhla._mix`) on the kept ``S``, ``z`` or on ones recomputed by the forward's
   summaries kernel (:func:`~mhla_diffusion.ops.triton_mhla._launch_summaries`);
2. ``_query_grad_kernel``, one program per (batch x head, block): loads ``S̃_o`` and ``z̃_o`` once, walks the
   block's query slots in tiles (``q`` and ``g`` loaded once each; ``phi``, RoPE and the denominator
   recomputed in registers, and ``g'·out = q̂·(S̃_o g') / den`` from the product ``dq`` needs anyway), writes
   ``dq`` at the tokens and accumulates ``dS̃_o``, ``dz̃_o`` in float32;
3. the mixing's backward in PyTorch (:func:`_unmix`): ``dS = Wᵀ dS̃``, ``dz = Wᵀ dz̃`` and ``dW``;
4. ``_key_grad_kernel``, one program per (batch x head, block): loads ``dS_j``, ``dz_j`` once, walks the
   block's key slots in tiles (``k`` and ``v`` loaded once each) and writes ``dk`` and ``dv`` at the tokens.

Precision follows the forward: dots take ``dot_dtype`` operands (float32 at IEEE precision under the
interpreter) and accumulate in float32; the summaries ``S, S̃`` and their gradients ``dS̃, dS`` are stored in the
inputs' half dtype for bf16/fp16 inputs (float32 otherwise), the key sums and theirs in float32; ``dW`` is
multiplied and summed in float32. ``dq, dk, dv`` come in ``q, k, v``'s dtypes,
``dW`` in ``mixing``'s. Kernel conventions are :mod:`~mhla_diffusion.ops.triton_mhla`'s: slots from
``plan.gather``, padding masked by ``plan.valid`` (a padded slot loads and stores nothing; its denominator is 1,
so empty blocks give zeros, never NaN), RoPE as even/odd half tiles, head dims padded to a power of two,
kernels jitted per device (the interpreter for CPU tensors). Row sums use ``tl.reduce`` with this module's own
``@triton.jit`` adder (public API; under the interpreter it runs element by element, fine at test sizes).

:func:`fused_backward_traffic` counts what these launches read and write, term by term.
"""

from contextlib import contextmanager
from typing import Iterator

import torch

from . import triton_mhla
from .block_layout import BlockPlan
from .fused_mixing import _flat_pair, _float32_product, _gradient_buffers, _joint, _unflat, _unmix  # noqa: F401
from .rope_tables import Rotary, rotary_arguments, rotary_operand
from .triton_kernels import _jitted, _plan_rows, _read_rotation, _rotation
from .triton_mhla import (
    _INDEX_BYTES,
    _VALID_BYTES,
    _check_inputs,
    _compute_dtype,
    _default_dot_dtype,
    _launch_arguments,
    _launch_summaries,
    _mix,
    _pow2,
    _tl_dtype,
    fused_traffic,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = tl = None

__all__ = ["fused_backward_traffic", "mhla_attention_fused_backward", "recording_backward_launches"]


# ----------------------------------------------------------------------------- kernels
# Plain functions made kernels per device by `_kernel` (as in triton_mhla): they call no @jit helper of
# triton.language (tl.sum, tl.zeros), whose build depends on TRITON_INTERPRET at import; row sums are
# tl.reduce with `_add`, this module's own combiner (a JITFunction, or the interpreter's wrapper of it: the
# interpreter calls its `.fn` element by element).


def _add(a, b):
    """The combiner of the kernels' sums (``tl.reduce(x, axis, _add_combine)``)."""
    return a + b


_add_combine = triton.jit(_add) if triton is not None else None


def _query_grad_kernel(
    q_ptr,
    g_ptr,
    cos_ptr,
    sin_ptr,
    gather_ptr,
    valid_ptr,
    st_ptr,
    zt_ptr,
    dq_ptr,
    dst_ptr,
    dzt_ptr,
    H,
    P,
    sqb,
    sqn,
    sqh,
    sqd,
    sgb,
    sgn,
    sgh,
    sgd,
    sdb,
    sdn,
    sdh,
    sdd,
    scn,
    scd,
    ssn,
    ssd,
    rope_plane,
    rope_width,
    st_b,
    st_h,
    st_m,
    st_d,
    st_v,
    zt_b,
    zt_h,
    zt_m,
    zt_d,
    ds_b,
    ds_h,
    ds_m,
    ds_d,
    ds_v,
    dz_b,
    dz_h,
    dz_m,
    dz_d,
    feature_eps,
    eps,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_ANGLES: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    NORMALIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Block ``o`` of one (batch, head), query side: ``dq`` at its tokens; ``dS̃_o`` ``(D, Dv)`` and ``dz̃_o``
    ``(D,)`` stored at their strides."""
    bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    chan = tl.arange(0, BLOCK_D)  # channels in natural order
    cols = tl.arange(0, BLOCK_DV)
    chan_ok = chan < D
    cols_ok = cols < DV
    st_base = st_ptr + b * st_b + h * st_h + m * st_m
    s_mask = chan_ok[:, None] & cols_ok[None, :]
    # S̃_o; padded rows and columns: zero
    summary = tl.load(st_base + chan[:, None] * st_d + cols[None, :] * st_v, mask=s_mask, other=0.0).to(DOT_DTYPE)
    if NORMALIZE:
        z = tl.load(zt_ptr + b * zt_b + h * zt_h + m * zt_m + chan * zt_d, mask=chan_ok, other=0.0).to(tl.float32)
        dz = tl.full((BLOCK_D,), 0.0, tl.float32)
    ds = tl.full((BLOCK_D, BLOCK_DV), 0.0, tl.float32)
    q_base = q_ptr + b * sqb + h * sqh
    g_base = g_ptr + b * sgb + h * sgh
    dq_base = dq_ptr + b * sdb + h * sdh
    if HAS_ROPE and ROPE_ANGLES:  # the angle plan (ops.rope_tables.Rotary), once per program
        phase, step, axis = _plan_rows(cos_ptr, scn, scd, D, BLOCK_D)
    for start in range(0, P, BLOCK_T):
        slot = start + tl.arange(0, BLOCK_T)
        used = slot < P
        token = tl.load(gather_ptr + m * P + slot, mask=used, other=0)
        if HAS_VALID:
            used = used & (tl.load(valid_ptr + m * P + slot, mask=used, other=0) != 0)
        # tiles are (channels, slots): every product below then has M = D or Dv (tensor-core friendly)
        if D == BLOCK_D:  # whole rows: the slot's mask only
            q_mask = used[None, :]
        else:
            q_mask = chan_ok[:, None] & used[None, :]
        if DV == BLOCK_DV:
            g_mask = used[None, :]
        else:
            g_mask = cols_ok[:, None] & used[None, :]
        raw = tl.load(q_base + chan[:, None] * sqd + token[None, :] * sqn, mask=q_mask, other=0.0)  # q's dtype
        feats = tl.where(q_mask, tl.maximum(raw.to(tl.float32), 0.0) + feature_eps, 0.0)  # phi(q); padding: zero
        grad = tl.load(g_base + cols[:, None] * sgd + token[None, :] * sgn, mask=g_mask, other=0.0).to(tl.float32)
        if NORMALIZE:  # padded slots: denominator 1, so no 0/0 even with eps = 0
            dot = tl.reduce(feats * z[:, None], 0, _add_combine)
            live = dot >= 0.0  # the guard max(q·z̃, 0) + eps: constant (no gradient) where q·z̃ < 0
            den = tl.where(used, tl.maximum(dot, 0.0) + eps, 1.0)
            grad = grad / den[None, :]  # g'
        if HAS_ROPE:  # channels (2i, 2i+1) rotate by angle i; the tables stay in their dtype until used
            if ROPE_ANGLES:
                cos, sin = _rotation(
                    token[None, :], phase[:, None], step[:, None], axis[:, None], rope_plane, rope_width, FAST_TRIG
                )  # the slots' angles from their grid positions
            else:
                cos, sin = _read_rotation(
                    cos_ptr, sin_ptr, token, used, scn, scd, ssn, ssd, D, BLOCK_D, False
                )  # the tables' rows of the slots
            f_even, f_odd = tl.split(tl.permute(tl.reshape(feats, (BLOCK_D // 2, 2, BLOCK_T)), (0, 2, 1)))
            c = cos.to(tl.float32)
            s = sin.to(tl.float32)
            rot = tl.join(f_even * c - f_odd * s, f_even * s + f_odd * c)
            rot = tl.reshape(tl.permute(rot, (0, 2, 1)), (BLOCK_D, BLOCK_T)).to(DOT_DTYPE)
        else:
            rot = feats.to(DOT_DTYPE)
        grad = grad.to(DOT_DTYPE)
        if IEEE:
            ds = tl.dot(rot, tl.trans(grad), ds, input_precision="ieee")
            d_rot = tl.dot(summary, grad, input_precision="ieee")  # S̃ g', (D, slots)
        else:
            ds = tl.dot(rot, tl.trans(grad), ds)
            d_rot = tl.dot(summary, grad)
        if NORMALIZE:  # g'·out = g'·(q̂ S̃)/den = q̂·(S̃ g')/den: no product for the output; then dz̃
            g_out = tl.where(live, tl.reduce(rot.to(tl.float32) * d_rot, 0, _add_combine) / den, 0.0)
            dz -= tl.reduce(feats * g_out[None, :], 1, _add_combine)
        if HAS_ROPE:  # Rᵀ: rotate back by -angle
            r_even, r_odd = tl.split(tl.permute(tl.reshape(d_rot, (BLOCK_D // 2, 2, BLOCK_T)), (0, 2, 1)))
            c = cos.to(tl.float32)
            s = sin.to(tl.float32)
            d_feats = tl.join(r_even * c + r_odd * s, r_odd * c - r_even * s)
            d_feats = tl.reshape(tl.permute(d_feats, (0, 2, 1)), (BLOCK_D, BLOCK_T))
        else:
            d_feats = d_rot
        if NORMALIZE:
            d_feats -= z[:, None] * g_out[None, :]
        d_q = tl.where(raw > 0.0, d_feats, 0.0)  # relu's gate (a masked-off element loaded 0: closed)
        tl.store(dq_base + chan[:, None] * sdd + token[None, :] * sdn, d_q.to(dq_ptr.dtype.element_ty), mask=q_mask)
    ds_base = dst_ptr + b * ds_b + h * ds_h + m * ds_m
    tl.store(ds_base + chan[:, None] * ds_d + cols[None, :] * ds_v, ds.to(dst_ptr.dtype.element_ty), mask=s_mask)
    if NORMALIZE:
        dz_base = dzt_ptr + b * dz_b + h * dz_h + m * dz_m
        tl.store(dz_base + chan * dz_d, dz.to(dzt_ptr.dtype.element_ty), mask=chan_ok)


def _key_grad_kernel(
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    gather_ptr,
    valid_ptr,
    ds_ptr,
    dz_ptr,
    dk_ptr,
    dv_ptr,
    H,
    P,
    skb,
    skn,
    skh,
    skd,
    svb,
    svn,
    svh,
    svd,
    sdkb,
    sdkn,
    sdkh,
    sdkd,
    sdvb,
    sdvn,
    sdvh,
    sdvd,
    scn,
    scd,
    ssn,
    ssd,
    rope_plane,
    rope_width,
    ds_b,
    ds_h,
    ds_m,
    ds_d,
    ds_v,
    dz_b,
    dz_h,
    dz_m,
    dz_d,
    feature_eps,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_ANGLES: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    NORMALIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Block ``j`` of one (batch, head), key side: ``dk`` and ``dv`` at its tokens from ``dS_j`` ``(D, Dv)``
    and ``dz_j`` ``(D,)``, read at their strides."""
    bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    chan = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_DV)
    chan_ok = chan < D
    cols_ok = cols < DV
    ds_base = ds_ptr + b * ds_b + h * ds_h + m * ds_m
    s_mask = chan_ok[:, None] & cols_ok[None, :]
    d_summary = tl.load(ds_base + chan[:, None] * ds_d + cols[None, :] * ds_v, mask=s_mask, other=0.0).to(DOT_DTYPE)
    if NORMALIZE:
        dz = tl.load(dz_ptr + b * dz_b + h * dz_h + m * dz_m + chan * dz_d, mask=chan_ok, other=0.0).to(tl.float32)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    dk_base = dk_ptr + b * sdkb + h * sdkh
    dv_base = dv_ptr + b * sdvb + h * sdvh
    if HAS_ROPE and ROPE_ANGLES:  # the angle plan (ops.rope_tables.Rotary), once per program
        phase, step, axis = _plan_rows(cos_ptr, scn, scd, D, BLOCK_D)
    for start in range(0, P, BLOCK_T):
        slot = start + tl.arange(0, BLOCK_T)
        used = slot < P
        token = tl.load(gather_ptr + m * P + slot, mask=used, other=0)
        if HAS_VALID:
            used = used & (tl.load(valid_ptr + m * P + slot, mask=used, other=0) != 0)
        # tiles are (channels, slots), as in the query kernel
        if D == BLOCK_D:
            k_mask = used[None, :]
        else:
            k_mask = chan_ok[:, None] & used[None, :]
        if DV == BLOCK_DV:
            v_mask = used[None, :]
        else:
            v_mask = cols_ok[:, None] & used[None, :]
        raw = tl.load(k_base + chan[:, None] * skd + token[None, :] * skn, mask=k_mask, other=0.0)  # k's dtype
        feats = tl.where(k_mask, tl.maximum(raw.to(tl.float32), 0.0) + feature_eps, 0.0)  # phi(k)
        if HAS_ROPE:
            if ROPE_ANGLES:
                cos, sin = _rotation(
                    token[None, :], phase[:, None], step[:, None], axis[:, None], rope_plane, rope_width, FAST_TRIG
                )  # the slots' angles from their grid positions
            else:
                cos, sin = _read_rotation(
                    cos_ptr, sin_ptr, token, used, scn, scd, ssn, ssd, D, BLOCK_D, False
                )  # the tables' rows of the slots
            f_even, f_odd = tl.split(tl.permute(tl.reshape(feats, (BLOCK_D // 2, 2, BLOCK_T)), (0, 2, 1)))
            c = cos.to(tl.float32)
            s = sin.to(tl.float32)
            rot = tl.join(f_even * c - f_odd * s, f_even * s + f_odd * c)
            rot = tl.reshape(tl.permute(rot, (0, 2, 1)), (BLOCK_D, BLOCK_T)).to(DOT_DTYPE)
        else:
            rot = feats.to(DOT_DTYPE)
        if IEEE:
            d_v = tl.dot(tl.trans(d_summary), rot, input_precision="ieee")  # (Dv, slots)
        else:
            d_v = tl.dot(tl.trans(d_summary), rot)
        tl.store(dv_base + cols[:, None] * sdvd + token[None, :] * sdvn, d_v.to(dv_ptr.dtype.element_ty), mask=v_mask)
        # v loaded only after dv is stored: rot and d_v are dead before values and d_rot live (with generic
        # strides the key kernel spilled 4-52 bytes on sm_80 and sm_89 with v loaded first; now 206-232 registers)
        values = tl.load(v_base + cols[:, None] * svd + token[None, :] * svn, mask=v_mask, other=0.0).to(DOT_DTYPE)
        if IEEE:
            d_rot = tl.dot(d_summary, values, input_precision="ieee")  # (D, slots)
        else:
            d_rot = tl.dot(d_summary, values)
        if HAS_ROPE:
            r_even, r_odd = tl.split(tl.permute(tl.reshape(d_rot, (BLOCK_D // 2, 2, BLOCK_T)), (0, 2, 1)))
            c = cos.to(tl.float32)
            s = sin.to(tl.float32)
            d_feats = tl.join(r_even * c + r_odd * s, r_odd * c - r_even * s)
            d_feats = tl.reshape(tl.permute(d_feats, (0, 2, 1)), (BLOCK_D, BLOCK_T))
        else:
            d_feats = d_rot
        if NORMALIZE:
            d_feats += dz[:, None]
        d_k = tl.where(raw > 0.0, d_feats, 0.0)
        tl.store(dk_base + chan[:, None] * sdkd + token[None, :] * sdkn, d_k.to(dk_ptr.dtype.element_ty), mask=k_mask)


def _kernel(name: str, interpret: bool):
    """This module's kernel ``name``, jitted or interpreted (``triton_kernels._jitted``)."""
    return _jitted(globals()[name], interpret)


# ----------------------------------------------------------------------------- host side


def _backward_tiles(block_len: int, head_dim: int, value_dim: int) -> dict[str, dict[str, int]]:
    """Tiles and warps of the two backward kernels under the interpreter, and the tile widths on CUDA:
    ``{"query" | "key": dict(BLOCK_T, BLOCK_D, BLOCK_DV, num_warps)}`` (on CUDA the autotuner picks ``BLOCK_T``
    and the warps among :data:`_BACKWARD_AUTOTUNE`). Both kernels hold whole head rows and all of Dv, padded to
    powers of two (at least 16), and walk a block's slots as ``(channels, slots)`` tiles: every product then has
    D or Dv rows (the tensor cores' M), the slots as its N or K.

    The query kernel keeps the mixed summary ``S̃_o`` and the float32 accumulator of its gradient (Wan:
    128 x 128 each) beside one slot tile's q, g, features and gradients (two products a tile: ``dS̃_o += q̂ᵀ g'``
    and ``S̃_o g'``, from which ``g'·out = q̂·(S̃_o g') / den`` too); the key kernel keeps ``dS_j`` (and its
    transpose, the operand of ``dv``) and stores ``dv`` before it loads ``v``. Registers a thread and spills at
    each specialisation launched at Wan2.1-1.3B's shapes are printed by the compile test in
    tests/attention/test_triton_mhla_backward.py (``pytest -s``); none spills. ``block_len`` is not used: a block
    shorter than a tile is one masked tile."""
    del block_len
    block_d = _pow2(head_dim)
    block_dv = _pow2(value_dim)
    warps = 8 if block_d * block_dv >= 128 * 64 else 4
    tiles = dict(BLOCK_T=16, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=warps)
    return {"query": dict(tiles), "key": dict(tiles)}


#: The autotuner's choices on CUDA, per backward kernel: ``(BLOCK_T, num_warps)``, each compiling without spills on
#: sm_80, sm_89 and sm_90 at Wan2.1-1.3B's launches (the compile test). The query kernel keeps one: with its float32
#: ``dS̃`` accumulator beside ``S̃``, tiles of 32 slots spill on sm_80 (uneven grid, denominator) and 4 warps spill.
_BACKWARD_AUTOTUNE: dict[str, tuple[tuple[int, int], ...]] = {
    "_query_grad_kernel": ((16, 8),),
    "_key_grad_kernel": ((16, 8), (32, 8)),
}

_TUNED_BACKWARD: dict[str, object] = {}


def _tuned_backward(name: str, interpret: bool, tiles: dict[str, int]) -> tuple[object, dict[str, int]]:
    """Kernel ``name`` and the launch options it takes beside its arguments: the interpreter's fixed ``tiles``;
    on CUDA the tile widths only, the autotuner (keyed on the head dims and the block length) picking ``BLOCK_T``
    and the warps among :data:`_BACKWARD_AUTOTUNE` (the kernels only store: running a config again is harmless)."""
    if interpret:
        return _kernel(name, True), dict(tiles)
    if name not in _TUNED_BACKWARD:
        configs = [triton.Config({"BLOCK_T": t}, num_warps=w) for t, w in _BACKWARD_AUTOTUNE[name]]
        _TUNED_BACKWARD[name] = triton.autotune(configs=configs, key=["D", "DV", "P"])(_kernel(name, False))
    return _TUNED_BACKWARD[name], {k: v for k, v in tiles.items() if k not in ("BLOCK_T", "num_warps")}


def _plan_pointers(plan: BlockPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan.gather`` and ``plan.valid`` as the kernels read them (int64, uint8; ``gather`` again as an
    unused pointer when every slot is real)."""
    gather = plan.gather.contiguous()  # (M * P,) int64, already contiguous from block_plan: no copy
    return gather, plan.valid.contiguous().view(torch.uint8) if plan.valid is not None else gather


def _launch_query_grad(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    plan: BlockPlan,
    rope: Rotary | None,
    summaries: torch.Tensor,
    key_sums: torch.Tensor | None,
    mixed: torch.Tensor,
    mixed_sums: torch.Tensor | None,
    feature_eps: float,
    eps: float,
    dot_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The query-side kernel on validated inputs: ``dq`` ``(B, N, H, D)`` in ``q``'s dtype and ``dS̃``
    ``(B, H, M, D, Dv)``, ``dz̃`` ``(B, H, M, D)`` (``None`` without a denominator, ``mixed_sums is None``)
    laid out as the forward's ``summaries``, ``key_sums`` (:func:`_gradient_buffers`). ``mixed`` and
    ``mixed_sums`` (``S̃``, ``z̃``) are read by their strides."""
    batch, _, heads, d = q.shape
    dv = grad_out.shape[-1]
    norm = mixed_sums is not None
    tiles = _backward_tiles(plan.block_len, d, dv)["query"]
    gather, valid = _plan_pointers(plan)
    tables, rope_numbers, rope_flags = rotary_arguments(rope, q)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    d_mixed, d_mixed_sums = _gradient_buffers(summaries, key_sums if norm else None)
    no_sums = (0, 0, 0, 0)
    kernel, options = _tuned_backward("_query_grad_kernel", q.device.type == "cpu", tiles)
    kernel[(batch * heads, plan.num_blocks)](
        q,
        grad_out,
        *tables,
        gather,
        valid,
        mixed,
        mixed_sums if norm else mixed,  # unused pointers without a denominator
        dq,
        d_mixed,
        d_mixed_sums if norm else d_mixed,
        heads,
        plan.block_len,
        *q.stride(),
        *grad_out.stride(),
        *dq.stride(),
        *rope_numbers,
        *mixed.stride(),
        *(mixed_sums.stride() if norm else no_sums),
        *d_mixed.stride(),
        *(d_mixed_sums.stride() if norm else no_sums),
        float(feature_eps),
        float(eps),
        D=d,
        DV=dv,
        HAS_VALID=plan.valid is not None,
        HAS_ROPE=rope is not None,
        **rope_flags,
        NORMALIZE=norm,
        DOT_DTYPE=_tl_dtype(dot_dtype),
        IEEE=dot_dtype == torch.float32,
        **options,
    )
    return dq, d_mixed, d_mixed_sums


def _launch_key_grad(
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    rope: Rotary | None,
    d_summaries: torch.Tensor,
    d_sums: torch.Tensor | None,
    feature_eps: float,
    dot_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key-side kernel on validated inputs: ``dk`` ``(B, N, H, D)`` and ``dv`` ``(B, N, H, Dv)`` in ``k``'s
    and ``v``'s dtypes from ``dS`` ``(B, H, M, D, Dv)`` and ``dz`` ``(B, H, M, D)`` (``None`` without a
    denominator), read by their strides."""
    batch, _, heads, d = k.shape
    dv_dim = v.shape[-1]
    tiles = _backward_tiles(plan.block_len, d, dv_dim)["key"]
    gather, valid = _plan_pointers(plan)
    tables, rope_numbers, rope_flags = rotary_arguments(rope, k)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    kernel, options = _tuned_backward("_key_grad_kernel", k.device.type == "cpu", tiles)
    kernel[(batch * heads, plan.num_blocks)](
        k,
        v,
        *tables,
        gather,
        valid,
        d_summaries,
        d_summaries if d_sums is None else d_sums,  # unused pointer without a denominator
        dk,
        dv,
        heads,
        plan.block_len,
        *k.stride(),
        *v.stride(),
        *dk.stride(),
        *dv.stride(),
        *rope_numbers,
        *d_summaries.stride(),
        *(d_sums.stride() if d_sums is not None else (0, 0, 0, 0)),
        float(feature_eps),
        D=d,
        DV=dv_dim,
        HAS_VALID=plan.valid is not None,
        HAS_ROPE=rope is not None,
        **rope_flags,
        NORMALIZE=d_sums is not None,
        DOT_DTYPE=_tl_dtype(dot_dtype),
        IEEE=dot_dtype == torch.float32,
        **options,
    )
    return dk, dv


_BACKWARD_RECORDERS: list[list[dict]] = []


@contextmanager
def recording_backward_launches() -> Iterator[list[dict]]:
    """While active, :func:`mhla_attention_fused_backward` on ``meta`` tensors launches nothing: it returns
    empty gradients and appends its :func:`fused_backward_traffic` arguments to the list this yields (for
    counting a training step's traffic on meta tensors). Outside it, meta tensors give the same empty
    gradients and record nothing."""
    launches: list[dict] = []
    _BACKWARD_RECORDERS.append(launches)
    try:
        yield launches
    finally:
        _BACKWARD_RECORDERS.remove(launches)


def _check_grad_out(grad_out: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    """``grad_out`` must be the output's gradient: ``(B, N, H, Dv)``, floating point, on ``q``'s device."""
    want = (*q.shape[:3], v.shape[-1])
    if not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != want:
        raise ValueError(
            f"`grad_out` must be the output's gradient of shape {want}, got {tuple(getattr(grad_out, 'shape', ()))}"
        )
    if not grad_out.is_floating_point():
        raise ValueError(f"`grad_out` must be a floating-point tensor, got {grad_out.dtype}")
    if grad_out.device != q.device:
        raise ValueError(f"`grad_out` is on {grad_out.device} but q is on {q.device}")


def mhla_attention_fused_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    plan: BlockPlan,
    feature_eps: float,
    normalize: str,
    eps: float,
    dot_dtype: torch.dtype | None,
    *,
    saved: tuple[torch.Tensor | None, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused` in fused Triton kernels.

    Args:
        grad_out: the output's gradient ``(B, N, H, Dv)`` (any float dtype, any strides).
        q, k, v, mixing, cos, sin, plan, feature_eps, normalize, eps, dot_dtype: as given to
            :func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused` (raw ``q, k`` ``(B, N, H, D)`` before
            the feature map, ``v`` ``(B, N, H, Dv)``, mixing ``(M, M)`` or ``(H, M, M)``, Diffusers' RoPE tables
            ``(1, N, 1, D)`` or ``None``, ``normalize`` ``"denominator"``/``"none"`` (or ``True``/``False``);
            ``dot_dtype`` ``None``: the forward's default).
        saved: optionally, what the forward computed on these inputs: the block summaries ``(S, z)`` as
            :func:`~mhla_diffusion.ops.triton_mhla._launch_summaries` returned them (``z`` ``None`` without a
            denominator), or those and their mixing ``(S, z, S̃, z̃)`` as
            :func:`~mhla_diffusion.ops.triton_mhla._mix` returned it (what the custom op keeps from its forward).
            Then the summaries kernel is not run again, nor, given ``S̃, z̃``, the mixing: at Wan2.1-1.3B's
            21x30x50 tokens (bf16, RoPE) the backward moves 11.5 U instead of 15.4 U (:func:`fused_backward_traffic`
            with ``recompute=False`` and ``remix=False``), for 1.2 U of memory kept per layer. ``None``:
            recomputed.

    Returns:
        ``(dq, dk, dv, dmixing)``: ``dq, dk`` ``(B, N, H, D)``, ``dv`` ``(B, N, H, Dv)`` in ``q, k, v``'s dtypes
        and ``dmixing`` in ``mixing``'s shape and dtype: what autograd through the forward gives (see the module
        docstring for the formulas and the precision). Works on CUDA tensors and, through Triton's interpreter,
        on CPU tensors; on ``meta`` tensors it launches nothing and returns empty gradients (see
        :func:`recording_backward_launches`).
    """
    mode = _check_inputs(q, k, v, plan, mixing, cos, sin, normalize, dot_dtype)
    _check_grad_out(grad_out, q, v)
    empty = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, mixing))
    if q.device.type == "meta":  # shapes only (counting traffic): nothing to launch
        for launches in _BACKWARD_RECORDERS:  # the forward of the same step converted the RoPE tables
            launches.append({**_launch_arguments(q, v, plan, mixing, cos, mode), "rope_converted": False})
        return empty
    del empty
    if saved is not None and len(saved) not in (2, 4):
        raise ValueError(f"`saved` must be (S, z) or (S, z, S̃, z̃), got {len(saved)} tensors")
    if saved is not None and (saved[1] is None) != (mode == "none"):
        raise ValueError(f"`saved` must hold the key sums z exactly when normalize='denominator' (got {mode!r})")
    if dot_dtype is None:
        dot_dtype = _default_dot_dtype(q, v)
    return _fused_backward(grad_out, q, k, v, mixing, cos, sin, plan, feature_eps, mode, eps, dot_dtype, saved)


def _fused_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    plan: BlockPlan,
    feature_eps: float,
    normalize: str,
    eps: float,
    dot_dtype: torch.dtype,
    saved: tuple[torch.Tensor | None, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch (summaries -> mixing ->) query kernel -> unmixing -> key kernel on validated inputs
    (``normalize`` ``"denominator"``/``"none"``, ``dot_dtype`` given; see
    :func:`mhla_attention_fused_backward`). On ``meta`` tensors with ``_kernel`` swapped for a recorder (the
    compile test), the launches are exactly the ones a CUDA call of these shapes makes."""
    rope = None if cos is None else rotary_operand(cos, sin, _compute_dtype(q.dtype, k.dtype, v.dtype), plan.grid)
    if saved is None:
        summaries, key_sums = _launch_summaries(k, v, plan, rope, feature_eps, normalize, dot_dtype)
    else:
        summaries, key_sums = saved[:2]
    if saved is not None and len(saved) == 4:
        mixed, mixed_sums = saved[2:]
    else:
        mixed, mixed_sums = _mix(mixing, summaries, key_sums)
    dq, d_mixed, d_mixed_sums = _launch_query_grad(
        grad_out, q, plan, rope, summaries, key_sums, mixed, mixed_sums, feature_eps, eps, dot_dtype
    )
    del mixed, mixed_sums
    d_summaries, d_sums, d_mixing = _unmix(mixing, summaries, key_sums, d_mixed, d_mixed_sums)
    del summaries, key_sums, d_mixed, d_mixed_sums
    dk, dv = _launch_key_grad(k, v, plan, rope, d_summaries, d_sums, feature_eps, dot_dtype)
    return dq, dk, dv, d_mixing.to(mixing.dtype)


def _forward_buffers(
    batch: int, heads: int, m: int, d: int, dv: int, dtype: torch.dtype, norm: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Meta summaries ``S`` and key sums ``z`` laid out as the forward's summaries kernel stores them."""
    make = getattr(triton_mhla, "_summary_buffers", None)
    if make is not None:
        return make(batch, heads, m, d, dv, dtype, norm, torch.device("meta"))
    summaries = torch.empty((batch, heads, m, d, dv), dtype=dtype, device="meta")
    return summaries, torch.empty((batch, heads, m, d), dtype=torch.float32, device="meta") if norm else None


def fused_backward_traffic(
    batch: int,
    tokens: int,
    heads: int,
    head_dim: int,
    value_dim: int,
    num_blocks: int,
    block_len: int,
    *,
    padded: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    rope_dtype: torch.dtype | None = torch.float32,
    normalize: str = "denominator",
    per_head_mixing: bool = False,
    rope_converted: bool = False,
    recompute: bool = False,
    remix: bool = False,
    rope_angles: bool = True,
) -> dict[str, int]:
    """Bytes that :func:`mhla_attention_fused_backward` reads and writes in global memory, term by term, as
    it launches (the arguments and rules of :func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`; the
    gradient ``grad_out`` is in ``dtype`` too). ``rope_converted``: whether this call converts the RoPE
    tables to the summaries' dtype; in a training step the forward converted them and the backward finds
    the copy in the forward's cache (``False``, the default). ``recompute``: whether the summaries are
    recomputed (``False``: the forward's, passed as ``saved``, as the custom op does); ``remix``: whether their
    mixing is (``False``: the forward's ``S̃, z̃``, kept by the custom op; always with ``recompute``).

    The recomputation is the forward's own count, prefixed ``"recompute: "``: with ``remix`` its mixing term of
    :func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`, and with ``recompute`` its summaries kernel's too (every
    term but the output kernel's and the table conversion's). Then the query kernel (per (batch x head, block)
    ``S̃_o`` and ``z̃_o`` once; per real slot ``q``, ``g``, the tables and ``dq``; ``dS̃_o``, ``dz̃_o`` stored), the
    mixing's backward (:func:`_unmix`, counted by :func:`~mhla_diffusion.ops.traffic.count_traffic` on meta tensors)
    and the key kernel (``dS_j``, ``dz_j`` once; per real slot ``k``, ``v``, the tables, ``dk`` and ``dv``). Caches
    are ignored: the tables count once per (batch x head) in each kernel. Do not call it inside a ``count_traffic``.
    Returns ``{term: bytes}`` in launch order.
    """
    from .attention import normalization_mode
    from .traffic import count_traffic

    norm = normalization_mode(normalize) == "denominator"
    compute = _compute_dtype(dtype)
    size, compute_size = (torch.empty((), dtype=t).element_size() for t in (dtype, compute))
    bh, m, p = batch * heads, num_blocks, block_len
    pairs = (head_dim + 1) // 2
    rope = 0 if rope_dtype is None else 1
    index = p * (_INDEX_BYTES + (_VALID_BYTES if padded else 0))
    summary = bh * m * head_dim * value_dim * compute_size
    # the summaries and key sums as the forward lays them out (z float32, or a row of [S | z] in S's dtype)
    summaries, key_sums = _forward_buffers(batch, heads, m, head_dim, value_dim, compute, norm)
    key_sum = 0 if key_sums is None else bh * m * head_dim * key_sums.element_size()
    # the angle plan once per program, or the tables per real slot and head
    rotation = rope * (bh * m * 3 * pairs * 4 if rope_angles else bh * tokens * pairs * 2 * compute_size)
    rope_term = ": RoPE angle plan" if rope_angles else ": RoPE tables"
    forward = fused_traffic(
        batch,
        tokens,
        heads,
        head_dim,
        value_dim,
        num_blocks,
        block_len,
        padded=padded,
        dtype=dtype,
        rope_dtype=rope_dtype,
        normalize=normalize,
        per_head_mixing=per_head_mixing,
        rope_angles=rope_angles,
    )
    preparation = [(term, moved) for term, moved in forward.items() if term.startswith("RoPE")]
    terms = {term.replace(", once per forward", ""): moved if rope_converted else 0 for term, moved in preparation}
    for term, moved in forward.items():
        mixing_term = term.startswith("mixing") and (remix or recompute)
        if mixing_term or (recompute and not term.startswith(("mixing", "output kernel", "RoPE"))):
            terms[f"recompute: {term}"] = moved
    # _query_grad_kernel, grid (B*H, M)
    terms["query grad kernel: mixed summary"] = summary
    terms["query grad kernel: mixed key sum"] = key_sum
    terms["query grad kernel: plan index"] = bh * m * index
    terms["query grad kernel: q"] = bh * tokens * head_dim * size
    terms["query grad kernel: output gradient"] = bh * tokens * value_dim * size
    terms["query grad kernel" + rope_term] = rotation
    terms["query grad kernel: dq stored"] = bh * tokens * head_dim * size
    terms["query grad kernel: dS̃ stored"] = summary
    terms["query grad kernel: dz̃ stored"] = key_sum
    # PyTorch: dS = Wᵀ dS̃, dz = Wᵀ dz̃, dW
    meta = dict(device="meta")
    mixing = torch.empty((heads, m, m) if per_head_mixing else (m, m), dtype=torch.float32, **meta)
    d_mixed, d_sums = _gradient_buffers(summaries, key_sums)
    terms["mixing backward (PyTorch): Wᵀ dS̃, Wᵀ dz̃, dW"] = count_traffic(
        lambda: _unmix(mixing, summaries, key_sums, d_mixed, d_sums)
    ).total
    # _key_grad_kernel, grid (B*H, M)
    terms["key grad kernel: dS"] = summary
    terms["key grad kernel: dz"] = key_sum
    terms["key grad kernel: plan index"] = bh * m * index
    terms["key grad kernel: k"] = bh * tokens * head_dim * size
    terms["key grad kernel: v"] = bh * tokens * value_dim * size
    terms["key grad kernel" + rope_term] = rotation
    terms["key grad kernel: dk stored"] = bh * tokens * head_dim * size
    terms["key grad kernel: dv stored"] = bh * tokens * value_dim * size
    return terms
