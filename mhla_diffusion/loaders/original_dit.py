"""Import original DiT checkpoints (facebookresearch/DiT) and released DiT-MHLA ones into Diffusers' DiT.

An original DiT state dict (``DiT-XL-2-256x256.pt``, or the ``"model"`` / ``"ema"`` entry of a
``train.py`` checkpoint) holds ``x_embedder.proj``, the fixed sin-cos ``pos_embed`` ``(1, N, C)``,
``t_embedder.mlp.{0,2}``, ``y_embedder.embedding_table`` ``(classes + 1, C)``, per block ``i``
``blocks.{i}.attn.{qkv,proj}``, ``blocks.{i}.mlp.fc{1,2}``, ``blocks.{i}.adaLN_modulation.1``, and
``final_layer.{linear,adaLN_modulation.1}``. The released DiT-MHLA model keeps those names but has,
in place of ``attn.qkv`` / ``attn.proj`` in every MHLA block:

* ``blocks.{i}.attn.norm.{weight,bias}``: LayerNorm of the attention input (our ``input_norm``),
* ``blocks.{i}.attn.to_qkv.{weight,bias}`` and ``blocks.{i}.attn.to_out.0.{weight,bias}``,
* ``blocks.{i}.attn.lepe.{weight,bias}``: depthwise 3x3 LePE on ``v``,
* ``blocks.{i}.attn.piece_attn.conv.weight`` ``(M, M, 1, 1)``: the block mixing ``W[o, j]``.

Where the two models differ from Diffusers' ``DiTTransformer2DModel``:

* Diffusers keeps one timestep + class embedder per block (``transformer_blocks.{i}.norm1.emb``);
  the checkpoint's single ``t_embedder`` / ``y_embedder`` is copied into every block.
* The chunk order of the modulations is the same (blocks: shift, scale, gate for attention then
  MLP; final layer: shift, scale), so ``adaLN_modulation.1`` maps to ``norm1.linear`` and the final
  one to ``proj_out_1`` unchanged. ``qkv`` splits into ``to_q``, ``to_k``, ``to_v`` in that order.
* Diffusers recomputes ``pos_embed`` (a buffer it does not save): the checkpoint's table is checked
  against it instead of loaded.
* The original pre-MLP LayerNorm has eps 1e-6 (Diffusers' default ``norm_eps`` is 1e-5), and the
  original timestep sinusoid divides by 128 frequencies where Diffusers divides by 127: the import
  sets ``norm_eps=1e-6`` and ``timestep_freq_shift=0``
  (:func:`~mhla_diffusion.models.transformers.set_timestep_freq_shift`), so the imported model computes what the
  original does.

The released DiT-MHLA model runs its tokens in block-major order; our processors keep Diffusers'
raster order and assign blocks by position, which for a layout that divides the token grid is the
same assignment (tokens are only permuted; every other layer works per token), so its weights map
one to one. Its layout follows from ``M`` and the grid: blocks of ``N / M`` tokens must be squares
that tile the ``S x S`` grid.

Every key is used or named in an error: a key no rule knows, a key the model its shapes describe
does not have, and a key that model needs but the checkpoint lacks.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any, Mapping

import torch

from ..config import MHLAConfig
from ..models.conversion import convert_to_mhla
from ..utils.dit_sizes import DIT_MODEL_SIZES, DiTModelSize, dit_model_size
from .weight_files import read_state_dict, strip_wrapper_prefix
from .weights import check_state_dict

__all__ = [
    "DIT_MODEL_SIZES",
    "DiTModelSize",
    "check_original_keys",
    "dit_model_size",
    "expected_original_keys",
    "load_original_dit",
    "original_dit_config",
    "read_dit_checkpoint",
    "rename_original_dit_keys",
    "select_weights",
]


# ----------------------------------------------------------------------------- reading

WEIGHTS = ("ema", "model")


def read_dit_checkpoint(path: str | os.PathLike, weights: str | None = None) -> dict[str, torch.Tensor]:
    """The state dict of an original DiT / DiT-MHLA checkpoint file.

    A ``.pt`` from ``train.py`` holds ``{"model", "ema", "opt", "args", ...}``: ``weights`` picks
    ``"ema"`` or ``"model"``; by default the EMA weights when the file has them (what DiT samples
    with), else the model's. A file that is itself a state dict (the released ``DiT-XL-2-256x256.pt``,
    or a ``.safetensors``) is read as it is; asking for ``weights`` there is an error.
    """
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"`weights` must be one of {WEIGHTS} or None, got {weights!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.endswith((".safetensors", ".pt", ".pth", ".bin", ".ckpt")):
        raise ValueError(f"unsupported checkpoint type {path!r}: expected .pt, .pth, .bin, .ckpt or .safetensors")
    # train.py checkpoints also hold their argparse.Namespace; allow that one class, nothing else.
    return read_state_dict(
        path, lambda data, where: _chosen_weights(data, weights, where), safe_globals=[argparse.Namespace]
    )


def select_weights(data: Any, weights: str | None = None, where: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """The state dict in ``data``: itself, or its ``"ema"`` / ``"model"`` (``"state_dict"``) entry, without
    the wrapper prefix its keys share."""
    return strip_wrapper_prefix(_chosen_weights(data, weights, where))


def _chosen_weights(data: Any, weights: str | None, where: str) -> Mapping[str, torch.Tensor]:
    """What :func:`select_weights` picks from ``data``, prefixes left on."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} holds a {type(data).__name__}, not a state dict")
    if any(isinstance(value, torch.Tensor) for value in data.values()):
        if weights is not None:
            raise ValueError(f"{where} is a plain state dict without 'ema' / 'model' entries; do not choose `weights`")
        return data
    entries = [key for key in ("ema", "model", "state_dict") if isinstance(data.get(key), Mapping)]
    if weights is not None:
        if weights not in entries:
            raise ValueError(f"{where} has no {weights!r} weights; it has {entries or sorted(map(str, data))}")
        chosen = weights
    elif entries:
        chosen = entries[0]
    else:
        raise ValueError(f"{where} holds no tensors at its top level nor under 'ema', 'model' or 'state_dict'")
    return data[chosen]


