"""MHLA over a joint sequence of image tokens and text tokens (HunyuanVideo, CogVideoX, Flux).

The image tokens lie on a token grid cut into ``M`` blocks as in :func:`~mhla_diffusion.ops.attention.mhla_attention`.
The text tokens have no position: they form one more block, the text block ``T`` (index ``M``), whose key-value
summary and key sum run over the valid text tokens of each sample (``text_mask``)::

    S_T = Σ_{s valid text} φ(k_s) v_sᵀ,     z_T = Σ_{s valid text} φ(k_s)

The mixing is ``(M + 1, M + 1)`` (or per head ``(H, M + 1, M + 1)``): row ``o < M`` is image block ``o``'s, with
``W[o, T]`` its weight of the text; row ``T`` is every text token's, over every image block and the text block::

    S̃_o = Σ_j W[o, j] S_j + W[o, T] S_T,    z̃_o = Σ_j W[o, j] z_j + W[o, T] z_T      (o: an image block, or T)
    image token t:  out_t = q̂_t · S̃_b(t) / (max(q_t · z̃_b(t), 0) + eps)
    text token t:   out_t = q_t · S̃_T / (max(q_t · z̃_T, 0) + eps)

(``q̂``: the numerator's rotated features; text tokens are not rotated.) The cost is O((N + L) D Dv + (M + 1)^2 D Dv)
for ``N`` image and ``L`` text tokens: linear in both. Padded text tokens (``text_mask`` false) are left out as keys;
as queries they get row ``T`` like every text token, as a masked softmax gives them an output too.
The O((N + L)^2) form is :func:`~mhla_diffusion.ops.naive.mhla_joint_attention_reference`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .attention import (
    _block_output,
    _Blocks,
    _Summaries,
    block_sums,
    check_feature_arguments,
    normalization_mode,
    validate_attention_inputs,
    without_autocast,
)
from .block_layout import BlockPlan, block_plan, num_blocks

__all__ = ["check_joint_arguments", "joint_mixing_init", "mhla_joint_attention"]


def joint_mixing_init(image_mixing: torch.Tensor) -> torch.Tensor:
    """The ``(M + 1, M + 1)`` joint mixing (or ``(H, M + 1, M + 1)``) that starts from ``image_mixing`` ``(M, M)``.

    The text block has no position, so no distance to favour: it sits as near every image block as that block's
    own summary. Image row ``o`` weighs the text by ``W[o, o]``; the text row weighs every block, itself included,
    alike (``1 / (M + 1)``: a row of global linear attention).
    """
    m = image_mixing.shape[-1]
    joint = image_mixing.new_zeros(*image_mixing.shape[:-2], m + 1, m + 1)
    joint[..., :m, :m] = image_mixing
    joint[..., :m, m] = image_mixing.diagonal(dim1=-2, dim2=-1)
    joint[..., m, :] = 1.0 / (m + 1)
    return joint


def check_joint_arguments(
    q: torch.Tensor,
    text_q: torch.Tensor,
    text_k: torch.Tensor,
    text_v: torch.Tensor,
    text_mask: torch.Tensor | None,
    layout: Sequence[int],
    mixing: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Raise ``ValueError`` naming the first text argument or mixing that does not fit the image inputs."""
    batch, _, heads, dim = q.shape
    for name, t, last in (("text_q", text_q, dim), ("text_k", text_k, dim), ("text_v", text_v, v.shape[3])):
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or t.shape[0] != batch or t.shape[2:] != (heads, last):
            raise ValueError(
                f"`{name}` must be (B, L, H, D) = ({batch}, L, {heads}, {last}) like the image inputs, "
                f"got {tuple(getattr(t, 'shape', ()))}"
            )
    if text_k.shape[1] != text_q.shape[1] or text_v.shape[1] != text_q.shape[1]:
        raise ValueError(
            f"`text_q`, `text_k`, `text_v` must have the same text length, got {text_q.shape[1]}, "
            f"{text_k.shape[1]}, {text_v.shape[1]}"
        )
    if text_mask is not None and (text_mask.dtype != torch.bool or tuple(text_mask.shape) != text_q.shape[:2]):
        raise ValueError(
            f"`text_mask` must be a bool tensor (B, L) = {tuple(text_q.shape[:2])} (True: a real text token), "
            f"got {text_mask.dtype} {tuple(text_mask.shape)}"
        )
    m = num_blocks(layout) + 1
    if not isinstance(mixing, torch.Tensor) or mixing.shape not in ((m, m), (heads, m, m)):
        raise ValueError(
            f"joint `mixing` must be ({m}, {m}) or per-head ({heads}, {m}, {m}): the layout's {m - 1} image blocks "
            f"and the text block last; got {tuple(getattr(mixing, 'shape', ()))}"
        )


