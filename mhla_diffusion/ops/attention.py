"""The MHLA operator.

For query token ``t`` in block ``b(t)``:

    out_t = q̂_t · S̃_b(t) / (max(q_t · z̃_b(t), 0) + eps)        (denominator only when ``normalize``)
    S̃_o = Σ_j W[o, j] S_j,   S_j = Σ_{s in block j} k̂_s v_sᵀ     (key-value summary of block j)
    z̃_o = Σ_j W[o, j] z_j,   z_j = Σ_{s in block j} k_s           (key sum of block j)

which equals ``Σ_s W[b(t), b(s)] (q̂_t · k̂_s) v_s`` divided by ``max(Σ_s W[b(t), b(s)] (q_t · k_s), 0) + eps``,
the O(N^2) form kept in :mod:`mhla_diffusion.ops.naive`. Cost is O(N D Dv + M^2 D Dv) per
head and no N x N matrix is ever formed.

The denominator's guard, ``max(·, 0) + eps``: with non-negative features and non-negative mixing (the start
of every conversion) ``q_t · z̃ >= 0`` and the guard changes nothing. The mixing is unconstrained, though, and
fine-tuning can make it signed; then ``q_t · z̃`` can reach 0 or below and a plain ``+ eps`` would divide by
~0 or flip the output's sign. Every path computes the same guarded denominator (this operator, its chunked CPU
path, the joint and causal forms built on it, the reference in :mod:`~mhla_diffusion.ops.naive`, and the fused
Triton forward and backward), and its gradient is zero where the guard holds (``eps`` is a constant there), so
a fine-tune whose mixing turns negative gets finite outputs and gradients everywhere.

A grid with fewer tokens than blocks on some axis leaves *empty* blocks (see
:mod:`mhla_diffusion.ops.block_layout`): their ``S_j`` and ``z_j`` are zero, so they add nothing to any
mixed sum, and they hold no query (their padded slots are dropped, with denominator 1 so that no
``0 / 0`` reaches the gradients).

The released DiT-MHLA (``MHLA4DiT``) divides instead by a mix of per-block *scalars*
(``normalize="scalar_mixed_denominator"``): for the token ``t = (o, w)`` at within-block position
``w`` of block ``o``,

    den(o, w) = max(Σ_j W[o, j] (q_(j,w) · z_j), 0) + eps

where ``q_(j,w)`` is the query of the token at the same position ``w`` in block ``j``. It equals the
paper's denominator only when ``W`` is diagonal, and it needs equal-size blocks (a layout that
divides the grid), so that position ``w`` exists in every block. Extra cost O(N D + M^2 P).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, Sequence

import torch

from ..utils.geometry import check_equal_blocks
from .block_layout import BlockPlan, block_plan, num_blocks, validate_grid_layout
from .block_pairs import pair_form_pays, pair_numerator
from .cpu_memory import retain_freed_memory_on_first_use
from .folded_cpu import _folded_blocks

__all__ = [
    "HALF_DTYPES",
    "LocalPlan",
    "SequenceSplit",
    "check_feature_arguments",
    "mhla_attention",
    "normalization_mode",
    "validate_attention_inputs",
    "without_autocast",
]

_MODES = {
    True: "denominator",
    False: "none",
    "denominator": "denominator",
    "none": "none",
    "scalar_mixed_denominator": "scalar_mixed_denominator",
}


def normalization_mode(normalize: bool | str) -> str:
    """``"denominator"``, ``"none"`` or ``"scalar_mixed_denominator"`` for the operator's ``normalize``
    argument (``True`` / ``False`` mean the first two)."""
    try:
        return _MODES[normalize]
    except (KeyError, TypeError):
        raise ValueError(
            f"`normalize` must be True (paper denominator), False (none) or 'scalar_mixed_denominator' "
            f"(released DiT), or the names 'denominator' / 'none'; got {normalize!r}"
        ) from None


def validate_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor | None,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    plan: BlockPlan | None = None,
    num_tokens: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check the operator's arguments; raise ``ValueError`` naming the first bad one.

    ``mixing=None`` skips the check of the mixing's shape, for callers whose mixing has another form
    (:mod:`~mhla_diffusion.ops.causal`) and who check it themselves.

    With a ``plan`` (built by :func:`~mhla_diffusion.ops.block_layout.block_plan`, which validated its
    grid and layout), grid and layout are only compared with the plan's, not validated again.
    ``num_tokens`` is the grid's token count, default ``N`` of ``q``; the context-parallel operator
    passes the whole sequence's count, since its ``q`` holds only one rank's tokens.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"`{name}` must be a 4-D tensor (B, N, H, D), got {getattr(t, 'shape', type(t))}")
    if k.shape != q.shape:
        raise ValueError(f"`k` shape {tuple(k.shape)} must equal `q` shape {tuple(q.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"`v` shape {tuple(v.shape)} must share (B, N, H) with `q` {tuple(q.shape)}")
    for name, t in (("q_rot", q_rot), ("k_rot", k_rot)):
        if t is not None and t.shape != q.shape:
            raise ValueError(f"`{name}` shape {tuple(t.shape)} must equal `q` shape {tuple(q.shape)}")
    num_tokens = q.shape[1] if num_tokens is None else num_tokens
    if plan is None:
        grid, layout = validate_grid_layout(grid, layout, num_tokens=num_tokens)
    else:
        grid, layout = _check_plan(plan, grid, layout, num_tokens, q.device)
    m, heads = num_blocks(layout), q.shape[2]
    if mixing is None:  # checked by the caller (the causal operator's mixing has its own shape)
        return grid, layout
    if not isinstance(mixing, torch.Tensor) or mixing.shape not in ((m, m), (heads, m, m)):
        raise ValueError(
            f"`mixing` must have shape ({m}, {m}) or per-head ({heads}, {m}, {m}) for layout {layout} "
            f"and {heads} heads, got {tuple(getattr(mixing, 'shape', ()))}"
        )
    return grid, layout


def _check_plan(
    plan: BlockPlan, grid: Sequence[int], layout: Sequence[int], num_tokens: int, device: torch.device
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check that a precomputed ``plan`` is the one for ``grid``, ``layout``, ``N`` and ``device``."""
    if not isinstance(plan, BlockPlan):
        raise ValueError(f"`plan` must be a BlockPlan from block_plan(grid, layout, device), got {type(plan).__name__}")
    try:
        grid, layout = tuple(int(g) for g in grid), tuple(int(b) for b in layout)
    except TypeError:
        return validate_grid_layout(grid, layout, num_tokens=num_tokens)  # raises, naming the bad argument
    if grid != plan.grid or layout != plan.layout:
        raise ValueError(
            f"`plan` was built for grid {plan.grid} and layout {plan.layout}, but the call has grid {grid} and "
            f"layout {layout}: build it with block_plan(grid, layout, device) for this call"
        )
    if math.prod(grid) != num_tokens:
        raise ValueError(
            f"`grid` {grid} has {math.prod(grid)} tokens but the inputs have N={num_tokens}: "
            "the grid's product must equal N"
        )
    if plan.device != device:
        raise ValueError(f"`plan` is on {plan.device} but the inputs are on {device}: build it on the inputs' device")
    return grid, layout


