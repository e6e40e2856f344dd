"""The fused MHLA forward's Triton kernels (the launches, tiles and autotuning that drive them are
:mod:`~mhla_diffusion.ops.triton_mhla`'s host side):

* ``_summaries_kernel``, one program per (Dv tile, batch x head, block): the block's key-value summary
  ``S_m = Σ k̂ vᵀ`` and key sum ``z_m = Σ phi(k)``, with ``phi`` and RoPE applied in registers;
* ``_output_kernel``, one program per (batch x head, block): ``out = q̂ S̃_m`` over ``max(phi(q) · z̃_m, 0) + eps``;
* their helpers (``_plan_rows``, ``_rotation``, ``_read_rotation``: the RoPE angle plan's rows and each slot's
  rotation), and :func:`_kernel` / :func:`_jitted`, which build a kernel for the GPU or for Triton's interpreter.

The backward kernels are :mod:`~mhla_diffusion.ops.triton_mhla_backward`'s.
"""

# No `from __future__ import annotations`: the kernels' `tl.constexpr` annotations must be the objects, not
# strings, for Triton 3.0's interpreter (it matches the annotation's name, "constexpr", to find them).

import os
import types

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = tl = None

__all__: list[str] = []  # private to the fused path: triton_mhla and triton_mhla_backward launch them


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