def mhla_joint_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    text_q: torch.Tensor,
    text_k: torch.Tensor,
    text_v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    *,
    text_mask: torch.Tensor | None = None,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
    plan: BlockPlan | None = None,
    feature_eps: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint MHLA of image tokens on ``grid`` and a text block (see the module docstring).

    Args:
        q, k, v: image tokens ``(B, N, H, D)`` / ``(B, N, H, Dv)`` in row-major grid order, as for
            :func:`~mhla_diffusion.ops.attention.mhla_attention` (features, or raw projections with
            ``feature_eps``; ``q_rot`` / ``k_rot`` or ``rotary`` for the numerator's RoPE).
        text_q, text_k, text_v: text tokens ``(B, L, H, D)`` / ``(B, L, H, Dv)``, features or raw projections
            like ``q, k`` (the same ``feature_eps``), never rotated.
        mixing: ``(M + 1, M + 1)`` or ``(H, M + 1, M + 1)``, the text block last (:func:`joint_mixing_init`).
        text_mask: ``(B, L)`` bool, ``True`` for a real text token (default: every token).
        normalize: ``True`` / ``"denominator"`` or ``False`` / ``"none"`` (the scalar-mixed denominator of
            released DiT needs equal blocks, which the text block is not).

    Returns:
        ``(image output (B, N, H, Dv), text output (B, L, H, Dv))`` in ``v``'s dtype.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, None, q_rot, k_rot, plan)
    check_joint_arguments(q, text_q, text_k, text_v, text_mask, layout, mixing, v)
    normalize = normalization_mode(normalize)
    if normalize == "scalar_mixed_denominator":
        raise ValueError(
            "joint MHLA has no 'scalar_mixed_denominator' (it needs equal-size blocks, and the text block is not "
            "one): use normalization='denominator' or 'none'"
        )
    check_feature_arguments(q, q_rot, k_rot, feature_eps, rotary)
    if plan is None:
        plan = block_plan(grid, layout, device=q.device)
    with without_autocast(q.device):
        return _joint_blocks(
            q, k, v, text_q, text_k, text_v, text_mask, plan, mixing, q_rot, k_rot, normalize, eps, feature_eps, rotary
        )


def _joint_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    text_q: torch.Tensor,
    text_k: torch.Tensor,
    text_v: torch.Tensor,
    text_mask: torch.Tensor | None,
    plan: BlockPlan,
    mixing: torch.Tensor,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    normalize: str,
    eps: float,
    feature_eps: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(q.dtype, v.dtype)
    tensors = (q, k, v, text_q, text_k, text_v, q_rot, k_rot, mixing)
    inplace = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    blocks = _Blocks(plan, dtype, inplace)
    den = normalize != "none"
    tables = None if feature_eps is None or rotary is None else blocks.rotary_tables(rotary, feature_eps)
    shift = 0.0 if tables is None else float(feature_eps)

    def image_features(x: torch.Tensor, x_rot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return blocks.features(x, x_rot, feature_eps, tables, den)

    kv_summary, key_sum = block_sums(  # (B, H, M, D, Dv), (B, H, M, D)
        blocks, lambda: image_features(k, k_rot), lambda: blocks.gather(v, zero_padding=True), shift
    )
    # the text block's summary and key sum over its valid tokens, appended as block M
    text_keys = _text_features(text_k, feature_eps, dtype)  # (B, H, L, D)
    if text_mask is not None:
        text_keys = text_keys * text_mask[:, None, :, None].to(dtype)
    compute = torch.promote_types(dtype, torch.float32)
    text_summary = text_keys.transpose(-1, -2).to(compute) @ text_v.transpose(1, 2).to(compute)  # (B, H, D, Dv)
    kv_summary = torch.cat([kv_summary, text_summary.to(kv_summary.dtype).unsqueeze(2)], dim=2)
    if key_sum is not None:
        key_sum = torch.cat([key_sum, text_keys.sum(2, dtype=compute).unsqueeze(2)], dim=2)
    batch, heads, m = kv_summary.shape[:3]  # m = M + 1
    weights = mixing.expand(batch, heads, m, m).reshape(batch * heads, m, m)
    # image query blocks: rows 0 .. M - 1
    image = _Summaries(weights[:, : m - 1], key_sum)
    image.mixed = image.mix(kv_summary)
    text = _Summaries(weights[:, m - 1 :], key_sum)
    text_mixed = text.mix(kv_summary).squeeze(2)  # S̃_T: (B, H, D, Dv)
    out_image = _block_output(blocks, image, lambda: image_features(q, q_rot), normalize, eps, shift, v.dtype)

    queries = _text_features(text_q, feature_eps, dtype).to(compute)  # (B, H, L, D)
    out_text = queries @ text_mixed.to(compute)  # (B, H, L, Dv)
    if den:
        mixed_sum = text.mix(key_sum).squeeze(2)  # z̃_T: (B, H, D)
        out_text = out_text / ((queries @ mixed_sum.to(compute).unsqueeze(-1)).clamp_min(0) + eps)
    return out_image, out_text.transpose(1, 2).to(v.dtype)


def _text_features(x: torch.Tensor, feature_eps: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Text tokens ``(B, L, H, D)`` as heads-first features ``(B, H, L, D)``: ``ReLU(x) + feature_eps`` of raw
    projections, or ``x`` itself when it holds features already."""
    x = x.transpose(1, 2).to(dtype)
    return x if feature_eps is None else x.relu() + feature_eps
