"""Tiny original-format DiT and DiT-MHLA checkpoints, and our own forward of both original models.

Written from the DiT architecture and the reference facts (sections 2.1-2.2 of
``mhla-reference-facts.md``), independently of Diffusers and of the importer:

* DiT: patchify conv, fixed 2-D sin-cos position table, timestep sinusoid (``cos`` then ``sin``,
  frequencies ``10000 ** (-i / 128)``) + MLP, label table, adaLN-Zero blocks (LayerNorm eps 1e-6,
  softmax attention over ``qkv``, GELU-tanh MLP), adaLN final layer, unpatchify.
* DiT-MHLA: the same, tokens permuted to block-major order after the position table, and the
  ``MHLA4DiT`` attention: LayerNorm (eps 1e-5) -> ``to_qkv`` -> LePE 3x3 on ``v`` over the image ->
  ``ReLU + eps`` features -> per-block ``K^T V`` and key sums, mixed by ``W[o, j]`` -> the
  denominator of token ``w`` of block ``o`` mixes the scalars ``q_(j,w) · z_j`` -> plus LePE -> ``to_out``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-6


# ----------------------------------------------------------------------------- checkpoints


def sincos_table(hidden: int, side: int) -> torch.Tensor:
    """The fixed 2-D sin-cos position table ``(1, side * side, hidden)`` in raster order (float32).

    Half the channels encode one grid coordinate, half the other; each half is ``sin`` then ``cos``
    of ``pos * 10000 ** (-i / (hidden / 4))``. The first half uses the column index (as the
    original MAE/DiT code does, where the "h" half is built from the meshgrid's first, i.e. w, axis).
    """
    quarter = hidden // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(
        torch.arange(side, dtype=torch.float64), torch.arange(side, dtype=torch.float64), indexing="ij"
    )

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float().unsqueeze(0)


def original_checkpoint(
    *,
    depth: int = 2,
    hidden: int = 64,
    patch: int = 2,
    latent: int = 8,
    in_channels: int = 4,
    learn_sigma: bool = True,
    num_classes: int = 10,
    block_tokens: int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A random original-format state dict; with ``block_tokens`` (``L``) a released DiT-MHLA one.

    Every weight is random and nonzero (the original init zeroes the adaLN and output layers, which
    would hide mistakes); mixing entries are in ``[0, 1]`` as the clamped trained ones.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1] if len(shape) > 1 else 4)
        return torch.randn(*shape, generator=g) * scale

    out_channels = 2 * in_channels if learn_sigma else in_channels
    side = latent // patch
    sd = {
        "x_embedder.proj.weight": rand(hidden, in_channels, patch, patch, scale=0.3),
        "x_embedder.proj.bias": rand(hidden),
        "pos_embed": sincos_table(hidden, side),
        "t_embedder.mlp.0.weight": rand(hidden, 256),
        "t_embedder.mlp.0.bias": rand(hidden),
        "t_embedder.mlp.2.weight": rand(hidden, hidden),
        "t_embedder.mlp.2.bias": rand(hidden),
        "y_embedder.embedding_table.weight": rand(num_classes + 1, hidden, scale=0.5),
        "final_layer.linear.weight": rand(patch * patch * out_channels, hidden),
        "final_layer.linear.bias": rand(patch * patch * out_channels),
        "final_layer.adaLN_modulation.1.weight": rand(2 * hidden, hidden, scale=0.05),
        "final_layer.adaLN_modulation.1.bias": rand(2 * hidden, scale=0.2),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        sd.update(
            {
                b + "adaLN_modulation.1.weight": rand(6 * hidden, hidden, scale=0.05),
                b + "adaLN_modulation.1.bias": rand(6 * hidden, scale=0.3),
                b + "mlp.fc1.weight": rand(4 * hidden, hidden),
                b + "mlp.fc1.bias": rand(4 * hidden),
                b + "mlp.fc2.weight": rand(hidden, 4 * hidden),
                b + "mlp.fc2.bias": rand(hidden),
            }
        )
        if block_tokens is None:
            sd.update(
                {
                    b + "attn.qkv.weight": rand(3 * hidden, hidden),
                    b + "attn.qkv.bias": rand(3 * hidden),
                    b + "attn.proj.weight": rand(hidden, hidden),
                    b + "attn.proj.bias": rand(hidden),
                }
            )
        else:
            blocks = side * side // block_tokens
            sd.update(
                {
                    b + "attn.norm.weight": 1 + rand(hidden, scale=0.2),
                    b + "attn.norm.bias": rand(hidden, scale=0.2),
                    b + "attn.to_qkv.weight": rand(3 * hidden, hidden),
                    b + "attn.to_qkv.bias": rand(3 * hidden),
                    b + "attn.lepe.weight": rand(hidden, 1, 3, 3, scale=0.3),
                    b + "attn.lepe.bias": rand(hidden, scale=0.2),
                    b + "attn.piece_attn.conv.weight": torch.rand(blocks, blocks, 1, 1, generator=g),
                    b + "attn.to_out.0.weight": rand(hidden, hidden),
                    b + "attn.to_out.0.bias": rand(hidden),
                }
            )
    return sd


def dit_inputs(
    batch: int = 3,
    latent: int = 8,
    in_channels: int = 4,
    num_classes: int = 10,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random latents, timesteps in ``[0, 1000)`` and labels (the null label ``num_classes`` included)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    labels[-1] = num_classes
    return dict(
        hidden_states=torch.randn(batch, in_channels, latent, latent, generator=g, dtype=dtype),
        timestep=torch.randint(0, 1000, (batch,), generator=g),
        class_labels=labels,
    )


# ----------------------------------------------------------------------------- the original forward


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """``[cos(t f_i), sin(t f_i)]`` with ``f_i = 10000 ** (-i / (dim / 2))``, computed in float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def block_major_order(side: int, block_side: int) -> torch.Tensor:
    """``order[s]`` = raster index of the token at block-major position ``s = b * L + w``."""
    order = torch.empty(side * side, dtype=torch.long)
    per_row, tokens = side // block_side, block_side * block_side
    for r in range(side):
        for c in range(side):
            b = (r // block_side) * per_row + c // block_side
            w = (r % block_side) * block_side + c % block_side
            order[b * tokens + w] = r * side + c
    return order


def _linear(x: torch.Tensor, sd: dict, name: str) -> torch.Tensor:
    return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def _softmax_attention(x: torch.Tensor, sd: dict, prefix: str, heads: int) -> torch.Tensor:
    batch, n, channels = x.shape
    qkv = _linear(x, sd, prefix + "qkv").reshape(batch, n, 3, heads, channels // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    weights = torch.softmax(q @ k.transpose(-2, -1) * (channels // heads) ** -0.5, dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(batch, n, channels)
    return _linear(out, sd, prefix + "proj")


def _mhla4dit_attention(
    x: torch.Tensor, sd: dict, prefix: str, heads: int, side: int, order: torch.Tensor
) -> torch.Tensor:
    """``MHLA4DiT`` on block-major tokens ``x`` ``(B, N, C)``."""
    batch, n, channels = x.shape
    mixing = sd[prefix + "piece_attn.conv.weight"][:, :, 0, 0].to(x.dtype)  # W[o, j]
    blocks = mixing.shape[0]
    tokens = n // blocks
    h = F.layer_norm(x, (channels,), sd[prefix + "norm.weight"], sd[prefix + "norm.bias"], eps=1e-5)
    q, k, v = _linear(h, sd, prefix + "to_qkv").chunk(3, dim=-1)
    # LePE: v back on the image (raster), depthwise 3x3, back to block-major
    raster = torch.empty_like(v)
    raster[:, order] = v
    image = raster.transpose(1, 2).reshape(batch, channels, side, side)
    lepe = F.conv2d(image, sd[prefix + "lepe.weight"], sd[prefix + "lepe.bias"], padding=1, groups=channels)
    lepe = lepe.reshape(batch, channels, n).transpose(1, 2)[:, order]
    q, k = F.relu(q) + EPS, F.relu(k) + EPS

    def split(t: torch.Tensor) -> torch.Tensor:  # (B, N, C) -> (B, H, M, L, D)
        return t.reshape(batch, blocks, tokens, heads, channels // heads).permute(0, 3, 1, 2, 4)

    q, k, v = split(q), split(k), split(v)
    states = torch.einsum("bhjld,bhjle->bhjde", k, v)  # S_j = K_j^T V_j
    key_sums = k.sum(dim=3)  # z_j
    mixed = torch.einsum("oj,bhjde->bhode", mixing, states)  # S~_o = sum_j W[o, j] S_j
    scalars = torch.einsum("bhjwd,bhjd->bhjw", q, key_sums)  # q_(j,w) . z_j
    denominator = torch.einsum("oj,bhjw->bhow", mixing, scalars) + EPS
    out = torch.einsum("bhowd,bhode->bhowe", q, mixed) / denominator[..., None]
    out = out.permute(0, 2, 3, 1, 4).reshape(batch, n, channels)
    return _linear(out + lepe, sd, prefix + "to_out.0")


def original_dit_forward(
    sd: dict[str, torch.Tensor],
    x: torch.Tensor,
    t: torch.Tensor,
    y: torch.Tensor,
    *,
    heads: int,
    block_tokens: int | None = None,
) -> torch.Tensor:
    """The original DiT (or, with ``block_tokens``, released DiT-MHLA) output for latents ``x`` ``(B, C, H, W)``.

    Computes in the dtype of ``x`` (the weights are cast to it); the timestep sinusoid in float32.
    """
    sd = {key: value.to(x.dtype) for key, value in sd.items()}
    depth = 1 + max(int(key.split(".")[1]) for key in sd if key.startswith("blocks."))
    patch = sd["x_embedder.proj.weight"].shape[-1]
    side = x.shape[-1] // patch
    tokens = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=patch)
    tokens = tokens.flatten(2).transpose(1, 2) + sd["pos_embed"]
    order = None
    if block_tokens is not None:
        order = block_major_order(side, math.isqrt(block_tokens))
        tokens = tokens[:, order]
    temb = timestep_sinusoid(t).to(x.dtype)
    temb = _linear(F.silu(_linear(temb, sd, "t_embedder.mlp.0")), sd, "t_embedder.mlp.2")
    c = temb + sd["y_embedder.embedding_table.weight"][y]
    hidden = tokens.shape[-1]
    for i in range(depth):
        b = f"blocks.{i}."
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _linear(
            F.silu(c), sd, b + "adaLN_modulation.1"
        ).chunk(6, dim=1)
        h = _modulate(F.layer_norm(tokens, (hidden,), eps=1e-6), shift_msa, scale_msa)
        if block_tokens is None:
            attn = _softmax_attention(h, sd, b + "attn.", heads)
        else:
            attn = _mhla4dit_attention(h, sd, b + "attn.", heads, side, order)
        tokens = tokens + gate_msa[:, None] * attn
        h = _modulate(F.layer_norm(tokens, (hidden,), eps=1e-6), shift_mlp, scale_mlp)
        mlp = _linear(F.gelu(_linear(h, sd, b + "mlp.fc1"), approximate="tanh"), sd, b + "mlp.fc2")
        tokens = tokens + gate_mlp[:, None] * mlp
    shift, scale = _linear(F.silu(c), sd, "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    tokens = _linear(_modulate(F.layer_norm(tokens, (hidden,), eps=1e-6), shift, scale), sd, "final_layer.linear")
    if order is not None:
        raster = torch.empty_like(tokens)
        raster[:, order] = tokens
        tokens = raster
    channels = tokens.shape[-1] // (patch * patch)
    out = tokens.reshape(x.shape[0], side, side, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", out).reshape(x.shape[0], channels, side * patch, side * patch)