def without_autocast(device: torch.device) -> ContextManager:
    """A context in which ``device``'s autocast is off, so the operator's products run in the dtypes it
    chose (see :func:`mhla_attention`'s Returns) whether or not the caller enabled ``torch.autocast`` (as
    accelerate's bf16 mixed precision does): training and inference then compute alike. Devices
    without autocast (``meta``) get a context that does nothing."""
    if not torch.amp.is_autocast_available(device.type):
        return nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    *,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
    heads_per_chunk: int | None = None,
    plan: BlockPlan | None = None,
    feature_eps: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Multi-head linear attention over token blocks.

    Args:
        q, k: feature-mapped (non-negative) queries and keys, ``(B, N, H, D)``; with ``feature_eps``,
            the raw projections instead (see below).
        v: values, ``(B, N, H, Dv)``.
        grid: token-grid sizes (1 to 3 axes, product ``N``); tokens in row-major order.
        layout: blocks per grid axis; token coordinate ``c`` on an axis of size ``G`` cut into ``L``
            blocks lies in block ``floor(c * L / G)``; blocks are numbered row-major.
        mixing: ``(M, M)`` or per-head ``(H, M, M)``; row ``o`` weighs the key blocks for query block ``o``.
        q_rot, k_rot: rotated features for the numerator (RoPE after the feature map); default ``q``, ``k``.
        normalize: ``True`` (or ``"denominator"``): divide by the paper's mixed denominator
            ``max(q_t · z̃_b(t), 0) + eps``; ``False`` (or ``"none"``): no denominator;
            ``"scalar_mixed_denominator"``: divide the token ``(o, w)`` (position ``w`` of block ``o``)
            by the released DiT's ``max(Σ_j W[o, j] (q_(j,w) · z_j), 0) + eps``, computed as the ``(B, H, M, P)``
            scalars ``q_(j,w) · z_j`` mixed over ``j`` by ``W``; it needs a layout that divides
            ``grid`` (equal-size blocks) and raises ``ValueError`` naming grid, layout and a fix
            otherwise. Denominators use the un-rotated ``q``, ``k``.
        eps: added to the denominator.
        heads_per_chunk: process this many heads at a time to bound the working memory (default: all).
        plan: the :class:`~mhla_diffusion.ops.block_layout.BlockPlan` of ``grid`` and ``layout`` on the
            inputs' device, built once and reused across calls (the MHLA processors get one per
            transformer forward from their grid context); default: built here. A plan for another
            grid, layout or device raises ``ValueError``. The result does not depend on it.
        feature_eps: when given, ``q`` and ``k`` are the raw projections and the operator applies the
            feature map ``φ(x) = ReLU(x) + feature_eps`` itself, in the inputs' dtype and in the same
            passes that regroup the tokens into blocks (the MHLA processors' path; it moves about a
            quarter of the bytes of mapping, rotating and regrouping separately). The result equals the
            operator on ``φ(q)``, ``φ(k)``.
        rotary: with ``feature_eps``, Wan's RoPE tables ``(cos, sin)``, each ``(1, N, 1, D)`` (channel
            pairs ``(2i, 2i+1)`` rotate by angle ``i``; see
            :func:`~mhla_diffusion.models.processors.base.apply_interleaved_rotary`), applied after the feature
            map on the numerator path: the same as ``q_rot = RoPE(φ(q))``, ``k_rot = RoPE(φ(k))``.

    ``layout`` may have more blocks than ``grid`` has tokens on an axis: the blocks that receive no
    token are empty (zero key-value summary and key sum, no query), as in the reference.

    On a CPU, the first call in a process makes glibc keep freed memory for reuse (logged; see
    :mod:`mhla_diffusion.ops.cpu_memory`, ``MHLA_KEEP_MALLOC=1`` opts out): otherwise every large
    temporary of a call at video length is page-faulted in again, which costs more than the arithmetic.
    With more than one torch thread, the CPU path runs its chunk loops on worker threads of the library, one
    per torch thread, each running single-threaded ops (:mod:`mhla_diffusion.ops.cpu_workers`;
    ``MHLA_CPU_WORKERS=0`` opts out): per-op threading made MHLA's speed depend on whether the threads'
    cores share a cache.

    Returns:
        ``(B, N, H, Dv)`` in ``v``'s dtype. Float32 and float64 inputs are computed in their dtype;
        bf16/fp16 inputs are multiplied in their dtype with float32 accumulation inside every product
        (as half-precision GEMMs do): the key-value summaries and their mixing are stored in the
        inputs' dtype, key sums and denominators in float32. The same holds inside
        ``torch.autocast``: the operator's products never take autocast's dtype.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, mixing, q_rot, k_rot, plan)
    normalize = normalization_mode(normalize)
    check_feature_arguments(q, q_rot, k_rot, feature_eps, rotary)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        retain_freed_memory_on_first_use()  # once per process, logged; MHLA_KEEP_MALLOC=1 opts out (cpu_memory)
    if heads_per_chunk is not None and heads_per_chunk < 1:
        raise ValueError(f"`heads_per_chunk` must be >= 1, got {heads_per_chunk}")
    if plan is None:
        plan = block_plan(grid, layout, device=q.device)
    if normalize == "scalar_mixed_denominator" and plan.valid is not None:  # the plan knows if blocks are uneven
        check_equal_blocks(grid, layout)
    heads = q.shape[2]
    options = dict(normalize=normalize, eps=eps, feature_eps=feature_eps, rotary=rotary)
    with without_autocast(q.device):
        if heads_per_chunk is None or heads_per_chunk >= heads:
            return _mhla_blocks(q, k, v, plan, mixing, q_rot, k_rot, **options)
        out = v.new_empty(v.shape)
        for start in range(0, heads, heads_per_chunk):
            h = slice(start, start + heads_per_chunk)
            chunk = lambda x: None if x is None else x[:, :, h]  # noqa: E731
            out[:, :, h] = _mhla_blocks(
                q[:, :, h],
                k[:, :, h],
                v[:, :, h],
                plan,
                mixing if mixing.ndim == 2 else mixing[h],
                chunk(q_rot),
                chunk(k_rot),
                **options,
            )
        return out


