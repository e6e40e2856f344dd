"""The block summaries between the fused kernels: how they are laid out in memory (:func:`_summary_buffers`), their
mixing ``S̃ = W S``, ``z̃ = W z`` (:func:`_mix`) and its backward (:func:`_unmix`), in PyTorch outside autocast.
:mod:`~mhla_diffusion.ops.triton_mhla` and :mod:`~mhla_diffusion.ops.triton_mhla_backward` launch the kernels
around them.
"""

from __future__ import annotations

import torch

from .attention import without_autocast


def folds_key_sums(dtype: torch.dtype, norm: bool) -> bool:
    """Whether summaries of ``dtype`` carry the key sums as one more row (:func:`_summary_buffers`): float32 ones
    with a denominator; half ones keep them apart in float32."""
    return norm and dtype == torch.float32


def _summary_buffers(
    batch: int, heads: int, m: int, d: int, dv: int, dtype: torch.dtype, norm: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Empty summaries ``S`` ``(B, H, M, D, Dv)`` in ``dtype`` and key sums ``z`` ``(B, H, M, D)`` (``None``
    without ``norm``), as views of transposed storage: ``Sᵀ`` ``(B, H, M, Dv, D)``, so that every stored row
    is ``D`` contiguous channels (aligned: the kernels move it in 16-byte vectors). Float32 summaries carry the
    key sums as one more row, ``[Sᵀ; zᵀ]`` ``(B, H, M, Dv + 1, D)``, so that :func:`_mix` mixes both in one
    product; bfloat16 and float16 ones keep ``z`` apart in float32.

    The key sums are accumulated and kept in float32 for every dtype, and mixed by a float32 ``W``, as the
    eager operator keeps them (issue 61). A bfloat16 row ``[Sᵀ; zᵀ]`` rounded ``z`` and ``z̃`` to 8 bits: with
    non-negative mixing that rounding cancelled between numerator and denominator, but once training makes the
    mixing signed, ``z̃ = W z`` cancels and the rounded denominator did not: under the interpreter (round to
    nearest patched in; bf16, 3x6x8 tokens in 1x2x2 blocks, 2 heads of 128, 56 % of ``W`` negative) the output's
    error against float64 was 0.59 of its largest value with the row, against 2.3e-2 for the eager operator."""
    fold = folds_key_sums(dtype, norm)
    storage = torch.empty((batch, heads, m, dv + fold, d), device=device, dtype=dtype)
    summaries = storage[..., :dv, :].transpose(-1, -2)
    if fold:
        return summaries, storage[..., dv, :]
    key_sums = torch.empty((batch, heads, m, d), device=device, dtype=torch.float32) if norm else None
    return summaries, key_sums


def _augmented(summaries: torch.Tensor, key_sums: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[Sᵀ; zᵀ]`` tensor ``(B, H, M, Dv + 1, D)`` that ``summaries`` and ``key_sums`` are views of (as
    :func:`_summary_buffers` makes them), or ``None`` when they lie apart."""
    if key_sums is None or key_sums.dtype != summaries.dtype:
        return None
    b, h, m, d, dv = summaries.shape
    strides = (h * m * (dv + 1) * d, m * (dv + 1) * d, (dv + 1) * d, d, 1)
    if (
        summaries.stride() != (*strides[:3], 1, d)
        or key_sums.stride() != (*strides[:3], 1)
        or key_sums.untyped_storage().data_ptr() != summaries.untyped_storage().data_ptr()
        or key_sums.storage_offset() != summaries.storage_offset() + dv * d
    ):
        return None
    return summaries.as_strided((b, h, m, dv + 1, d), strides)


def _blocks_flat(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(B, H, M, D, Dv)`` as ``(B, H, M, D * Dv)`` in memory order (a view when either of the last two
    dims is contiguous over the other) and whether that order is the transposed one."""
    batch, heads, m, d, dv = x.shape
    if x.transpose(-1, -2).is_contiguous():
        return x.transpose(-1, -2).reshape(batch, heads, m, dv * d), True
    return x.reshape(batch, heads, m, d * dv), False


def _mix(
    mixing: torch.Tensor, summaries: torch.Tensor, key_sums: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mixing between the kernels, in PyTorch, outside ``torch.autocast``: ``S̃ = W S`` ``(B, H, M, D,
    Dv)`` in the summaries' dtype (half summaries: a half GEMM, float32 accumulation, ``W`` rounded to the
    half type as the eager operator does) and ``z̃ = W z`` ``(B, H, M, D)`` in float32 (``None`` without
    key sums). Folded float32 summaries ``[Sᵀ; zᵀ]`` (:func:`_summary_buffers`) are mixed in one product,
    returned as views of ``[S̃ᵀ; z̃ᵀ]``; half ones in two.
    ``S̃`` has the layout of ``S`` (transposed storage stays transposed)."""
    batch, heads, m, d, dv = summaries.shape
    augmented = _augmented(summaries, key_sums)
    with without_autocast(summaries.device):
        mix = mixing.to(torch.float32)
        if augmented is not None:
            mixed = mix.to(augmented.dtype) @ augmented.view(batch, heads, m, (dv + 1) * d)
            mixed = mixed.view(batch, heads, m, dv + 1, d)
            return mixed[..., :dv, :].transpose(-1, -2), mixed[..., dv, :]
        flat, transposed = _blocks_flat(summaries)
        mixed = mix.to(summaries.dtype) @ flat
        mixed_sums = None if key_sums is None else mix @ key_sums
    if transposed:
        return mixed.view(batch, heads, m, dv, d).transpose(-1, -2), mixed_sums
    return mixed.view(batch, heads, m, d, dv), mixed_sums


def _joint(summaries: torch.Tensor, key_sums: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[S | z]`` tensor ``(B, H, M, D, Dv + 1)`` that ``summaries`` and ``key_sums`` are the two views of
    (the forward keeps float32 key sums as one more column of the summaries), or ``None`` when they lie apart."""
    if key_sums is None or key_sums.dtype != summaries.dtype:
        return None
    if key_sums.untyped_storage().data_ptr() != summaries.untyped_storage().data_ptr():
        return None
    b, h, m, d, dv = summaries.shape
    joint = summaries.as_strided((b, h, m, d, dv + 1), summaries.stride(), summaries.storage_offset())
    if key_sums.stride() != joint[..., dv].stride() or key_sums.storage_offset() != joint[..., dv].storage_offset():
        return None
    return joint


def _flat_pair(grad: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``grad`` and ``value`` ``(B, H, M, a, b)`` as ``(B, H, M, a * b)``, both in ``grad``'s storage order
    (views where the blocks are dense in that order, as :func:`_gradient_buffers` lays them out; else
    copies), and whether that order is ``(b, a)``."""
    swapped = grad.stride(-2) < grad.stride(-1)
    if swapped:
        grad, value = grad.transpose(-1, -2), value.transpose(-1, -2)
    return grad.reshape(*grad.shape[:3], -1), value.reshape(*value.shape[:3], -1), swapped


def _unflat(flat: torch.Tensor, shape: torch.Size, swapped: bool) -> torch.Tensor:
    """``flat`` ``(B, H, M, a * b)`` (contiguous, in the order :func:`_flat_pair` gave) as ``(B, H, M, a, b)``."""
    if swapped:
        return flat.view(*shape[:3], shape[4], shape[3]).transpose(-1, -2)
    return flat.view(shape)


def _gradient_buffers(
    summaries: torch.Tensor, key_sums: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Empty ``dS̃`` and ``dz̃`` laid out as the forward's ``S`` and ``z``: two views of one ``[dS̃ | dz̃]``
    buffer where those are views of one ``[S | z]`` (float32), else ``dS̃`` in ``S``'s dtype and layout and
    ``dz̃`` float32; so that :func:`_unmix` pairs their elements without copies."""
    joint = _joint(summaries, key_sums)
    if joint is not None:
        d_joint = torch.empty_like(joint)  # the same strides (a dense tensor)
        return d_joint[..., :-1], d_joint[..., -1]
    d_sums = None if key_sums is None else torch.empty(key_sums.shape, device=key_sums.device, dtype=torch.float32)
    return torch.empty_like(summaries), d_sums


def _unmix(
    mixing: torch.Tensor,
    summaries: torch.Tensor,
    key_sums: torch.Tensor | None,
    d_mixed: torch.Tensor,
    d_mixed_sums: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The backward of :func:`~mhla_diffusion.ops.triton_mhla._mix`, in PyTorch outside ``torch.autocast``.

    Args: ``mixing`` ``(M, M)`` or ``(H, M, M)``; the forward's summaries ``S`` ``(B, H, M, D, Dv)`` and key
    sums ``z`` ``(B, H, M, D)`` (``None`` without a denominator), and the gradients ``dS̃``, ``dz̃`` of the
    mixed ones, laid out by :func:`_gradient_buffers`.

    Returns ``dS = Wᵀ dS̃`` ``(B, H, M, D, Dv)`` in ``dS̃``'s dtype (``W`` rounded to it, as the forward's
    product rounds it), ``dz = Wᵀ dz̃`` (or ``None``), and ``dW`` float32 in ``mixing``'s shape:
    ``Σ <dS̃_o, S_j> + <dz̃_o, z_j>`` over batch and heads (over batch only for per-head mixing), every product
    and sum in float32 (:func:`_float32_product`). Where
    ``S, z`` (and ``dS̃, dz̃``) are views of one ``[S | z]`` tensor, one product each mixes and contracts both.
    """
    reduce_dims = (0,) if mixing.ndim == 3 else (0, 1)
    joint, d_joint = _joint(summaries, key_sums), _joint(d_mixed, d_mixed_sums)
    with without_autocast(d_mixed.device):
        mix = mixing.to(torch.float32)
        if joint is not None and d_joint is not None:
            d_flat, flat, swapped = _flat_pair(d_joint, joint)
            d_unmixed = _unflat(mix.to(d_flat.dtype).transpose(-1, -2) @ d_flat, d_joint.shape, swapped)
            d_mixing = (d_flat @ flat.transpose(-1, -2)).to(torch.float32).sum(reduce_dims)
            return d_unmixed[..., :-1], d_unmixed[..., -1], d_mixing
        d_flat, flat, swapped = _flat_pair(d_mixed, summaries)
        d_summaries = _unflat(mix.to(d_flat.dtype).transpose(-1, -2) @ d_flat, d_mixed.shape, swapped)
        d_mixing = _float32_product(d_flat, flat)
        d_sums = None
        if d_mixed_sums is not None:
            d_sums = mix.transpose(-1, -2) @ d_mixed_sums
            d_mixing = d_mixing + d_mixed_sums @ key_sums.to(torch.float32).transpose(-1, -2)
        d_mixing = d_mixing.sum(reduce_dims)
    return d_summaries, d_sums, d_mixing


def _float32_product(grad: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``grad @ valueᵀ`` ``(B, H, M, M)`` in float32 for ``(B, H, M, K)`` operands: half operands multiply into a
    float32 result (CUDA: one batched GEMM with ``out_dtype``; on a CPU on float32 copies), so that ``dW`` is never
    rounded to the half type per (batch, head) before the sum over them."""
    if grad.dtype == torch.float32:
        return grad @ value.transpose(-1, -2)
    if grad.device.type in ("cuda", "meta"):  # meta: what CUDA runs, for the traffic counts
        batch = grad.shape[:2]
        grad3, value3 = grad.reshape(-1, *grad.shape[2:]), value.reshape(-1, *value.shape[2:])
        return torch.bmm(grad3, value3.transpose(-1, -2), out_dtype=torch.float32).view(*batch, *grad.shape[2:3] * 2)
    return grad.to(torch.float32) @ value.to(torch.float32).transpose(-1, -2)
