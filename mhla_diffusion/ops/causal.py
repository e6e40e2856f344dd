"""Block-causal MHLA: attention that runs forwards in time, so video can be generated chunk by chunk.

The first grid axis is time. A layout ``(R, L_1, .., L_a)`` cuts the grid into ``R`` *temporal block rows* of
``S = L_1 * .. * L_a`` blocks each; blocks are numbered row-major (as in
:mod:`~mhla_diffusion.ops.block_layout`), so block ``m`` is spatial place ``s = m % S`` of row ``r = m // S``.

Visibility and mixing. Query block ``(r, s)`` mixes key block ``(r', s')`` only when ``r' <= r`` (every block of
its own row and of earlier rows), with a weight that depends on the temporal offset ``Δ = r - r'`` and on the
two spatial places alone::

    W[(r, s), (r', s')] = A_Δ[s, s']                          for Δ = 0 .. K
                        = γ^(Δ - K - 1) A_fold[s, s']          for Δ > K
                        = 0                                    for Δ < 0

``mixing`` holds ``A_0 .. A_K, A_fold`` as one ``(K + 2, S, S)`` tensor (or ``(H, K + 2, S, S)``, one per head);
``K`` is the *window*. ``decay`` is ``γ`` (``None``: ``γ = 1``, the older rows are summed). With ``mean_fold`` the
older rows are averaged instead: ``W = A_fold[s, s'] / (r - K)`` for ``Δ > K``, ``r - K`` being how many rows a
query of row ``r`` folds, so the fold keeps its scale however long the video grows (a sum grows with it). The output
is the present operator's (:mod:`~mhla_diffusion.ops.attention`) with this ``W`` as its mixing::

    out_t = q̂_t · S̃_b(t) / (max(q_t · z̃_b(t), 0) + eps),   S̃_o = Σ_j W[o, j] S_j,   z̃_o = Σ_j W[o, j] z_j

Since ``W`` is the same for a video of any length, every row older than the window reaches a query through one
*folded* summary per spatial place, ``F_r[s'] = Σ_{r' <= r-K-1} γ^(r-K-1-r') S_(r', s')``, which obeys
``F_(r+1) = γ F_r + S_(r-K)``. The streaming state (:class:`CausalMHLAState`) is therefore ``K + 1`` rows of
per-block summaries and key sums -- the fold and the ``K`` most recent rows -- whatever the length. The sum and
mean folds (``γ = 1``) keep the fold *per folded row* (``F / c``, ``c = rows - K`` folded rows) and scale it back
by ``c`` when they mix it (the mean fold then divides by ``r - K``): a sum grows with the stream and stops absorbing
new rows once it is large in a narrow dtype, its mean does not.

Two ways to run it, equal to each other:

* :func:`mhla_causal_attention`: one pass over a whole clip (training). It builds the ``(M, M)`` block-causal
  matrix ``W`` (:func:`causal_mixing_matrix`) and runs the present operator with it, so it shares every path of
  :func:`~mhla_diffusion.ops.attention.mhla_attention` (feature map, RoPE, uneven and empty blocks, half
  precision) and its cost.
* :func:`mhla_causal_step`: one *chunk* -- whole temporal block rows -- given the state carried from the chunks
  before it; returns the chunk's output and, with ``advance=True``, the new state. Nothing is changed in place, so
  a pipeline can denoise a chunk many times against the same state (``advance=False``: the carried rows are mixed
  where they lie, no new state is built) and advance the state once, with the finished chunk.

A chunk's rows are cut by the floor rule of the chunk's own grid. Running chunk by chunk equals one pass when
they are the rows the whole clip's layout cuts, which holds whenever every row has the same number of frames (a
chunk of ``c`` rows then has ``c`` times that many frames): the streaming case.

The released DiT denominator (``scalar_mixed_denominator``) is not available here: it needs the queries of every
key block, which a stream no longer has.

The O(N^2) definition of all this is :func:`~mhla_diffusion.ops.naive.mhla_causal_attention_reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from ..utils.choices import CAUSAL_FOLDS
from .attention import (
    _block_output,
    _Summaries,
    block_sums,
    check_feature_arguments,
    mhla_attention,
    normalization_mode,
    validate_attention_inputs,
    without_autocast,
)
from .block_layout import BlockPlan, block_plan
from .block_pairs import pair_form_pays
from .causal_chunk import _block_features, causal_chunk_output, needs_grad
from .mixing import mixing_init

__all__ = [
    "CAUSAL_FOLDS",
    "CausalMHLAState",
    "causal_mixing_init",
    "causal_mixing_matrix",
    "check_causal_arguments",
    "mhla_causal_attention",
    "mhla_causal_step",
]


def causal_mixing_init(
    spatial_layout: Sequence[int],
    window: int,
    transform: str = "linear",
    *,
    normalization: Literal["column", "row"] = "column",
    exp_sigma: float = 3.0,
    local_threshold: float = 1.5,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Initial causal mixing, shape ``(window + 2, S, S)``: ``[Δ]`` for the offsets ``Δ = 0 .. window``, then the fold.

    The weights favour near blocks as :func:`~mhla_diffusion.ops.mixing.mixing_init` does: they are its weights on
    the layout ``(window + 2, *spatial_layout)`` seen from a block of the last row, so ``A_Δ[s, s']`` decreases
    with the distance ``sqrt(Δ^2 + d(s, s')^2)`` in block units, and the fold is weighted as the row just past
    the window (``Δ = window + 1``). ``spatial_layout`` is the layout without its first (time) axis; ``()`` for
    a grid that has only a time axis (``S = 1``). Other arguments as for ``mixing_init``.
    """
    window = _check_window(window)
    spatial = tuple(int(b) for b in spatial_layout)
    full = mixing_init(
        (window + 2, *spatial),
        transform,
        normalization=normalization,
        exp_sigma=exp_sigma,
        local_threshold=local_threshold,
        dtype=dtype,
    )
    s = math.prod(spatial)
    # the last row's query blocks against key row j = window + 1 - Δ, reordered by Δ
    return full[-s:].view(s, window + 2, s).flip(1).transpose(0, 1).contiguous()