# ----------------------------------------------------------------------------- key rules

_B = r"blocks\.(\d+)\."
_T = r"transformer_blocks.\1."
# Keys outside the blocks, and per-block keys: (pattern, Diffusers name); ``\1``.. are the pattern's groups.
_RULES: list[tuple[str, str]] = [
    (r"x_embedder\.proj\.(weight|bias)", r"pos_embed.proj.\1"),
    (r"final_layer\.linear\.(weight|bias)", r"proj_out_2.\1"),
    (r"final_layer\.adaLN_modulation\.1\.(weight|bias)", r"proj_out_1.\1"),
    (_B + r"adaLN_modulation\.1\.(weight|bias)", _T + r"norm1.linear.\2"),
    (_B + r"mlp\.fc1\.(weight|bias)", _T + r"ff.net.0.proj.\2"),
    (_B + r"mlp\.fc2\.(weight|bias)", _T + r"ff.net.2.\2"),
    (_B + r"attn\.(?:proj|to_out\.0)\.(weight|bias)", _T + r"attn1.to_out.0.\2"),
    (_B + r"attn\.norm\.(weight|bias)", _T + r"attn1.processor.input_norm.\2"),
    (_B + r"attn\.lepe\.(weight|bias)", _T + r"attn1.processor.lepe.\2"),
    (_B + r"attn\.piece_attn\.conv\.weight", _T + r"attn1.processor.mixing"),
]
# One tensor shared by the whole model, copied into every block's ``norm1.emb``.
_SHARED_RULES: list[tuple[str, str]] = [
    (r"t_embedder\.mlp\.0\.(weight|bias)", r"norm1.emb.timestep_embedder.linear_1.\1"),
    (r"t_embedder\.mlp\.2\.(weight|bias)", r"norm1.emb.timestep_embedder.linear_2.\1"),
    (r"y_embedder\.embedding_table\.weight", r"norm1.emb.class_embedder.embedding_table.weight"),
]
_QKV = re.compile(_B + r"attn\.(?:qkv|to_qkv)\.(weight|bias)$")
_QK_NORM = re.compile(_B + r"attn\.[qk]_norm\.weight$")
_POS_EMBED = "pos_embed"
_COMPILED = [(re.compile(p + "$"), r) for p, r in _RULES]
_COMPILED_SHARED = [(re.compile(p + "$"), r) for p, r in _SHARED_RULES]

