"""A fused MHLA forward in Triton (issue 34, item 3), in flash-linear-attention's chunked style.

From the *raw* projections ``q, k, v`` ``(B, N, H, D)`` (before the feature map) it computes what
:func:`~mhla_diffusion.ops.attention.mhla_attention` computes from ``phi(q), phi(k), v`` with
``q_rot = R(phi(q))``, ``k_rot = R(phi(k))`` (``phi(x) = relu(x) + feature_eps``, ``R`` Wan's
interleaved RoPE), in three steps:

1. ``_summaries_kernel``, one program per (Dv tile, batch x head, block): walks block ``m``'s padded
   slots in tiles (token of each slot from ``plan.gather``, padding masked by ``plan.valid``), loads each
   tile of ``k`` and ``v`` as whole rows at their native strides, applies ``phi`` and RoPE in registers and
   accumulates in float32 ``S_m = Σ k̂ vᵀ`` ``(D, Dv)`` and ``z_m = Σ phi(k)`` ``(D,)``. Up to Dv = 128
   there is one Dv tile, so ``k`` is read once.
2. The ``M x M`` mixing ``S̃ = W S``, ``z̃ = W z``: small matmuls in PyTorch (float32 summaries carry ``z`` as
   one more row of their transposed storage, ``[Sᵀ; zᵀ]``: one product; half ones keep it apart in float32: two).
3. ``_output_kernel``, one program per (batch x head, block): loads ``S̃_m`` and ``z̃_m`` once, then
   walks the block's slots in tiles (software-pipelined), loading each query once (``phi`` and RoPE in
   registers): ``out = q̂ S̃_m``, divided by ``max(phi(q) · z̃_m, 0) + eps`` when normalizing (the guard of
   :mod:`~mhla_diffusion.ops.attention`: finite once the mixing is signed), written straight to
   the tokens' positions in ``v``'s dtype.

Precision: products accumulate in float32. The summaries ``S`` and ``S̃`` are stored in the inputs'
half dtype when the inputs are bf16/fp16 (float32 otherwise), as the eager operator stores them; the
key sums are summed, stored and mixed in float32 (see :func:`_summary_buffers` for why not in a bf16 row).
RoPE: Wan's tables are not read. Each program loads the angle plan of :mod:`~mhla_diffusion.ops.rope_tables`
(each channel pair's phase, step and grid axis, fitted to the tables once per transformer forward) and computes the
rotation of each slot from its token's grid position (``ROPE_ANGLES``; on CUDA with the fast ``sin.approx`` and
``cos.approx`` after an exact range reduction, ``FAST_TRIG``). Tables that no plan fits are read as their even
channels (each angle once) in the summaries' dtype. :func:`fused_traffic` counts the launch term by term (6.8 U at
Wan2.1-1.3B's 21x30x50 tokens for one lone call with the denominator and RoPE, where the floor is 6.5 U; 8.8 U with
the tables read).

Memory access: a tile of ``q`` or ``k`` is ``(BLOCK_T, D)`` whole head rows (16-byte vector loads where a
row's channels are contiguous), split into even and odd channels in registers for RoPE and joined back,
so one ``tl.dot`` of depth ``D`` takes the rotated features in natural channel order; the summaries are
stored in that order ``(B, H, M, D, Dv)``. Head dims are compile-time constants, so a power-of-two head
dim (Wan: 128) masks rows by their slot only; other head dims pad tiles to a power of two (at least 16)
and mask. On CUDA the tile length, warps and pipeline stages are autotuned (:data:`_AUTOTUNE`, keyed on
the head dims and the block length); the interpreter takes :func:`_tiles`' fixed choice.

Launch grids put the heads of one block next to each other (``(Dv tiles, B*H, M)`` and ``(B*H, M)``:
axis 0 varies fastest), so that programs reading the same RoPE table rows run together and may hit
the L2 cache (:func:`fused_traffic` does not count on it).

The public entry is :func:`mhla_diffusion.ops.fused_op.mhla_attention_fused`: the launches here wrapped
as one ``torch.library`` custom op with a fake implementation and an autograd formula whose backward is
the fused Triton backward of :mod:`~mhla_diffusion.ops.triton_mhla_backward`, so ``torch.compile``
keeps them. On CPU tensors the kernels run through Triton's interpreter (slow, for tests);
:func:`fused_available` says when callers should choose this path.
"""

# No `from __future__ import annotations`: the kernels' `tl.constexpr` annotations must be the objects, not
# strings, for Triton 3.0's interpreter (it matches the annotation's name, "constexpr", to find them).

