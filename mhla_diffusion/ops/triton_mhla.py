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

This module is the host side: the switch, the tiles and autotuning, the launches, the traffic count and the
launch recorder; the kernels themselves are :mod:`~mhla_diffusion.ops.triton_kernels`'s.

The public entry is :func:`mhla_diffusion.ops.fused_op.mhla_attention_fused`: the launches here wrapped
as one ``torch.library`` custom op with a fake implementation and an autograd formula whose backward is
the fused Triton backward of :mod:`~mhla_diffusion.ops.triton_mhla_backward`, so ``torch.compile``
keeps them. On CPU tensors the kernels run through Triton's interpreter (slow, for tests);
:func:`fused_available` says when callers should choose this path.
"""

# No `from __future__ import annotations`: the kernels' `tl.constexpr` annotations must be the objects, not
# strings, for Triton 3.0's interpreter (it matches the annotation's name, "constexpr", to find them).

import os
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
from .triton_kernels import _kernel

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