#: Per-block original keys of a softmax block and of a released DiT-MHLA block.
_COMMON_BLOCK_KEYS = [f"{m}.{p}" for m in ("adaLN_modulation.1", "mlp.fc1", "mlp.fc2") for p in ("weight", "bias")]
_SOFTMAX_BLOCK_KEYS = [f"attn.{m}.{p}" for m in ("qkv", "proj") for p in ("weight", "bias")]
_MHLA_BLOCK_KEYS = [f"attn.{m}.{p}" for m in ("norm", "to_qkv", "lepe", "to_out.0") for p in ("weight", "bias")] + [
    "attn.piece_attn.conv.weight"
]
_TOP_KEYS = (
    [_POS_EMBED]
    + [
        f"{m}.{p}"
        for m in (
            "x_embedder.proj",
            "t_embedder.mlp.0",
            "t_embedder.mlp.2",
            "final_layer.linear",
            "final_layer.adaLN_modulation.1",
        )
        for p in ("weight", "bias")
    ]
    + ["y_embedder.embedding_table.weight"]
)
#: Keys that mark a block as MHLA (the released model's attention).
_MHLA_MARKERS = re.compile(_B + r"attn\.(?:norm|to_qkv|lepe|piece_attn|to_out)\.")


def _block_indices(keys: Any) -> list[int]:
    return sorted({int(m.group(1)) for k in keys if (m := re.match(_B, k))})


def _mhla_blocks(keys: Any) -> list[int]:
    return sorted({int(m.group(1)) for k in keys if (m := _MHLA_MARKERS.match(k))})


def expected_original_keys(depth: int, mhla_blocks: list[int]) -> set[str]:
    """Every key of an original DiT of ``depth`` blocks whose ``mhla_blocks`` are released DiT-MHLA blocks."""
    keys = set(_TOP_KEYS)
    for i in range(depth):
        own = _MHLA_BLOCK_KEYS if i in mhla_blocks else _SOFTMAX_BLOCK_KEYS
        keys.update(f"blocks.{i}.{k}" for k in _COMMON_BLOCK_KEYS + own)
    return keys


def check_original_keys(state_dict: Mapping[str, torch.Tensor]) -> tuple[int, list[int]]:
    """``(depth, MHLA blocks)`` of an original DiT / DiT-MHLA state dict whose keys are exactly right.

    Raises ``ValueError`` naming q/k-norm keys (not supported), keys the original model does not
    have, and keys it needs that the checkpoint lacks.
    """
    qk_norm = sorted(k for k in state_dict if _QK_NORM.match(k))
    if qk_norm:
        raise ValueError(
            f"the checkpoint was trained with qk_norm ({qk_norm[:4]}{' ...' if len(qk_norm) > 4 else ''}); "
            "MHLA-DiT with q/k RMSNorm is not supported"
        )
    blocks = _block_indices(state_dict)
    if not blocks:
        raise ValueError("the checkpoint has no `blocks.{i}.` keys: is it an original DiT or DiT-MHLA checkpoint?")
    depth, mhla = blocks[-1] + 1, _mhla_blocks(state_dict)
    expected = expected_original_keys(depth, mhla)
    missing = sorted(expected - set(state_dict), key=_natural)
    unexpected = sorted(set(state_dict) - expected, key=_natural)
    found = [(label, keys) for label, keys in (("unknown keys", unexpected), ("missing keys", missing)) if keys]
    if found:
        kind = f"DiT-MHLA (MHLA blocks {mhla})" if mhla else "DiT"
        raise ValueError(
            f"the checkpoint is not an original {kind} of depth {depth}: "
            + "; ".join(f"{label} {keys}" for label, keys in found)
        )
    return depth, mhla