def check_feature_arguments(
    q: torch.Tensor,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    feature_eps: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Raise ``ValueError`` when the operator's feature-map arguments (see :func:`mhla_attention`) conflict."""
    if feature_eps is None and rotary is not None:
        raise ValueError(
            "`rotary` applies after the operator's own feature map: pass `feature_eps` with it "
            "(or rotate feature-mapped inputs yourself and pass `q_rot` / `k_rot`)"
        )
    if feature_eps is not None and (q_rot is not None or k_rot is not None):
        raise ValueError(
            "with `feature_eps` the operator rotates the features itself: pass `rotary=(cos, sin)` "
            "instead of `q_rot` / `k_rot`"
        )
    if rotary is not None:
        _check_rotary(rotary, q)


def _check_rotary(rotary: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor) -> None:
    if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
        raise ValueError("`rotary` must be the pair (cos, sin) of RoPE tables")
    want = (1, q.shape[1], 1, q.shape[3])
    for name, table in zip(("cos", "sin"), rotary):
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != want:
            raise ValueError(
                f"`rotary` {name} must have shape {want} (1, N, 1, D), got {tuple(getattr(table, 'shape', ()))}"
            )
    if q.shape[3] % 2:
        raise ValueError(f"RoPE rotates channel pairs: the head dim must be even, got {q.shape[3]}")


def _mhla_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    mixing: torch.Tensor,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    *,
    normalize: str,
    eps: float,
    feature_eps: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    split: "SequenceSplit | None" = None,
) -> torch.Tensor:
    """The operator on validated inputs (see :func:`mhla_attention`); ``normalize`` is a mode name.

    With a ``split`` (context parallelism), ``q, k, v`` hold this process's tokens of the sequence and the
    result is theirs: the keys' partial summaries are completed across processes by the split's hook.

    Two steps: :class:`_Blocks` regroups the inputs into block-major ``(B, H, M, P, d)`` tensors (applying
    the feature map and RoPE on the way when asked), then :class:`_Summaries` (key-value summaries and key
    sums, mixed) and :func:`_block_output` (queries against them) do the block math once for both kinds of
    input.
    """
    dtype = torch.promote_types(q.dtype, v.dtype)
    # Without autograd the temporaries can be written in place, which saves memory and passes.
    inplace = not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, q_rot, k_rot, mixing))
    )
    blocks = _Blocks(plan if split is None else split.plan, dtype, inplace)
    den = normalize != "none"
    tables = None if feature_eps is None or rotary is None else blocks.rotary_tables(rotary, feature_eps)
    # with RoPE the feature map's shift is folded into the rotation and the sums: φ itself is never stored
    shift = 0.0 if tables is None else float(feature_eps)
    m, p = blocks.plan.num_blocks, blocks.plan.block_len
    paired = split is None and pair_form_pays(q.shape[0] * q.shape[2], (m, p), (m, p), q.shape[-1], v.shape[-1])
    # One feature tensor per side (no rotation) and the paper's denominator: the key sum rides along as one
    # more value channel (see _folded_blocks). Half inputs keep their float32 key sums apart. Uneven grids
    # take it on a CPU only: its per-chunk index lists are built on the host (a sync on accelerators).
    if (
        normalize == "denominator"
        and tables is None
        and q_rot is None
        and k_rot is None
        and split is None
        and not paired
        and blocks.write_views
        and (blocks.even or q.device.type == "cpu")
        and dtype not in HALF_DTYPES
    ):
        return _folded_blocks(q, k, v, blocks, mixing, eps, feature_eps)

    def features(x: torch.Tensor, x_rot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return blocks.features(x, x_rot, feature_eps, tables, den)

    # keys and values first; each step makes its block copies itself and frees them before the next step
    summaries = _Summaries.of(
        blocks,
        lambda: features(k, k_rot),
        lambda: blocks.gather(v, zero_padding=True),
        mixing,
        shift,
        split,
        paired,
    )
    return _block_output(blocks, summaries, lambda: features(q, q_rot), normalize, eps, shift, v.dtype)


#: The half-precision floating dtypes (16-bit).
HALF_DTYPES = (torch.float16, torch.bfloat16)


class _Blocks:
    """Regroups token-order ``(B, N, H, d)`` tensors into block-major ``(B, H, M, P, d)`` ones (block ``m``'s
    padded slot ``p`` at ``[:, :, m, p]``), in ``dtype``, applying the feature map and RoPE on the way.

    On a grid that the layout divides (``plan.valid is None``) the block-major order is a strided view of the
    token order, so regrouping is one copy and, without autograd, the first elementwise op writes its
    result straight in block order; otherwise it is one gather along ``plan.gather``.
    """

    def __init__(self, plan: "BlockPlan | LocalPlan", dtype: torch.dtype, inplace: bool) -> None:
        self.plan, self.dtype, self.inplace = plan, dtype, inplace
        self.even = isinstance(plan, BlockPlan) and plan.valid is None
        # Writing results through `out=` views saves passes in eager mode; under torch.compile Inductor fuses
        # the passes itself, and Dynamo does not trace `out=` into non-contiguous views.
        self.write_views = inplace and not torch.compiler.is_compiling()
        # ... and on an even grid also into the strided block view of token order
        self.write_through = self.write_views and self.even
        if self.even:
            self.pads = tuple(g // b for g, b in zip(plan.grid, plan.layout))

    def block_view(self, x: torch.Tensor) -> torch.Tensor:
        """Even grids: ``x`` ``(B, N, H, d)`` seen as ``(B, H, L_1, .., L_a, P_1, .., P_a, d)`` without a copy."""
        return self.heads_last_view(x).movedim(-2, 1)

    def heads_last_view(self, x: torch.Tensor) -> torch.Tensor:
        """Even grids: ``x`` ``(B, N, H, d)`` seen as ``(B, L_1, .., L_a, P_1, .., P_a, H, d)`` without a copy
        (block ``(L_1, .., L_a)``, its token ``(P_1, .., P_a)``), each token's heads kept together."""
        axes = len(self.pads)
        split = [size for pair in zip(self.plan.layout, self.pads) for size in pair]
        y = x.view(x.shape[0], *split, x.shape[2], x.shape[3])
        return y.permute([0, *range(1, 2 * axes, 2), *range(2, 2 * axes + 1, 2), 2 * axes + 1, 2 * axes + 2])

    def _shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (x.shape[0], x.shape[2], self.plan.num_blocks, self.plan.block_len, x.shape[3])

    def gather(self, x: torch.Tensor, zero_padding: bool = False) -> torch.Tensor:
        """``x`` in block-major order, a new contiguous tensor; padded slots zeroed with ``zero_padding``."""
        if self.even:  # one pass: read through the strided view, write block-major in `dtype`
            view = self.block_view(x)
            return torch.empty(view.shape, dtype=self.dtype, device=x.device).copy_(view).view(self._shape(x))
        xb = x.transpose(1, 2).index_select(2, self.plan.gather).view(self._shape(x)).to(self.dtype)
        if zero_padding and self.plan.valid is not None:
            mask = self.plan.valid[:, :, None].to(self.dtype)
            xb = xb.mul_(mask) if self.inplace else xb * mask
        return xb

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        """``ReLU(x)`` in block-major order (padded slots hold copies of real tokens' values)."""
        if self.write_through:  # ReLU writes block-major directly: one pass instead of two
            view = self.block_view(x)
            out = torch.empty(view.shape, dtype=self.dtype, device=x.device)
            return torch.clamp_min(view, 0, out=out).view(self._shape(x))
        xb = self.gather(x)
        return xb.relu_() if self.inplace else xb.relu()

    def rotary_tables(self, rotary: tuple[torch.Tensor, torch.Tensor], feature_eps: float) -> tuple[torch.Tensor, ...]:
        """Wan's RoPE tables ``(1, N, 1, D)`` as block-major ``(1, 1, M, P, D/2)`` ``cos`` and ``sin`` (each
        angle once), and the rotated feature-map shift ``feature_eps * RoPE(1)`` (even, odd channels)."""
        cos, sin = (self.gather(table[..., 0::2]) for table in rotary)
        return cos, sin, feature_eps * (cos - sin), feature_eps * (sin + cos)

    def features(
        self,
        x: torch.Tensor,
        x_rot: torch.Tensor | None,
        feature_eps: float | None,
        tables: tuple[torch.Tensor, ...] | None,
        den: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block-major (numerator features, denominator features or None without ``den``) of one of q, k.

        Without ``feature_eps``, ``x`` (and ``x_rot``) are features already; with it, ``x`` is the raw projection,
        mapped to ``ReLU(x) + feature_eps`` and, with RoPE ``tables`` (:meth:`rotary_tables`), rotated for the
        numerator; the denominator then gets ``ReLU(x)``, its shift ``feature_eps`` being added to the sums."""
        if feature_eps is None:
            num = self.gather(x if x_rot is None else x_rot)
            return num, ((num if x_rot is None else self.gather(x)) if den else None)
        relu_x = self.relu(x)
        if tables is None:  # φ(x) = ReLU(x) + feature_eps serves numerator and denominator alike
            phi = relu_x.add_(feature_eps) if self.inplace else relu_x + feature_eps
            return phi, (phi if den else None)
        return self.rotate(relu_x, tables), (relu_x if den else None)

    def rotate(self, relu_x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``RoPE(ReLU(x) + feature_eps)`` from block-major ``relu_x`` and :meth:`rotary_tables`: channel pairs
        ``(2i, 2i+1)`` rotate by the token's angle ``i``; the rotated shift is added in the same passes."""
        cos, sin, shift_even, shift_odd = tables
        even, odd = relu_x[..., 0::2], relu_x[..., 1::2]
        if not self.write_views:
            return torch.stack(
                (
                    torch.addcmul(shift_even, even, cos).addcmul(odd, sin, value=-1),
                    torch.addcmul(shift_odd, odd, cos).addcmul(even, sin),
                ),
                dim=-1,
            ).flatten(-2)
        out = torch.empty_like(relu_x)
        out_even, out_odd = out[..., 0::2], out[..., 1::2]
        torch.addcmul(shift_even, even, cos, out=out_even).addcmul_(odd, sin, value=-1)
        torch.addcmul(shift_odd, odd, cos, out=out_odd).addcmul_(even, sin)
        return out

    def key_sum(self, k_den: torch.Tensor, shift: float) -> torch.Tensor:
        """``z_j = Σ_{s in block j} (k_den_s + shift)`` over real tokens: ``(B, H, M, D)`` in at least float32."""
        compute = torch.promote_types(k_den.dtype, torch.float32)
        if self.plan.valid is None:  # no padded slot
            return k_den.sum(dim=3, dtype=compute) + shift * self.plan.block_len
        valid = self.plan.valid.to(k_den.dtype)  # (M, P)
        rows = valid[:, None, :].expand(*k_den.shape[:2], -1, -1, -1)  # (B, H, M, 1, P), small
        counts = self.plan.valid.sum(-1).to(compute)[:, None]  # real tokens per block
        return _matmul(rows, k_den).squeeze(-2) + shift * counts

    def scatter(self, out: torch.Tensor, denominator: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Block-major ``out`` ``(B, H, M, P, Dv)`` divided by ``denominator`` ``(B, H, M, P, 1)`` (if any), back
        in token order ``(B, N, H, Dv)`` and ``dtype``; padded slots dropped."""
        batch, heads, m, p, dv = out.shape
        if self.write_through:  # divide straight into token order: one pass for both
            result = torch.empty((batch, m * p, heads, dv), dtype=dtype, device=out.device)
            target = self.block_view(result)
            source = out.view(target.shape)
            if denominator is None:
                target.copy_(source)
            else:
                torch.div(source, denominator.view(*target.shape[:-1], 1), out=target)
            return result
        if denominator is not None:
            out = out.div_(denominator) if self.inplace else out / denominator
        return out.view(batch, heads, m * p, dv).transpose(1, 2).index_select(1, self.plan.scatter).to(dtype)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over equal leading dims, accumulated and returned in at least float32. A half ``a`` (the large,
    N-sized operand) stays half where a kernel accumulates half operands in float32 (CUDA's ``bmm`` with
    ``out_dtype``; also on ``meta``, where the traffic is counted), with the small ``b`` rounded to its dtype;
    elsewhere, and under autograd, both are upcast first."""
    compute = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    if (
        a.dtype in HALF_DTYPES
        and a.device.type in ("cuda", "meta")
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    ):
        lead = a.shape[:-2]
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.to(a.dtype).reshape(-1, *b.shape[-2:]), out_dtype=compute)
        return out.view(*lead, *out.shape[-2:])
    return a.to(compute) @ b.to(compute)


class LocalPlan(Protocol):
    """What :class:`_Blocks` needs of a block plan: a :class:`BlockPlan`, or the context-parallel
    :class:`~mhla_diffusion.ops.context_parallel.LocalBlockPlan` of one process's tokens."""

    num_blocks: int
    block_len: int
    gather: torch.Tensor
    scatter: torch.Tensor
    valid: torch.Tensor | None


class SequenceSplit(Protocol):
    """The context-parallel hook of the block math (:mod:`mhla_diffusion.ops.context_parallel`):
    this process holds some tokens of the sequence, regrouped by ``plan`` into its ``(M_l, P_l)`` local
    blocks, which are the global blocks ``blocks`` ``(M_l,)``; the partial sums of its keys are completed
    across processes."""

    plan: LocalPlan
    blocks: torch.Tensor
    slot_positions: torch.Tensor  # (M_l, P_l): each local slot's within-block position w in the whole grid

    def complete(
        self, kv_summary: torch.Tensor, key_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Local blocks' partial ``S_j`` ``(B, H, M_l, D, Dv)`` and ``z_j`` -> every block's full ones."""

    def complete_scalars(self, scalars: torch.Tensor) -> torch.Tensor:
        """Local slots' ``q_(j,w) · z_j`` ``(B, H, M_l, P_l)`` -> every block's and position's ``(B, H, M, P)``."""


def block_sums(
    blocks: _Blocks,
    key_features: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
    values: Callable[[], torch.Tensor],
    shift: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every block's key-value summary ``S_j`` ``(B, H, M, D, Dv)`` and key sum ``z_j`` ``(B, H, M, D)`` (``None``
    without denominator features), unmixed.

    ``key_features()``: block-major (numerator's rotated key features, denominator's or None), ``shift`` to be
    added to the latter; ``values()``: block-major values with zeroed padded slots.
    """
    k_num, k_den = key_features()
    # S_j: (B, H, M, D, Dv). Products of half inputs accumulate in float32 inside the GEMM and are stored
    # in the inputs' dtype, as S̃ must meet the half queries in it anyway: the summaries cost no casts.
    kv_summary = k_num.transpose(-1, -2) @ values()
    del k_num
    key_sum = None if k_den is None else blocks.key_sum(k_den, shift)
    return kv_summary, key_sum


@dataclass
class _Summaries:
    """What the keys and values of every block leave for the query blocks (block-major, ``(B, H, M, ...)``)."""

    weights: torch.Tensor  # the rows of the mixing W for the query blocks, as (B * H, M_q, M)
    key_sum: torch.Tensor | None = None  # z_j, (B, H, M, D) in at least float32; None without a denominator
    split: SequenceSplit | None = None
    mixed: torch.Tensor | None = None  # S̃_o = Σ_j W[o, j] S_j for the query blocks, (B, H, M_q, D, Dv)
    # or, in the pair form (:mod:`.block_pairs`), the block-major key features and values themselves
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        blocks: _Blocks,
        key_features: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
        values: Callable[[], torch.Tensor],
        mixing: torch.Tensor,
        shift: float,
        split: SequenceSplit | None = None,
        paired: bool = False,
    ) -> "_Summaries":
        """``key_features()``: block-major (numerator's rotated key features, denominator's or None), ``shift``
        to be added to the latter; ``values()``: block-major values with zeroed padded slots. ``paired``: keep
        the keys and values for the pair form instead of mixing summaries (:mod:`.block_pairs`; not with a
        ``split``)."""
        if paired:
            k_num, k_den = key_features()
            key_sum = None if k_den is None else blocks.key_sum(k_den, shift)
            vals = values()
            batch, heads, m = vals.shape[:3]
            weights = mixing.expand(batch, heads, -1, m).reshape(batch * heads, -1, m)
            return cls(weights, key_sum, pairs=(k_num, vals))
        kv_summary, key_sum = block_sums(blocks, key_features, values, shift)
        batch, heads = kv_summary.shape[:2]
        rows = mixing
        if split is not None:  # every block's sums from every process; the local query blocks' rows of W
            kv_summary, key_sum = split.complete(kv_summary, key_sum)
            rows = mixing.index_select(-2, split.blocks)
        m_q, m = rows.shape[-2:]
        summaries = cls(rows.expand(batch, heads, m_q, m).reshape(batch * heads, m_q, m), key_sum, split)
        summaries.mixed = summaries.mix(kv_summary)
        return summaries

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """``Σ_j W[o, j] x_j`` for every query block ``o``, ``x`` ``(B, H, M, ...)`` -> ``(B, H, M_q, ...)``:
        one bmm, no copy of ``x``."""
        batch, heads, m = x.shape[:3]
        out = torch.bmm(self.weights.to(x.dtype), x.reshape(batch * heads, m, -1))
        return out.view(batch, heads, -1, *x.shape[3:])


def _block_output(
    blocks: _Blocks,
    summaries: _Summaries,
    query_features: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
    normalize: str,
    eps: float,
    shift: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Every query block against its mixed summary, divided by its denominator, back in token order.

    ``query_features()``: block-major (numerator's rotated query features ``(B, H, M, P, D)``, denominator's
    or None), ``shift`` to be added to the latter (the feature map's ``eps`` when they are ``ReLU(q)``, else
    0). Returns ``(B, N, H, Dv)`` in ``out_dtype``.
    """
    q_num, q_den = query_features()
    if summaries.pairs is not None:
        out = pair_numerator(q_num, *summaries.pairs, summaries.weights)  # (B, H, M, P, Dv)
    else:
        out = q_num @ summaries.mixed  # (B, H, M, P, Dv)
    del q_num
    summaries.mixed = summaries.pairs = None  # freed before the denominator and the way back to token order
    denominator = None
    key_sum = summaries.key_sum
    if normalize == "denominator":
        mixed_sum = summaries.mix(key_sum)  # z̃_o: (B, H, M, D)
        denominator = _matmul(q_den, mixed_sum.unsqueeze(-1))  # q_(o,w) · z̃_o: (B, H, M, P, 1)
        denominator = (denominator + (shift * mixed_sum.sum(-1))[..., None, None]).clamp_min(0) + eps
    elif normalize == "scalar_mixed_denominator":  # equal blocks: slot p of every block is the same position w
        split = summaries.split
        own = key_sum if split is None else key_sum.index_select(2, split.blocks)  # z of the query blocks
        scalars = _matmul(q_den, own.unsqueeze(-1)).squeeze(-1)  # q_(j,w) · z_j: (B, H, M_q, P_q)
        scalars = scalars + shift * own.sum(-1, keepdim=True)
        if split is not None:  # every position of every block, from the processes that hold them
            scalars = split.complete_scalars(scalars)
        mixed = summaries.mix(scalars)  # Σ_j W[o, j] q_(j,w) · z_j: (B, H, M_q, P)
        if split is not None:  # each local slot reads its own position w
            mixed = mixed.gather(3, split.slot_positions.expand(*mixed.shape[:2], -1, -1))
        denominator = (mixed.clamp_min(0) + eps).unsqueeze(-1)
    del q_den
    if denominator is not None and blocks.plan.valid is not None:  # padded slots are dropped: divide them by 1
        denominator = denominator.masked_fill(~blocks.plan.valid[:, :, None], 1.0)
    return blocks.scatter(out, denominator, out_dtype)