def causal_mixing_matrix(
    mixing: torch.Tensor, rows: int, decay: torch.Tensor | float | None = None, *, mean_fold: bool = False
) -> torch.Tensor:
    """The block-causal ``(M, M)`` mixing ``W`` of ``rows`` temporal block rows (``M = rows * S``) from the causal
    ``mixing`` ``(K + 2, S, S)``; ``(H, M, M)`` when ``mixing`` is per head ``(H, K + 2, S, S)`` or ``decay`` is
    ``(H,)``. Row ``o`` holds query block ``o``'s weights (see the module docstring); differentiable in both.
    ``mean_fold``: the rows older than the window are averaged (``decay`` must be ``None``)."""
    if mixing.ndim not in (3, 4):
        raise ValueError(f"`mixing` must be (K + 2, S, S) or per-head (H, K + 2, S, S), got {tuple(mixing.shape)}")
    r = torch.arange(int(rows), device=mixing.device)
    return _row_weights(mixing, decay, r[:, None] - r[None, :], r if mean_fold else None)


def _row_weights(
    mixing: torch.Tensor,
    decay: torch.Tensor | float | None,
    deltas: torch.Tensor,
    mean_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block weights of query rows against key rows with temporal offsets ``deltas`` ``(R_q, R_k)`` (negative: not
    visible): ``(..., R_q * S, R_k * S)``, ``...`` the heads of ``mixing`` or ``decay`` if any. ``mean_rows``
    ``(R_q,)``: the query rows' absolute indices, for the mean fold (each folded row weighs ``1 / (r - K)``)."""
    window = mixing.shape[-3] - 2
    s = mixing.shape[-1]
    blocks = mixing[..., deltas.clamp(0, window + 1), :, :]  # (..., R_q, R_k, S, S)
    visible = deltas >= 0
    if decay is None:
        factor = visible.to(mixing.dtype)
    else:
        gamma = torch.as_tensor(decay, dtype=mixing.dtype, device=mixing.device)
        exponent = (deltas - window - 1).clamp(min=0).to(mixing.dtype)
        factor = torch.where(visible, gamma[..., None, None] ** exponent, 0.0)  # (..., R_q, R_k)
    if mean_rows is not None:  # a query of row r folds the r - K rows before its window (none before row K + 1)
        folded = (mean_rows - window).clamp(min=1).to(mixing.dtype)[:, None]
        factor = torch.where(deltas > window, factor / folded, factor)
    blocks = blocks * factor[..., None, None]
    rows_q, rows_k = deltas.shape
    return blocks.transpose(-3, -2).reshape(*blocks.shape[:-4], rows_q * s, rows_k * s)


@dataclass
class CausalMHLAState:
    """What a stream of block-causal MHLA carries from one chunk to the next; the same size for any length.

    Attributes:
        fold: ``(B, H, 1, S, D, Dv)``: the fold of every temporal block row older than the window, per spatial
            block. A decaying fold is ``F`` itself; the sum and mean folds keep ``F / c`` (``c`` =
            :attr:`folded_rows`; zero while ``c = 0``), see the module docstring.
        recent: ``(B, H, K, S, D, Dv)``: the key-value summaries ``S_(r, s)`` of the ``K`` most recent rows, oldest
            first (zero where the stream has fewer rows).
        key_sums: ``(B, H, K + 1, S, D)``: the fold's and the recent rows' key sums ``z``; ``None`` without a
            denominator.
        rows: temporal block rows consumed so far (the next chunk's first row).
        fold_scale: ``(B, H, 1, S, 1, 1)`` when the fold is stored narrow: it holds ``fold / fold_scale``.

    Kept in at least float32 (float64 for float64 inputs) by default. A stream may store its summaries in 2 bytes
    (``state_dtype`` ``torch.bfloat16`` or ``torch.float16``: half the bytes): ``recent`` is then in that dtype,
    rounded once; the fold, re-rounded on every row, in float16 scaled per block (10 fraction bits where bfloat16
    has 7; the measured error: docs/streaming.md). Key sums stay wide. Everything is mixed and folded in the wide dtype.
    """

    fold: torch.Tensor
    recent: torch.Tensor
    key_sums: torch.Tensor | None
    rows: int = 0
    fold_scale: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        window: int,
        blocks_per_row: int,
        head_dim: int,
        value_dim: int,
        *,
        key_sums: bool = True,
        dtype: torch.dtype = torch.float32,
        summaries_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> "CausalMHLAState":
        """The state before the first chunk: all summaries zero, ``rows = 0``. ``dtype``: the key sums' (and by
        default the summaries'); ``summaries_dtype``: the summaries' storage dtype when narrower."""
        window = _check_window(window)
        lead = (batch, heads, 1, blocks_per_row)
        narrow = summaries_dtype is not None and summaries_dtype.itemsize < 4
        return cls(
            torch.zeros((*lead, head_dim, value_dim), dtype=torch.float16 if narrow else dtype, device=device),
            torch.zeros(
                (batch, heads, window, blocks_per_row, head_dim, value_dim),
                dtype=summaries_dtype or dtype,
                device=device,
            ),
            torch.zeros((batch, heads, window + 1, blocks_per_row, head_dim), dtype=dtype, device=device)
            if key_sums
            else None,
            fold_scale=torch.ones((*lead, 1, 1), dtype=dtype, device=device) if narrow else None,
        )

    @classmethod
    def of(cls, summaries: torch.Tensor, key_sums: torch.Tensor | None, rows: int = 0) -> "CausalMHLAState":
        """A wide state from all its summaries ``(B, H, K + 1, S, D, Dv)`` at once: the fold, then the recent rows."""
        return cls(summaries[:, :, :1], summaries[:, :, 1:], key_sums, rows)

    def heads(self, h: slice) -> "CausalMHLAState":
        """The state of the heads ``h`` alone (views)."""
        part = lambda x: None if x is None else x[:, h]  # noqa: E731
        return CausalMHLAState(
            self.fold[:, h], self.recent[:, h], part(self.key_sums), self.rows, part(self.fold_scale)
        )

    @classmethod
    def join(cls, states: Sequence["CausalMHLAState"]) -> "CausalMHLAState":
        """The states of consecutive groups of heads as one."""

        def join(name: str) -> torch.Tensor | None:
            parts = [getattr(x, name) for x in states]
            return None if parts[0] is None else torch.cat(parts, dim=1)

        return cls(join("fold"), join("recent"), join("key_sums"), states[0].rows, join("fold_scale"))

    @property
    def summaries(self) -> torch.Tensor:
        """``(B, H, K + 1, S, D, Dv)`` in the key sums' (wide) dtype: the fold as :attr:`fold` says, then the recent
        rows."""
        dtype = self.fold.dtype if self.fold_scale is None else self.fold_scale.dtype
        return torch.cat([self.wide_fold(dtype), self.recent.to(dtype)], dim=2)

    def wide_fold(self, dtype: torch.dtype) -> torch.Tensor:
        """:attr:`fold` in ``dtype``, scaled back when stored narrow."""
        fold = self.fold.to(dtype)
        return fold if self.fold_scale is None else fold * self.fold_scale.to(dtype)

    @property
    def window(self) -> int:
        """``K``: rows mixed one by one before the fold."""
        return self.recent.shape[2]

    @property
    def blocks_per_row(self) -> int:
        """``S``: blocks per temporal row."""
        return self.fold.shape[3]

    @property
    def folded_rows(self) -> int:
        """``c``: temporal rows folded so far (older than the window)."""
        return max(self.rows - self.window, 0)

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        tensors = (self.fold, self.recent, self.key_sums, self.fold_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _narrow_fold(fold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fold`` ``(B, H, 1, S, D, Dv)`` as float16 scaled per block (largest entry 1) and its scale."""
    scale = fold.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (fold / scale).to(torch.float16), scale


def check_state_dtype(state_dtype: torch.dtype | None) -> None:
    """Raise ``ValueError`` unless ``state_dtype`` is ``None`` or a floating torch dtype (a state's storage)."""
    if state_dtype is not None and not (isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point):
        raise ValueError(f"`state_dtype` must be a floating torch dtype (e.g. torch.bfloat16), got {state_dtype!r}")


def check_causal_arguments(
    mixing: torch.Tensor,
    layout: Sequence[int],
    heads: int,
    decay: torch.Tensor | float | None,
    normalize: bool | str,
    mean_fold: bool = False,
) -> tuple[int, str]:
    """Check the causal operators' own arguments (``layout`` already validated); return ``(K, normalize mode)``.

    Raises ``ValueError`` naming the first bad one.
    """
    if mean_fold and decay is not None:
        raise ValueError("`mean_fold` averages the rows older than the window, `decay` weighs them: give one of them")
    s = math.prod(layout[1:])
    if not isinstance(mixing, torch.Tensor) or mixing.ndim not in (3, 4) or mixing.shape[-2:] != (s, s):
        raise ValueError(
            f"`mixing` must be the causal (K + 2, {s}, {s}) or per-head ({heads}, K + 2, {s}, {s}) for layout "
            f"{tuple(layout)} ({s} blocks per temporal row), got {tuple(getattr(mixing, 'shape', ()))}; "
            "see causal_mixing_init"
        )
    if mixing.ndim == 4 and mixing.shape[0] != heads:
        raise ValueError(f"per-head `mixing` {tuple(mixing.shape)} must have {heads} heads first")
    if mixing.shape[-3] < 2:
        raise ValueError(f"`mixing` {tuple(mixing.shape)} needs K + 2 >= 2 matrices: the offsets 0 .. K and the fold")
    if decay is not None:
        if isinstance(decay, torch.Tensor):
            if decay.shape not in ((), (heads,)) or not decay.is_floating_point():
                raise ValueError(f"`decay` must be a float tensor of shape () or ({heads},), got {decay}")
        elif isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(f"`decay` must be in [0, 1] (None: sum the older rows), got {decay!r}")
    mode = normalization_mode(normalize)
    if mode == "scalar_mixed_denominator":
        raise ValueError(
            "causal MHLA has no 'scalar_mixed_denominator' (released DiT): it needs the queries of every key block, "
            "which a stream does not keep; use normalize=True (the paper's denominator) or False"
        )
    return mixing.shape[-3] - 2, mode


def mhla_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    *,
    decay: torch.Tensor | float | None = None,
    mean_fold: bool = False,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
    heads_per_chunk: int | None = None,
    plan: BlockPlan | None = None,
    feature_eps: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Block-causal MHLA in one pass over a whole clip (see the module docstring).

    Args:
        q, k, v, grid, q_rot, k_rot, eps, heads_per_chunk, plan, feature_eps, rotary: as for
            :func:`~mhla_diffusion.ops.attention.mhla_attention`: ``q, k`` ``(B, N, H, D)``, ``v`` ``(B, N, H, Dv)``.
        layout: blocks per grid axis; the first axis is time, its ``R`` blocks the temporal block rows.
        mixing: ``(K + 2, S, S)`` or per-head ``(H, K + 2, S, S)``: ``A_0 .. A_K``, then ``A_fold``
            (:func:`causal_mixing_init`).
        decay: ``γ`` of the fold, a float in ``[0, 1]`` or a tensor ``()`` / ``(H,)`` (differentiable; its values
            are not checked, keep them in ``[0, 1]``, e.g. a sigmoid); ``None``: the older rows are summed.
        mean_fold: average the older rows instead (``decay`` ``None``): the fold keeps its scale at any length.
        normalize: ``True`` (paper denominator) or ``False``.

    Returns:
        ``(B, N, H, Dv)`` in ``v``'s dtype, equal to running :func:`mhla_causal_step` over the clip's rows.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, None, q_rot, k_rot, plan)
    _, normalize = check_causal_arguments(mixing, layout, q.shape[2], decay, normalize, mean_fold)
    rows = layout[0]
    weights = causal_mixing_matrix(mixing, rows, decay, mean_fold=mean_fold)
    return mhla_attention(
        q,
        k,
        v,
        grid,
        layout,
        weights,
        q_rot=q_rot,
        k_rot=k_rot,
        normalize=normalize,
        eps=eps,
        heads_per_chunk=heads_per_chunk,
        plan=plan,
        feature_eps=feature_eps,
        rotary=rotary,
    )


def causal_block_output(
    q: torch.Tensor,
    copies: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
    offsets: torch.Tensor,
    plan: BlockPlan,
    mixing: torch.Tensor,
    decay: torch.Tensor | float | None,
    mean_rows: torch.Tensor | None,
    q_rot: torch.Tensor | None,
    normalize: str,
    eps: float,
    feature_eps: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Block-causal MHLA of the queries ``q`` ``(B, N, H, D)`` (cut by ``plan`` into ``R`` rows) against key rows
    given as ``copies``: ``(keys, rotated keys or None, values)`` on the same grid, in order (one clip; or teacher
    forcing's clean copy, then its noisy copy). ``offsets`` ``(R, E)``: each query row's temporal offset to each key
    row (``-1``: not visible). ``mean_rows``: the query rows' absolute indices for the mean fold, else ``None``.

    The key rows' block summaries are mixed by the ``(M, E S)`` block-causal matrix (blocks of a token or two take
    the pair form instead, :mod:`.block_pairs`). Returns ``(B, N, H, Dv)``.
    """
    batch, _, heads, head_dim = q.shape
    value_dim = copies[0][2].shape[-1]
    dtype = torch.promote_types(q.dtype, copies[0][2].dtype)
    sum_dtype = torch.promote_types(dtype, torch.float32)  # as a stream's state keeps them
    den = normalize != "none"
    with without_autocast(q.device):
        tensors = (q, q_rot, mixing, decay, *(t for copy in copies for t in copy))
        blocks, features, shift = _block_features(plan, dtype, tensors, feature_eps, rotary, den)
        m, p = plan.num_blocks, plan.block_len
        weights = _row_weights(mixing, decay, offsets, mean_rows).to(sum_dtype)  # (..., M, E S)
        weights = weights.expand(batch, heads, *weights.shape[-2:]).reshape(batch * heads, *weights.shape[-2:])
        if pair_form_pays(batch * heads, (m, p), (m * len(copies), p), head_dim, value_dim):
            numerators, sums, values = [], [], []
            for keys, keys_rot, vals in copies:
                num, key_den = features(keys, keys_rot)
                numerators.append(num)
                values.append(blocks.gather(vals, zero_padding=True))
                sums.append(None if key_den is None else blocks.key_sum(key_den, shift).to(sum_dtype))
            key_sum = None if sums[0] is None else torch.cat(sums, dim=2)
            summaries = _Summaries(weights, key_sum, pairs=(torch.cat(numerators, dim=2), torch.cat(values, dim=2)))
        else:
            kvs, sums = [], []
            for keys, keys_rot, vals in copies:
                kv, key_sum = block_sums(
                    blocks,
                    lambda keys=keys, keys_rot=keys_rot: features(keys, keys_rot),
                    lambda vals=vals: blocks.gather(vals, zero_padding=True),
                    shift,
                )
                kvs.append(kv.to(sum_dtype))
                sums.append(None if key_sum is None else key_sum.to(sum_dtype))
            summaries = _Summaries(weights, None if sums[0] is None else torch.cat(sums, dim=2))
            summaries.mixed = summaries.mix(torch.cat(kvs, dim=2)).to(dtype)  # (B, H, M, D, Dv)
        return _block_output(blocks, summaries, lambda: features(q, q_rot), normalize, eps, shift, copies[0][2].dtype)


def mhla_causal_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    state: CausalMHLAState | None = None,
    *,
    advance: bool = True,
    state_dtype: torch.dtype | None = None,
    decay: torch.Tensor | float | None = None,
    mean_fold: bool = False,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
    plan: BlockPlan | None = None,
    feature_eps: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    heads_per_chunk: int | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, CausalMHLAState | None]:
    """Block-causal MHLA of one chunk, given the state of the chunks before it.

    A *chunk* is whole temporal block rows: the tokens ``(B, N_c, H, D)`` of the chunk's grid ``grid`` (frames of
    the chunk, then the spatial axes), cut by ``layout`` ``(R_c, L_1, .., L_a)`` into ``R_c`` rows of the same
    ``S`` spatial blocks as every other chunk of the stream. Chunks may hold different numbers of rows.

    Args:
        q, k, v, q_rot, k_rot, eps, plan, feature_eps, rotary: as for
            :func:`~mhla_diffusion.ops.attention.mhla_attention`, for the chunk's tokens (``rotary``: the tables
            of the chunk's positions, ``(1, N_c, 1, D)``).
        grid, layout: the chunk's token grid and its block layout (first axis: time).
        mixing, decay, mean_fold, normalize: as for :func:`mhla_causal_attention`; the same on every step of a
            stream.
        state: what the earlier chunks left (:class:`CausalMHLAState`); ``None`` at the start of a stream.
        advance: build the state after this chunk. ``False`` (a denoising step, whose chunk is not final): the
            carried rows are only read, mixed where they lie, and no new state is built.
        state_dtype: the summaries' storage dtype of a new stream's state (``state`` ``None``), e.g.
            ``torch.bfloat16`` for half the bytes; ``None``: at least float32. A carried state keeps its own.
        heads_per_chunk: run this many heads at a time (the chunk's block summaries of one group are all that is
            held at once). Default: every head when the chunk's summaries are small (up to 2^20 numbers), else as
            many as keep a group's summaries no larger than the chunk's values, ``N_c H / (M_c D)`` heads.
        fused: run the chunk through the fused Triton kernels (:mod:`.fused_causal`; one ``torch.library``
            custom op, the eager operator on a CPU without ``TRITON_INTERPRET=1``) when nothing needs gradients
            and the operator's own feature map is used (``feature_eps``, no ``q_rot``/``k_rot``).

    Returns:
        ``(out, new_state)``: the chunk's output ``(B, N_c, H, Dv)`` in ``v``'s dtype, and the state after it
        (``rows`` advanced by ``R_c``; ``None`` when ``advance`` is ``False``). ``state`` is not modified.
        Differentiable through ``state`` too.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, None, q_rot, k_rot, plan)
    batch, _, heads, head_dim = q.shape
    window, normalize = check_causal_arguments(mixing, layout, heads, decay, normalize, mean_fold)
    check_feature_arguments(q, q_rot, k_rot, feature_eps, rotary)
    den = normalize != "none"
    rows, s = layout[0], math.prod(layout[1:])
    dtype = torch.promote_types(q.dtype, v.dtype)
    sum_dtype = torch.promote_types(dtype, torch.float32)  # summaries are mixed and folded in it
    if state is None:
        check_state_dtype(state_dtype)
        state = CausalMHLAState.empty(
            batch,
            heads,
            window,
            s,
            head_dim,
            v.shape[-1],
            key_sums=den,
            dtype=sum_dtype,
            summaries_dtype=state_dtype,
            device=q.device,
        )
    else:
        _check_state(state, (batch, heads, window + 1, s, head_dim, v.shape[-1]), den, q.device)
    if plan is None:
        plan = block_plan(grid, layout, device=q.device)
    if heads_per_chunk is not None and (isinstance(heads_per_chunk, bool) or heads_per_chunk < 1):
        raise ValueError(f"`heads_per_chunk` must be an int >= 1, got {heads_per_chunk!r}")
    group = heads_per_chunk or _head_group(v.shape[1], heads, rows * s, head_dim, v.shape[-1])
    if group < heads:  # one group of heads at a time, each with its share of the state
        outs, states = [], []
        for start in range(0, heads, group):
            h = slice(start, start + group)
            part = lambda x: None if x is None else x[:, :, h]  # noqa: E731
            out, new = mhla_causal_step(
                q[:, :, h],
                k[:, :, h],
                v[:, :, h],
                grid,
                layout,
                mixing if mixing.ndim == 3 else mixing[h],
                state.heads(h),
                advance=advance,
                decay=decay[h] if isinstance(decay, torch.Tensor) and decay.ndim == 1 else decay,
                mean_fold=mean_fold,
                q_rot=part(q_rot),
                k_rot=part(k_rot),
                normalize=normalize,
                eps=eps,
                plan=plan,
                feature_eps=feature_eps,
                rotary=rotary,
                heads_per_chunk=group,
                fused=fused,
            )
            outs.append(out)
            states.append(new)
        return torch.cat(outs, dim=2), CausalMHLAState.join(states) if advance else None

    with without_autocast(q.device):
        # Rows e = 0 .. K + R_c: the fold (standing for row r0 - K - 1 and all before it, weighted from there),
        # the K carried rows, the chunk's rows. Chunk row i sees row e at offset i + K + 1 - e.
        i = torch.arange(rows, device=q.device)
        e = torch.arange(window + 1 + rows, device=q.device)
        query_rows = state.rows + i if mean_fold else None  # the fold (a sum) is averaged by the rows it holds
        weights = _row_weights(mixing, decay, i[:, None] + window + 1 - e[None, :], query_rows).to(sum_dtype)
        if decay is None and state.folded_rows > 1:  # the stored fold is F / c: mix c times it
            weights = torch.cat([weights[..., :s] * state.folded_rows, weights[..., s:]], dim=-1)
        fold, recent = state.wide_fold(sum_dtype), state.recent.to(sum_dtype)
        carried = [fold.flatten(2, 3), recent.flatten(2, 3)]
        carried_sums = None if state.key_sums is None else state.key_sums.flatten(2, 3)
        leaves = (q, k, v, mixing, decay, state.fold, state.recent, state.key_sums)
        fused = fused and q_rot is None and k_rot is None and feature_eps is not None
        if fused and not needs_grad(leaves):
            from .fused_causal import fused_causal_chunk  # the Triton kernels on CUDA, as one custom op

            out, kv, key_sum = fused_causal_chunk(
                q, k, v, plan, weights, carried, carried_sums, rotary, feature_eps, normalize, eps
            )
        else:
            out, kv, key_sum = causal_chunk_output(
                q, k, v, plan, weights, carried, carried_sums, normalize, eps, feature_eps, rotary, q_rot, k_rot
            )
        kv = kv.to(sum_dtype).unflatten(2, (rows, s))  # (B, H, R_c, S, D, Dv)
        if not advance:
            return out, None

        # The next chunk's first row r0 + R_c sees row e at offset R_c + K + 1 - e: rows e <= R_c fold into the new
        # fold with γ^(R_c - e), and the last K rows are carried one by one.
        gamma = torch.ones((), dtype=sum_dtype, device=q.device) if decay is None else decay
        weight = torch.as_tensor(gamma, dtype=sum_dtype, device=q.device)[..., None] ** (rows - e[: rows + 1])
        weight = weight.expand(heads, rows + 1)  # (H, R_c + 1)
        new_rows = state.rows + rows
        scale = (state.folded_rows, max(new_rows - window, 1)) if decay is None else (1, 1)  # F / c in, out

        def advanced(
            fold: torch.Tensor, recent: torch.Tensor, chunk: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.cat([fold * scale[0], recent, chunk.to(sum_dtype)], dim=2)  # rows e = 0 .. K + R_c
            folded = torch.einsum("he,bhe...->bh...", weight, x[:, :, : rows + 1]).unsqueeze(2) / scale[1]
            return folded, x[:, :, rows + 1 :]

        new_fold, new_recent = advanced(fold, recent, kv)
        fold_scale = None
        if state.fold_scale is not None:
            new_fold, fold_scale = _narrow_fold(new_fold)
        key_fold = key_recent = None
        if key_sum is not None:
            key_fold, key_recent = advanced(
                state.key_sums[:, :, :1], state.key_sums[:, :, 1:], key_sum.unflatten(2, (rows, s))
            )
        new_state = CausalMHLAState(
            new_fold.to(state.fold.dtype),
            new_recent.to(state.recent.dtype),
            None if key_sum is None else torch.cat([key_fold, key_recent], dim=2).to(state.key_sums.dtype),
            new_rows,
            fold_scale,
        )
    return out, new_state


#: Chunk summaries (numbers, all heads) up to which a chunk runs every head at once: splitting small ones only adds
#: calls (a small model's stream on a CPU is bound by them).
SPLIT_ABOVE = 2**20


def _head_group(tokens: int, heads: int, blocks: int, head_dim: int, value_dim: int) -> int:
    """Heads a chunk runs at a time by default (see :func:`mhla_causal_step`'s ``heads_per_chunk``)."""
    if heads * blocks * head_dim * value_dim <= SPLIT_ABOVE:
        return heads
    return max(1, tokens * heads // (blocks * head_dim))


def _check_state(state: CausalMHLAState, shape: tuple[int, ...], den: bool, device: torch.device) -> None:
    if not isinstance(state, CausalMHLAState):
        raise ValueError(f"`state` must be a CausalMHLAState (or None to start a stream), got {type(state).__name__}")
    if (*state.recent.shape[:2], state.window + 1, *state.recent.shape[3:]) != shape:
        raise ValueError(
            f"`state` recent rows {tuple(state.recent.shape)} do not fit this chunk and mixing, which need "
            f"(B, H, K, S, D, Dv) = {(*shape[:2], shape[2] - 1, *shape[3:])}: carry the state of the same stream "
            "(batch, heads, window, layout)"
        )
    if (state.key_sums is not None) != den:
        raise ValueError(
            "`state` was made " + ("without" if den else "with") + " a denominator's key sums, but this call has "
            f"normalize={'True' if den else 'False'}: use the same normalize on every step of a stream"
        )
    if state.recent.device != device:
        raise ValueError(f"`state` is on {state.recent.device} but the inputs are on {device}")


def _check_window(window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"the causal window K must be an int >= 0 (rows mixed one by one), got {window!r}")
    return window