def _natural(key: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def rename_original_dit_keys(state_dict: Mapping[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Original DiT / DiT-MHLA keys -> Diffusers ``DiTTransformer2DModel`` (+ our processor) keys.

    ``qkv`` / ``to_qkv`` split into ``to_q``, ``to_k``, ``to_v``; the embedders are copied into each
    of the ``depth`` blocks; the mixing conv weight ``(M, M, 1, 1)`` becomes the ``(M, M)`` matrix;
    ``pos_embed`` is left out (Diffusers recomputes it, see :func:`load_original_dit`). Raises
    ``ValueError`` listing every key that matches no rule.
    """
    renamed: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        if key == _POS_EMBED:
            continue
        qkv = _QKV.match(key)
        if qkv:
            block, kind = qkv.groups()
            if value.shape[0] % 3:
                raise ValueError(f"{key} has {value.shape[0]} rows, not a multiple of 3 (q, k, v)")
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                renamed[f"transformer_blocks.{block}.attn1.to_{name}.{kind}"] = part
            continue
        for pattern, target in _COMPILED:
            match = pattern.match(key)
            if match:
                if key.endswith("piece_attn.conv.weight"):
                    if value.ndim != 4 or value.shape[2:] != (1, 1):
                        raise ValueError(f"{key} must be an (M, M, 1, 1) 1x1-conv weight, got {tuple(value.shape)}")
                    value = value.reshape(value.shape[0], value.shape[1])
                renamed[match.expand(target)] = value
                break
        else:
            for pattern, target in _COMPILED_SHARED:
                match = pattern.match(key)
                if match:
                    name = match.expand(target)
                    renamed.update({f"transformer_blocks.{i}.{name}": value for i in range(depth)})
                    break
            else:
                unknown.append(key)
    if unknown:
        raise ValueError(
            f"{len(unknown)} keys of the checkpoint match no original DiT or DiT-MHLA key: {sorted(unknown)}"
        )
    return renamed


# ----------------------------------------------------------------------------- config


def original_dit_config(
    state_dict: Mapping[str, torch.Tensor],
    *,
    model_size: str | None = None,
    num_heads: int | None = None,
    image_size: int | None = None,
    vae_scale_factor: int = 8,
) -> dict[str, Any]:
    """``DiTTransformer2DModel`` config of an original-format DiT state dict, read off its shapes.

    Heads are not in the shapes: give ``num_heads`` or ``model_size`` (``DiT-XL/2`` ...; checked
    against the shapes); without either, the one table size with this depth, width and patch gives
    them. ``image_size`` (pixels) is only checked: the token grid comes from ``pos_embed``.
    """
    try:
        patch = state_dict["x_embedder.proj.weight"]
        pos_embed = state_dict[_POS_EMBED]
        final = state_dict["final_layer.linear.weight"]
        table = state_dict["y_embedder.embedding_table.weight"]
    except KeyError as missing:
        raise ValueError(
            f"the checkpoint lacks {missing}, which every original DiT has: is it a DiT checkpoint?"
        ) from None
    if patch.ndim != 4 or patch.shape[2] != patch.shape[3]:
        raise ValueError(f"x_embedder.proj.weight must be a square-patch conv weight, got {tuple(patch.shape)}")
    hidden, in_channels, patch_size = patch.shape[0], patch.shape[1], patch.shape[2]
    blocks = _block_indices(state_dict)
    depth = blocks[-1] + 1 if blocks else 0
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1 or pos_embed.shape[2] != hidden:
        raise ValueError(f"pos_embed must be (1, N, {hidden}), got {tuple(pos_embed.shape)}")
    tokens = pos_embed.shape[1]
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"pos_embed has {tokens} tokens, not a square grid")
    sample_size = side * patch_size
    if image_size is not None and image_size != sample_size * vae_scale_factor:
        raise ValueError(
            f"the checkpoint's pos_embed is for {side}x{side} tokens of patch {patch_size}, i.e. {sample_size}x"
            f"{sample_size} latents = {sample_size * vae_scale_factor} px, not image size {image_size}"
        )
    if final.shape[0] % (patch_size * patch_size):
        raise ValueError(
            f"final_layer.linear.weight has {final.shape[0]} rows, not a multiple of patch^2 = {patch_size**2}"
        )
    out_channels = final.shape[0] // (patch_size * patch_size)
    heads = _num_heads(depth, hidden, patch_size, model_size, num_heads)
    return dict(
        num_attention_heads=heads,
        attention_head_dim=hidden // heads,
        in_channels=in_channels,
        out_channels=out_channels,
        num_layers=depth,
        sample_size=sample_size,
        patch_size=patch_size,
        num_embeds_ada_norm=table.shape[0] - 1,  # the last row is the class-dropout (null) label
        norm_eps=1e-6,  # the original pre-MLP LayerNorm
    )


def _num_heads(depth: int, hidden: int, patch: int, model_size: str | None, num_heads: int | None) -> int:
    shape = f"depth {depth}, hidden size {hidden}, patch {patch}"
    if model_size is not None:
        size = dit_model_size(model_size)
        if (size.depth, size.hidden_size, size.patch_size) != (depth, hidden, patch):
            raise ValueError(
                f"{model_size} has depth {size.depth}, hidden size {size.hidden_size}, patch {size.patch_size}; "
                f"the checkpoint has {shape}"
            )
        if num_heads is not None and num_heads != size.num_heads:
            raise ValueError(f"{model_size} has {size.num_heads} heads, not --num-heads {num_heads}")
        heads = size.num_heads
    elif num_heads is not None:
        heads = num_heads
    else:
        fits = {
            s.num_heads: name
            for name, s in DIT_MODEL_SIZES.items()
            if (s.depth, s.hidden_size, s.patch_size) == (depth, hidden, patch)
        }
        if len(fits) != 1:
            which = f"sizes {sorted(fits.values())} fit" if fits else "no DiT size fits"
            raise ValueError(
                f"the number of heads is not in the checkpoint ({shape}; {which}): pass num_heads or model_size"
            )
        heads = next(iter(fits))
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden size {hidden} does not split into {heads} heads")
    return heads


def _mhla_config(renamed: Mapping[str, torch.Tensor], mhla_blocks: list[int], side: int) -> MHLAConfig:
    """The :meth:`MHLAConfig.released_dit` setting of the checkpoint, with the layout its mixing implies."""
    sizes = {tuple(renamed[f"transformer_blocks.{i}.attn1.processor.mixing"].shape) for i in mhla_blocks}
    if len(sizes) != 1 or len(next(iter(sizes))) != 2 or len(set(next(iter(sizes)))) != 1:
        raise ValueError(f"the MHLA blocks' mixing matrices must all be M x M with one M, got {sorted(sizes)}")
    blocks = next(iter(sizes))[0]
    tokens = side * side
    per_block = tokens // blocks
    block_side = math.isqrt(per_block)
    if tokens % blocks or block_side * block_side != per_block or side % block_side:
        raise ValueError(
            f"a {blocks}x{blocks} mixing does not split the {side}x{side} token grid into equal square blocks "
            f"(the released DiT-MHLA needs N / M = {tokens}/{blocks} to be a square that tiles the grid)"
        )
    grid_blocks = side // block_side
    return MHLAConfig.released_dit(layers=list(mhla_blocks), layout=(grid_blocks, grid_blocks))


# ----------------------------------------------------------------------------- import


def load_original_dit(
    checkpoint: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    model_size: str | None = None,
    num_heads: int | None = None,
    image_size: int | None = None,
    weights: str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """Build a Diffusers DiT from an original DiT or released DiT-MHLA checkpoint (file or state dict).

    Args:
        checkpoint: a ``.pt`` / ``.safetensors`` file, or its state dict (or a ``train.py`` dict
            with ``"ema"`` / ``"model"`` entries).
        model_size, num_heads: the head count (see :func:`original_dit_config`).
        image_size: pixels, checked against the checkpoint's token grid (VAE factor 8).
        weights: ``"ema"`` or ``"model"`` of a ``train.py`` checkpoint (default: EMA when present).
        dtype: cast the model after loading (the checkpoint's own float32 otherwise).

    Returns a plain ``DiTTransformer2DModel`` for an original DiT, and a
    :class:`~mhla_diffusion.models.transformers.MHLADiTTransformer2DModel` converted with
    :meth:`MHLAConfig.released_dit` (mixing, input LayerNorm and LePE from the checkpoint) for a
    DiT-MHLA one; in eval mode, computing what the original model computes.
    """
    from diffusers import DiTTransformer2DModel

    from ..models.transformers import MHLADiTTransformer2DModel, set_timestep_freq_shift

    if isinstance(checkpoint, (str, os.PathLike)):
        state_dict = read_dit_checkpoint(checkpoint, weights)
    else:
        state_dict = select_weights(checkpoint, weights)
    depth, mhla_blocks = check_original_keys(state_dict)
    config = original_dit_config(state_dict, model_size=model_size, num_heads=num_heads, image_size=image_size)
    renamed = rename_original_dit_keys(state_dict, depth)
    cls = MHLADiTTransformer2DModel if mhla_blocks else DiTTransformer2DModel
    transformer = cls(**config)
    set_timestep_freq_shift(transformer, 0)
    _check_pos_embed(state_dict[_POS_EMBED], transformer.pos_embed.pos_embed)
    if mhla_blocks:
        side = config["sample_size"] // config["patch_size"]
        convert_to_mhla(transformer, _mhla_config(renamed, mhla_blocks, side))
    check_state_dict(transformer.state_dict(), renamed, "the checkpoint does not fit the DiT its shapes describe")
    transformer.load_state_dict(renamed, strict=True)
    if dtype is not None:
        transformer.to(dtype)
    return transformer.eval()


def _check_pos_embed(given: torch.Tensor, computed: torch.Tensor) -> None:
    """The checkpoint's fixed ``pos_embed`` must be the sin-cos table Diffusers recomputes (to float32 rounding)."""
    if given.shape != computed.shape:
        raise ValueError(f"pos_embed {tuple(given.shape)} does not fit the model's {tuple(computed.shape)}")
    error = (given.double() - computed.double()).abs().max().item()
    if not error <= 1e-5:
        raise ValueError(
            f"the checkpoint's pos_embed differs from the fixed 2-D sin-cos table by up to {error:.3g}; "
            "Diffusers' DiT cannot hold a learned or different positional embedding"
        )