import os
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from .attention import mhla_attention, normalization_mode
from .block_layout import BlockPlan
from .fused_checks import _DOT_DTYPES, _check_inputs, _check_rotary  # noqa: F401 (the backward imports them here)
from .fused_mixing import _augmented, _blocks_flat, _mix, _summary_buffers, folds_key_sums  # noqa: F401
from .rope_tables import (
    Rotary,
    _angle_plan,
    _convert_tables,
    _grid3,
    _prepared_rotary,
    rotary_arguments,
    rotary_operand,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = tl = None

__all__ = ["FUSED", "fused_available", "fused_traffic", "recording_launches"]

#: Module-level switch: ``MHLA_FUSED=0`` in the environment (read at import) turns the fused path off
#: for :func:`fused_available`; callers may also set it at run time.
FUSED: bool = os.environ.get("MHLA_FUSED", "1").strip().lower() not in ("0", "false", "off", "no")


def fused_available(tensor: torch.Tensor) -> bool:
    """Whether :func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused` should be used for ``tensor``'s device.

    True when the switch :data:`FUSED` is on, Triton imports, and ``tensor`` is on CUDA, or is a CPU
    tensor while ``TRITON_INTERPRET=1`` is set (the interpreter; tests only), or a ``meta`` tensor inside
    :func:`recording_launches` (counting traffic). ``torch.compile`` keeps the path: the kernels are one
    custom op (:mod:`~mhla_diffusion.ops.fused_op`).
    """
    if not FUSED or triton is None:
        return False
    if tensor.is_cuda:
        return True
    if tensor.device.type == "meta":
        return bool(_RECORDERS)
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- kernels
# Plain functions, made Triton kernels by `_kernel` per device: the interpreter for CPU tensors whatever
# TRITON_INTERPRET said when Triton was imported. That setting decides whether triton.language's own @jit
# helpers (tl.sum, tl.zeros, ...) are built for the interpreter: when it was unset, calling one from an
# interpreted kernel raises ("Cannot call @triton.jit'd outside of the scope of a kernel"). So the kernels
# call none of those: tl.full instead of tl.zeros, and sums as the public tl.reduce with a combiner of our
# own (`_add`), which both the compiler (a @jit function) and the interpreter (it calls the combiner's
# Python function) take in either import mode. Our own helpers (`_HELPERS`) are @jit functions built for the
# compiler, which an interpreted kernel cannot call either: `_jitted` gives it their plain functions instead.
#
# Memory access: each tile of q or k is a (BLOCK_T, D) tile of whole head rows (one token's D channels are
# contiguous: 16-byte vector loads), split into the even and odd channels in registers for RoPE
# (reshape to (.., D/2, 2) and split; join and reshape back), so one tl.dot of K = D takes the rotated
# features in natural channel order. The head dims are compile-time constants: where they are powers of
# two (Wan: 128), the only mask on a row is its slot's, constant along the row.


def _add(a, b):
    """The combiner of the kernels' sums (``tl.reduce(x, axis, _add_combine)``)."""
    return a + b


_add_combine = triton.jit(_add) if triton is not None else None


def _plan_rows_fn(plan_ptr, row_stride, col_stride, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The angle plan's three rows (:class:`~mhla_diffusion.ops.rope_tables.Rotary`): each channel pair's phase, step
    and axis ``(BLOCK_D / 2,)``, the padded pairs zero."""
    half = tl.arange(0, BLOCK_D // 2)
    phase = tl.load(plan_ptr + half * col_stride, mask=half < D // 2, other=0.0)
    step = tl.load(plan_ptr + row_stride + half * col_stride, mask=half < D // 2, other=0.0)
    axis = tl.load(plan_ptr + 2 * row_stride + half * col_stride, mask=half < D // 2, other=0.0)
    return phase, step, axis


def _rotation_fn(token, phase, step, axis, plane, width, FAST_TRIG: tl.constexpr):
    """``cos`` and ``sin`` (float32) of each slot's angle ``phase + pos * step`` per channel pair, ``pos`` the slot's
    frame, row or column as the pair's ``axis`` says, computed from its token index (``plane`` = rows x columns,
    ``width`` = columns). The caller broadcasts: ``token`` along one dimension, the plan's rows along the other
    (slots x pairs in the forward, pairs x slots in the backward)."""
    flat = token.to(tl.int32)
    frame = flat // plane
    row = (flat - frame * plane) // width
    col = flat - frame * plane - row * width
    pos = tl.where(axis == 0.0, frame, tl.where(axis == 1.0, row, col)).to(tl.float32)
    # phase + pos * step less whole turns: one rounding (fma); 2 pi split in two, exact turns
    turns = tl.floor((pos * step + phase) * 0.15915494309189535 + 0.5)
    angle = tl.fma(pos, step, turns * -6.28125) + phase - turns * 0.0019353071795864769
    if FAST_TRIG:  # the GPU's fast sine and cosine: absolute error below 2^-20.9 on [-pi, pi]
        cos = tl.inline_asm_elementwise(
            "cos.approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1
        )
        sin = tl.inline_asm_elementwise(
            "sin.approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


def _read_rotation_fn(
    cos_ptr, sin_ptr, token, used, scn, scd, ssn, ssd, D: tl.constexpr, BLOCK_D: tl.constexpr, SLOTS_FIRST: tl.constexpr
):
    """``cos`` and ``sin`` of the slots' tokens read from the tables' even channels ``(N, D/2)``, in the tables'
    dtype (the backward keeps them so until used), as ``(slots, pairs)`` tiles (``SLOTS_FIRST``) or ``(pairs,
    slots)``; unused slots and padded pairs read zero. A power-of-two head dim masks by the slot only (the mask
    constant along a row keeps the loads vectorised)."""
    half = tl.arange(0, BLOCK_D // 2)
    if SLOTS_FIRST:
        tokens, pairs, mask = token[:, None], half[None, :], used[:, None]
        if D != BLOCK_D:
            mask = mask & (half < D // 2)[None, :]
    else:
        tokens, pairs, mask = token[None, :], half[:, None], used[None, :]
        if D != BLOCK_D:
            mask = (half < D // 2)[:, None] & mask
    cos = tl.load(cos_ptr + tokens * scn + pairs * scd, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + tokens * ssn + pairs * ssd, mask=mask, other=0.0)
    return cos, sin


#: The kernels' helpers, by the names the kernels call them: plain functions here; jitted for the compiler below,
#: and swapped back in for the interpreter (:func:`_jitted`).
_HELPERS = {"_plan_rows": _plan_rows_fn, "_rotation": _rotation_fn, "_read_rotation": _read_rotation_fn}


def _summaries_kernel(
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    gather_ptr,
    valid_ptr,
    s_ptr,
    z_ptr,
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
    scn,
    scd,
    ssn,
    ssd,
    rope_plane,
    rope_width,
    s_b,
    s_h,
    s_m,
    s_d,
    s_v,
    z_b,
    z_h,
    z_m,
    z_d,
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
    STORE_Z: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """One block's ``S_m`` (one Dv tile) and ``z_m`` of one (batch, head); see the module docstring."""
    pv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    m = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    chan = tl.arange(0, BLOCK_D)  # channels in natural order
    cols = pv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    acc = tl.full((BLOCK_D, BLOCK_DV), 0.0, tl.float32)
    z_tiles = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)  # summed over the slots after the loop
    if HAS_ROPE and ROPE_ANGLES:  # the angle plan (ops.rope_tables.Rotary), once per program
        phase, step, axis = _plan_rows(cos_ptr, scn, scd, D, BLOCK_D)
    for start in tl.range(0, P, BLOCK_T, num_stages=NUM_STAGES):
        slot = start + tl.arange(0, BLOCK_T)
        used = slot < P
        token = tl.load(gather_ptr + m * P + slot, mask=used, other=0)
        if HAS_VALID:
            used = used & (tl.load(valid_ptr + m * P + slot, mask=used, other=0) != 0)
        if D == BLOCK_D:  # whole rows: the slot's mask only
            k_mask = used[:, None]
        else:
            k_mask = used[:, None] & (chan < D)[None, :]
        keys = tl.load(k_base + token[:, None] * skn + chan[None, :] * skd, mask=k_mask, other=0.0)
        keys = tl.maximum(keys.to(tl.float32), 0.0) + feature_eps  # (BLOCK_T, BLOCK_D); padding: eps, no values
        if STORE_Z:
            z_tiles += tl.where(used[:, None], keys, 0.0)
        if HAS_ROPE:  # channels (2i, 2i+1) rotate by angle i
            if ROPE_ANGLES:
                cos, sin = _rotation(
                    token[:, None], phase[None, :], step[None, :], axis[None, :], rope_plane, rope_width, FAST_TRIG
                )  # the slots' angles from their grid positions
            else:
                cos, sin = _read_rotation(
                    cos_ptr, sin_ptr, token, used, scn, scd, ssn, ssd, D, BLOCK_D, True
                )  # the tables' rows of the slots
                cos = cos.to(tl.float32)
                sin = sin.to(tl.float32)
            k_even, k_odd = tl.split(tl.reshape(keys, (BLOCK_T, BLOCK_D // 2, 2)))
            keys = tl.reshape(tl.join(k_even * cos - k_odd * sin, k_even * sin + k_odd * cos), (BLOCK_T, BLOCK_D))
        if DV == BLOCK_DV:
            v_mask = used[:, None]
        else:
            v_mask = used[:, None] & (cols < DV)[None, :]
        values = tl.load(v_base + token[:, None] * svn + cols[None, :] * svd, mask=v_mask, other=0.0).to(DOT_DTYPE)
        if IEEE:
            acc = tl.dot(tl.trans(keys.to(DOT_DTYPE)), values, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(keys.to(DOT_DTYPE)), values, acc)
    s_base = s_ptr + b * s_b + h * s_h + m * s_m
    s_type = s_ptr.dtype.element_ty  # the summaries' dtype: accumulated in float32, stored rounded to it
    tl.store(
        s_base + chan[:, None] * s_d + cols[None, :] * s_v,
        acc.to(s_type),
        mask=(chan < D)[:, None] & (cols < DV)[None, :],
    )
    if STORE_Z:
        z_type = z_ptr.dtype.element_ty
        z = tl.reduce(z_tiles, 0, _add_combine)
        tl.store(z_ptr + b * z_b + h * z_h + m * z_m + chan * z_d, z.to(z_type), mask=(chan < D) & (pv == 0))


def _output_kernel(
    q_ptr,
    cos_ptr,
    sin_ptr,
    gather_ptr,
    valid_ptr,
    s_ptr,
    z_ptr,
    o_ptr,
    H,
    P,
    sqb,
    sqn,
    sqh,
    sqd,
    sob,
    son,
    soh,
    sod,
    scn,
    scd,
    ssn,
    ssd,
    rope_plane,
    rope_width,
    s_b,
    s_h,
    s_m,
    s_d,
    s_v,
    z_b,
    z_h,
    z_m,
    z_d,
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
    NUM_STAGES: tl.constexpr,
):
    """Block ``m`` of one (batch, head): ``q̂ S̃_m / (phi(q) · z̃_m + eps)`` at the tokens, slot tile by slot
    tile, with ``S̃_m`` and ``z̃_m`` loaded once; the slot loop software-pipelined (``NUM_STAGES``)."""
    bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    chan = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_DV)
    s_base = s_ptr + b * s_b + h * s_h + m * s_m
    summary = tl.load(
        s_base + chan[:, None] * s_d + cols[None, :] * s_v, mask=(chan < D)[:, None] & (cols < DV)[None, :], other=0.0
    )
    summary = summary.to(DOT_DTYPE)  # padded rows and columns: zero
    if NORMALIZE:
        z = tl.load(z_ptr + b * z_b + h * z_h + m * z_m + chan * z_d, mask=chan < D, other=0.0).to(tl.float32)
    q_base = q_ptr + b * sqb + h * sqh
    o_base = o_ptr + b * sob + h * soh
    if HAS_ROPE and ROPE_ANGLES:  # the angle plan (ops.rope_tables.Rotary), once per program
        phase, step, axis = _plan_rows(cos_ptr, scn, scd, D, BLOCK_D)
    for start in tl.range(0, P, BLOCK_T, num_stages=NUM_STAGES):
        slot = start + tl.arange(0, BLOCK_T)
        used = slot < P
        token = tl.load(gather_ptr + m * P + slot, mask=used, other=0)
        if HAS_VALID:
            used = used & (tl.load(valid_ptr + m * P + slot, mask=used, other=0) != 0)
        if D == BLOCK_D:
            q_mask = used[:, None]
        else:
            q_mask = used[:, None] & (chan < D)[None, :]
        queries = tl.load(q_base + token[:, None] * sqn + chan[None, :] * sqd, mask=q_mask, other=0.0)
        queries = tl.maximum(queries.to(tl.float32), 0.0) + feature_eps  # padded channels meet zero rows of S̃, z̃
        if NORMALIZE:  # un-rotated features against the mixed key sum
            den = tl.maximum(tl.reduce(queries * z[None, :], 1, _add_combine), 0.0) + eps  # the guard
        if HAS_ROPE:
            if ROPE_ANGLES:
                cos, sin = _rotation(
                    token[:, None], phase[None, :], step[None, :], axis[None, :], rope_plane, rope_width, FAST_TRIG
                )  # the slots' angles from their grid positions
            else:
                cos, sin = _read_rotation(
                    cos_ptr, sin_ptr, token, used, scn, scd, ssn, ssd, D, BLOCK_D, True
                )  # the tables' rows of the slots
                cos = cos.to(tl.float32)
                sin = sin.to(tl.float32)
            q_even, q_odd = tl.split(tl.reshape(queries, (BLOCK_T, BLOCK_D // 2, 2)))
            queries = tl.reshape(tl.join(q_even * cos - q_odd * sin, q_even * sin + q_odd * cos), (BLOCK_T, BLOCK_D))
        if IEEE:
            out = tl.dot(queries.to(DOT_DTYPE), summary, input_precision="ieee")
        else:
            out = tl.dot(queries.to(DOT_DTYPE), summary)
        if NORMALIZE:
            out = out / den[:, None]
        if DV == BLOCK_DV:
            o_mask = used[:, None]
        else:
            o_mask = used[:, None] & (cols < DV)[None, :]
        tl.store(o_base + token[:, None] * son + cols[None, :] * sod, out.to(o_ptr.dtype.element_ty), mask=o_mask)


_KERNELS: dict[tuple[object, bool], object] = {}


def _jitted(fn, interpret: bool):
    """The kernel function ``fn`` jitted for a GPU, or wrapped for Triton's interpreter (CPU tensors), with the
    plain :data:`_HELPERS` it calls in place of their GPU builds (:func:`_calling_plain_helpers`); cached."""
    key = (fn, interpret)
    if key not in _KERNELS:
        if interpret:
            fn = _calling_plain_helpers(fn)
        # triton.jit makes an interpreted function or a GPU one as TRITON_INTERPRET says when it is called (public
        # API in every Triton this project supports): set it for the one call
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            _KERNELS[key] = triton.jit(fn)
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
    return _KERNELS[key]


def _kernel(name: str, interpret: bool):
    """This module's kernel ``name``, jitted or interpreted (:func:`_jitted`)."""
    return _jitted(globals()[name], interpret)


def _calling_plain_helpers(fn):
    """``fn`` (same code, source and annotations) looking up the :data:`_HELPERS` it calls as their plain functions:
    the interpreter runs a kernel as Python, and a helper built for the compiler refuses to be called from it."""
    helpers = {name: plain for name, plain in _HELPERS.items() if name in fn.__code__.co_names}
    if not helpers:
        return fn
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__annotations__, copy.__doc__ = fn.__annotations__, fn.__doc__
    copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
    return copy


_plan_rows = _jitted(_plan_rows_fn, False) if triton is not None else None
_rotation = _jitted(_rotation_fn, False) if triton is not None else None
_read_rotation = _jitted(_read_rotation_fn, False) if triton is not None else None


# ----------------------------------------------------------------------------- host side


def _pow2(n: int, floor: int = 16) -> int:
    """The next power of two ``>= max(n, floor)`` (``tl.dot`` needs tiles of at least 16)."""
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class _Tiles:
    """Tile sizes, grid extents, warps and pipeline stages of one launch, chosen by :func:`_tiles`: the one
    place the launch and :func:`fused_traffic` take them from. On CUDA the autotuner chooses ``block_t``,
    ``num_warps`` and ``num_stages`` among :data:`_AUTOTUNE` (they move no bytes); the rest is fixed."""

    block_t: int  # slots per tile (both kernels walk a block's slots in tiles of this many)
    block_dh: int  # channel pairs per tile (the even and the odd channels, each block_d / 2)
    block_dv: int  # value columns per summaries program (kernel 1)
    value_tiles: int  # summaries programs per (batch x head, block): kernel 1's grid axis 0
    out_dv: int  # value columns of the output kernel (all of Dv, padded)
    num_warps: int
    num_stages: int = 2  # software-pipeline stages of the slot loops

    @property
    def block_d(self) -> int:
        """Channels per tile: the head dim padded to a power of two (at least 16)."""
        return 2 * self.block_dh


def _tiles(block_len: int, head_dim: int, value_dim: int) -> _Tiles:
    """The tiles :func:`_fused_forward` launches with for blocks of ``block_len`` slots.

    Kernel 1 keeps a float32 accumulator ``(BLOCK_D, BLOCK_DV)`` per program: up to Dv = 128 one value
    tile, so ``k`` is read once (Wan: one 128 x 128 tile, 8 warps); wider values split into tiles of 128,
    each reading ``k`` again. Kernel 2 holds the mixed summary of its block (all of Dv). Slot tiles of 32
    and 8 warps are the interpreter's (and the autotuner's first) choice; see :data:`_AUTOTUNE` for CUDA."""
    block_d = _pow2(head_dim)
    block_dv = min(128, _pow2(value_dim))
    return _Tiles(
        block_t=min(32, _pow2(block_len)),
        block_dh=block_d // 2,
        block_dv=block_dv,
        value_tiles=-(-value_dim // block_dv),
        out_dv=_pow2(value_dim),
        num_warps=8 if block_d * block_dv >= 128 * 64 else 4,
    )


#: The autotuner's choices on CUDA, per kernel: ``(BLOCK_T, num_warps, num_stages)``, those whose accumulator
#: tile fits (:data:`_MAX_TILE`). Each compiles for sm_80, sm_89 and sm_90 without spilling at Wan2.1-1.3B's
#: launch (tests/attention/test_triton_mhla.py).
_AUTOTUNE: dict[str, tuple[tuple[int, int, int], ...]] = {
    "_summaries_kernel": ((32, 8, 1), (32, 8, 2)),
    "_output_kernel": ((32, 8, 2), (64, 8, 2)),
}


def _configs(choices: tuple[tuple[int, int, int], ...]) -> list:
    """``triton.Config`` s of ``(BLOCK_T, num_warps, num_stages)`` choices (:data:`_AUTOTUNE`)."""
    return [
        triton.Config({"BLOCK_T": block_t, "NUM_STAGES": stages}, num_warps=warps, num_stages=stages)
        for block_t, warps, stages in choices
    ]


def _default_dot_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The inputs' half type on CUDA; float32 otherwise (and always under the interpreter, whose
    bfloat16 ``tl.dot`` multiplies raw bit patterns)."""
    dtype = torch.promote_types(q.dtype, v.dtype)
    if q.is_cuda and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.float32


def _tl_dtype(dtype: torch.dtype):
    """Triton's dtype for one of the ``_DOT_DTYPES``."""
    return getattr(tl, _DOT_DTYPES[dtype])


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype of the summaries and RoPE tables for inputs of ``dtypes``: their half type (bf16/fp16),
    else float32."""
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def _tuned(name: str, interpret: bool, tiles: _Tiles) -> tuple[object, dict]:
    """Kernel ``name`` and the launch options it takes beside its arguments: the interpreter's fixed tiles,
    or, on CUDA, none (the autotuner picks ``BLOCK_T``, ``NUM_STAGES``, warps and stages)."""
    if interpret:
        return _kernel(name, True), dict(BLOCK_T=tiles.block_t, NUM_STAGES=tiles.num_stages, num_warps=tiles.num_warps)
    choices = _AUTOTUNE[name]
    width = tiles.block_dv if name == "_summaries_kernel" else tiles.out_dv
    fitting = tuple(c for c in choices if c[0] * width <= _MAX_TILE) or ((16, 8, 2),)
    if (name, fitting) not in _TUNED:  # keyed on the head dims and the block length (and the tensors' dtypes)
        configs = _configs(fitting)
        _TUNED[name, fitting] = triton.autotune(configs=configs, key=["D", "DV", "P"])(_kernel(name, False))
    return _TUNED[name, fitting], {}


_TUNED: dict[tuple[str, tuple], object] = {}

#: The largest float32 accumulator tile (slots x value columns) a config may take: 64 x 128 compiles without
#: spilling at D = 128; wider values (the output kernel holds all of Dv) take fewer slots a tile, at least 16.
_MAX_TILE = 64 * 128


def _launch_summaries(
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    rope: Rotary | None,
    feature_eps: float,
    normalize: str,
    dot_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kernel 1 on validated inputs: the block summaries ``S`` ``(B, H, M, D, Dv)`` (in the compute dtype,
    rows in natural channel order) and key sums ``z`` ``(B, H, M, D)`` (float32; ``None`` without a
    denominator). ``rope``: the even-channel tables of :func:`_rope_tables`, or ``None``. Both outputs may
    be strided views (``S`` of transposed storage; float32 ``z`` a row of it:
    :func:`_summary_buffers`): callers read them by their strides. The backward recomputes the summaries with this."""
    batch, _, heads, d = k.shape
    dv = v.shape[-1]
    m, p = plan.num_blocks, plan.block_len
    norm = normalize == "denominator"
    tiles = _tiles(p, d, dv)
    has_valid = plan.valid is not None
    gather = plan.gather.contiguous()  # (M * P,) int64, already contiguous from block_plan: no copy
    valid = plan.valid.contiguous().view(torch.uint8) if has_valid else gather  # unused pointer when all valid
    tables, rope_numbers, rope_flags = rotary_arguments(rope, k)
    summaries, key_sums = _summary_buffers(batch, heads, m, d, dv, _compute_dtype(k.dtype, v.dtype), norm, k.device)
    sums = key_sums if norm else summaries[..., 0]  # (B, H, M, D); unused pointer without a denominator
    kernel, options = _tuned("_summaries_kernel", k.device.type == "cpu", tiles)
    kernel[(tiles.value_tiles, batch * heads, m)](
        k,
        v,
        *tables,
        gather,
        valid,
        summaries,
        sums,
        heads,
        p,
        *k.stride(),
        *v.stride(),
        *rope_numbers,
        *summaries.stride(),
        *sums.stride(),
        float(feature_eps),
        D=d,
        DV=dv,
        BLOCK_D=tiles.block_d,
        BLOCK_DV=tiles.block_dv,
        HAS_VALID=has_valid,
        HAS_ROPE=rope is not None,
        **rope_flags,
        STORE_Z=norm,
        DOT_DTYPE=_tl_dtype(dot_dtype),
        IEEE=dot_dtype == torch.float32,
        **options,
    )
    return summaries, key_sums


def _launch_output(
    q: torch.Tensor,
    plan: BlockPlan,
    rope: Rotary | None,
    mixed: torch.Tensor,
    mixed_sums: torch.Tensor | None,
    out_dtype: torch.dtype,
    value_dim: int,
    feature_eps: float,
    eps: float,
    dot_dtype: torch.dtype,
) -> torch.Tensor:
    """Kernel 2 on validated inputs: ``(B, N, H, Dv)`` in ``out_dtype`` from the mixed summaries
    ``S̃`` ``(B, H, M, D, Dv)`` and mixed key sums ``z̃`` ``(B, H, M, D)`` (``None``: no denominator), both
    read by their strides."""
    batch, n, heads, d = q.shape
    m, p = plan.num_blocks, plan.block_len
    tiles = _tiles(p, d, value_dim)
    has_valid = plan.valid is not None
    gather = plan.gather.contiguous()
    valid = plan.valid.contiguous().view(torch.uint8) if has_valid else gather
    tables, rope_numbers, rope_flags = rotary_arguments(rope, q)
    sums = mixed[..., 0] if mixed_sums is None else mixed_sums  # unused pointer without a denominator
    out = torch.empty((batch, n, heads, value_dim), device=q.device, dtype=out_dtype)
    kernel, options = _tuned("_output_kernel", q.device.type == "cpu", tiles)
    kernel[(batch * heads, m)](
        q,
        *tables,
        gather,
        valid,
        mixed,
        sums,
        out,
        heads,
        p,
        *q.stride(),
        *out.stride(),
        *rope_numbers,
        *mixed.stride(),
        *sums.stride(),
        float(feature_eps),
        float(eps),
        D=d,
        DV=value_dim,
        BLOCK_D=tiles.block_d,
        BLOCK_DV=tiles.out_dv,
        HAS_VALID=has_valid,
        HAS_ROPE=rope is not None,
        **rope_flags,
        NORMALIZE=mixed_sums is not None,
        DOT_DTYPE=_tl_dtype(dot_dtype),
        IEEE=dot_dtype == torch.float32,
        **options,
    )
    return out


def _fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    mixing: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    feature_eps: float,
    normalize: str,
    eps: float,
    dot_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Launch summaries -> mixing -> output on validated inputs (see
    :func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused`): the output ``(B, N, H, Dv)``, the block
    summaries ``S`` and key sums ``z`` it was computed from (as :func:`_launch_summaries` returns them) and their
    mixing ``S̃``, ``z̃`` (as :func:`_mix` returns them): the fused backward takes all four instead of
    recomputing or mixing again."""
    rope = None if cos is None else rotary_operand(cos, sin, _compute_dtype(q.dtype, k.dtype, v.dtype), plan.grid)
    summaries, key_sums = _launch_summaries(k, v, plan, rope, feature_eps, normalize, dot_dtype)
    mixed, mixed_sums = _mix(mixing, summaries, key_sums)
    out = _launch_output(q, plan, rope, mixed, mixed_sums, v.dtype, v.shape[-1], feature_eps, eps, dot_dtype)
    return out, summaries, key_sums, mixed, mixed_sums


_INDEX_BYTES = 8  # plan.gather, int64
_VALID_BYTES = 1  # plan.valid, read as uint8


def fused_traffic(
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
    rope_converted: bool = True,
    rope_angles: bool = True,
) -> dict[str, int]:
    """Bytes that :func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused` reads and writes in global memory,
    term by term, as :func:`_fused_forward` launches its kernels: what each program's ``tl.load``/``tl.store``
    touches (a masked-off element moves nothing), plus the PyTorch ops between the kernels, counted by
    :func:`~mhla_diffusion.ops.traffic.count_traffic` of the very functions the launch calls on meta tensors.

    Args: the launch's shapes: ``q, k`` ``(batch, tokens, heads, head_dim)``, ``v`` and the output
    ``(.., value_dim)``, all in ``dtype``; a plan of ``num_blocks`` blocks of ``block_len`` slots, with
    ``padded`` slots (``plan.valid`` given: uneven or empty blocks) or not; Diffusers' RoPE tables
    ``(1, tokens, 1, head_dim)`` in ``rope_dtype`` (``None``: no RoPE); ``normalize`` ``"denominator"`` or
    ``"none"``; a float32 ``(heads, M, M)`` mixing with ``per_head_mixing``, else ``(M, M)``;
    ``rope_converted``: whether this call converts the tables to the summaries' dtype. The converted copy is
    cached for the tables of one transformer forward (:func:`_converted_rope_tables`): Wan's first layer
    converts them, its other layers reuse the copy and count nothing for it (``False``); a lone call converts.

    Every token fills exactly one real slot, so the real slots a program walks add up, over the blocks, to
    ``tokens``; padded slots load their plan entries and nothing else. Caches are ignored: a tile that two
    programs load counts twice (the RoPE tables, loaded by the programs of every batch x head; ``k`` by
    every value tile beyond Dv = 128). Do not call it inside a ``count_traffic`` (it runs one itself).
    Returns ``{term: bytes}`` in launch order.
    """
    from .traffic import count_traffic

    norm = normalization_mode(normalize) == "denominator"
    tiles = _tiles(block_len, head_dim, value_dim)
    compute = _compute_dtype(dtype)  # summaries and RoPE tables
    size, compute_size = (torch.empty((), dtype=t).element_size() for t in (dtype, compute))
    bh, m, p = batch * heads, num_blocks, block_len
    pairs = (head_dim + 1) // 2  # channel pairs: the columns of the even-channel RoPE tables
    rope = 0 if rope_dtype is None else 1
    index = p * (_INDEX_BYTES + (_VALID_BYTES if padded else 0))  # plan.gather (and valid) of one block's slots
    meta = dict(device="meta")
    terms: dict[str, int] = {}
    summaries, key_sums = _summary_buffers(batch, heads, m, head_dim, value_dim, compute, norm, torch.device("meta"))
    # PyTorch, once per forward (its first call): the angle plan fitted to the tables and checked against them, or
    # the even channels of the tables in the compute dtype (none when already in it)
    full = torch.empty((1, tokens, 1, head_dim), dtype=rope_dtype or compute, **meta)
    if rope_angles:
        # its reads and writes depend on the tokens, not on how the grid splits them
        fit = count_traffic(lambda: _angle_plan(full, full, (1, 1, tokens))).total if rope and rope_converted else 0
        terms["RoPE angle plan from the tables (PyTorch, once per forward)"] = fit
    else:
        table = full[0, :, 0, 0::2]
        convert = bool(rope) and rope_converted and table.dtype != compute
        terms["RoPE tables to the summaries' dtype (PyTorch, once per forward)"] = (
            convert * count_traffic(lambda: _convert_tables((table, table), compute)).total
        )
    # per program (angles) or per real slot and head (tables)
    rotation = rope * (bh * m * 3 * pairs * 4 if rope_angles else bh * tokens * pairs * 2 * compute_size)
    rope_term = ": RoPE angle plan" if rope_angles else ": RoPE tables"
    # _summaries_kernel, grid (value tiles, B*H, M); per program: plan entries, then per real slot k (D
    # channels), the tables (pairs, cos and sin), v (its tile's columns); then S (D x tile) and z (tile 0)
    terms["summaries kernel: plan index"] = tiles.value_tiles * bh * m * index
    terms["summaries kernel: k"] = tiles.value_tiles * bh * tokens * head_dim * size
    terms["summaries kernel" + rope_term] = tiles.value_tiles * rotation
    terms["summaries kernel: v"] = bh * tokens * value_dim * size
    terms["summaries kernel: S stored"] = bh * m * head_dim * value_dim * compute_size
    sums_size = 0 if key_sums is None else key_sums.element_size()  # float32
    terms["summaries kernel: z stored"] = norm * bh * m * head_dim * sums_size
    # PyTorch: S̃ = W S, z̃ = W z (one product of [Sᵀ; zᵀ] for float32 summaries, two for half ones)
    mixing = torch.empty((heads, m, m) if per_head_mixing else (m, m), dtype=torch.float32, **meta)
    terms["mixing (PyTorch): W S, W z"] = count_traffic(lambda: _mix(mixing, summaries, key_sums)).total
    # _output_kernel, grid (B*H, M); per program: S̃ and z̃ of its block once, then per slot tile the plan
    # entries, and per real slot q (D channels), the tables, the output (Dv columns)
    terms["output kernel: mixed summary"] = bh * m * head_dim * value_dim * compute_size
    terms["output kernel: mixed key sum"] = norm * bh * m * head_dim * sums_size
    terms["output kernel: plan index"] = bh * m * index
    terms["output kernel: q"] = bh * tokens * head_dim * size
    terms["output kernel" + rope_term] = rotation
    terms["output kernel: output stored"] = bh * tokens * value_dim * size
    return terms


_RECORDERS: list[list[dict]] = []


@contextmanager
def recording_launches() -> Iterator[list[dict]]:
    """While active, :func:`fused_available` is true for ``meta`` tensors, and
    :func:`~mhla_diffusion.ops.fused_op.mhla_attention_fused` on meta tensors launches nothing: it returns an empty
    output and appends its :func:`fused_traffic` arguments to the list this yields. With
    :func:`~mhla_diffusion.ops.traffic.count_traffic` of a processor call on meta tensors, this counts what the
    fused path moves outside the kernels (output norm, gate) by dispatch and inside them by
    :func:`fused_traffic`."""
    launches: list[dict] = []
    _RECORDERS.append(launches)
    try:
        yield launches
    finally:
        _RECORDERS.remove(launches)


def _launch_arguments(q, v, plan, mixing, cos, normalize, sin=None) -> dict:
    """:func:`fused_traffic`'s arguments for a launch on these (meta) inputs. With ``sin`` given, the RoPE
    tables go through the same cache as a launch's (:func:`_converted_rope_tables`): a call that finds
    these tables converted by an earlier one (a later layer of the same forward) counts no conversion;
    without it, every call counts one."""
    batch, n, heads, d = q.shape
    converted, angles = True, _grid3(plan.grid) is not None
    if cos is not None and sin is not None:
        operand, converted = _prepared_rotary(cos, sin, _compute_dtype(q.dtype, v.dtype), plan.grid)
        angles = operand.angles
    return dict(
        batch=batch,
        tokens=n,
        heads=heads,
        head_dim=d,
        value_dim=v.shape[-1],
        num_blocks=plan.num_blocks,
        block_len=plan.block_len,
        padded=plan.valid is not None,
        dtype=q.dtype,
        rope_dtype=None if cos is None else cos.dtype,
        normalize=normalize,
        per_head_mixing=mixing.ndim == 3,
        rope_converted=converted,
        rope_angles=angles,
    )


def _eager_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    mixing: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    feature_eps: float,
    normalize: str,
    eps: float,
) -> torch.Tensor:
    """The same function in differentiable eager PyTorch, O(N): the operator with its own feature map and RoPE."""
    return mhla_attention(
        q,
        k,
        v,
        plan.grid,
        plan.layout,
        mixing,
        normalize=normalize,
        eps=eps,
        plan=plan,
        feature_eps=feature_eps,
        rotary=None if cos is None else (cos, sin),
    )
