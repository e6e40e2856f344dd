"""Import Wan checkpoints in the original (non-Diffusers) key format, with or without MHLA layers.

The checkpoint released with the MHLA paper keeps Wan's own key names (``blocks.{i}.self_attn.q``,
``ffn.0``, ``head.head``, ...) and adds, per MHLA layer ``i``:

* ``blocks.{i}.self_attn.block_attn.conv.weight`` ``(M, M, 1, 1)``: the block-mixing matrix,
* ``blocks.{i}.self_attn.g_norm.weight`` ``(head_dim,)``: per-head output RMSNorm,
* ``blocks.{i}.self_attn.g.{weight,bias}``: SiLU gate (only in gated runs),
* ``blocks.{i}.self_attn.lepe.{weight,bias}``: depthwise 3x3x3 LePE (only with LePE).

Every key is mapped by an anchored rule (no substring replacement that could mangle new names);
a key no rule knows, or a parameter the model needs that the file lacks, is an error listing them.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping, Sequence

import torch

from .config import MHLAConfig
from .conversion import convert_to_mhla
from .weights import check_state_dict

__all__ = ["load_original_wan", "original_wan_config", "read_checkpoint", "rename_original_wan_keys"]

_B = r"blocks\.(\d+)\."
# (pattern, Diffusers name); ``\1``.. refer to the pattern's groups.
_BASE_RULES: list[tuple[str, str]] = [
    (r"patch_embedding\.(weight|bias)", r"patch_embedding.\1"),
    (r"text_embedding\.0\.(weight|bias)", r"condition_embedder.text_embedder.linear_1.\1"),
    (r"text_embedding\.2\.(weight|bias)", r"condition_embedder.text_embedder.linear_2.\1"),
    (r"time_embedding\.0\.(weight|bias)", r"condition_embedder.time_embedder.linear_1.\1"),
    (r"time_embedding\.2\.(weight|bias)", r"condition_embedder.time_embedder.linear_2.\1"),
    (r"time_projection\.1\.(weight|bias)", r"condition_embedder.time_proj.\1"),
    (r"head\.head\.(weight|bias)", r"proj_out.\1"),
    (r"head\.modulation", r"scale_shift_table"),
    (_B + r"modulation", r"blocks.\1.scale_shift_table"),
    (_B + r"self_attn\.(q|k|v)\.(weight|bias)", r"blocks.\1.attn1.to_\2.\3"),
    (_B + r"self_attn\.o\.(weight|bias)", r"blocks.\1.attn1.to_out.0.\2"),
    (_B + r"self_attn\.norm_(q|k)\.weight", r"blocks.\1.attn1.norm_\2.weight"),
    (_B + r"cross_attn\.(q|k|v)\.(weight|bias)", r"blocks.\1.attn2.to_\2.\3"),
    (_B + r"cross_attn\.o\.(weight|bias)", r"blocks.\1.attn2.to_out.0.\2"),
    (_B + r"cross_attn\.norm_(q|k)\.weight", r"blocks.\1.attn2.norm_\2.weight"),
    (_B + r"norm3\.(weight|bias)", r"blocks.\1.norm2.\2"),  # cross-attention LayerNorm
    (_B + r"ffn\.0\.(weight|bias)", r"blocks.\1.ffn.net.0.proj.\2"),
    (_B + r"ffn\.2\.(weight|bias)", r"blocks.\1.ffn.net.2.\2"),
]
_MHLA_RULES: list[tuple[str, str]] = [
    (_B + r"self_attn\.block_attn\.conv\.weight", r"blocks.\1.attn1.processor.mixing"),
    (_B + r"self_attn\.g_norm\.weight", r"blocks.\1.attn1.processor.out_norm.weight"),
    (_B + r"self_attn\.g\.(weight|bias)", r"blocks.\1.attn1.processor.gate.\2"),
    (_B + r"self_attn\.lepe\.(weight|bias)", r"blocks.\1.attn1.processor.lepe.\2"),
]
_RULES = [(re.compile(p + "$"), r) for p, r in _BASE_RULES + _MHLA_RULES]
_WRAPPER_KEYS = ("state_dict", "model", "module", "ema")
_PREFIXES = ("module.", "model.", "_orig_mod.")


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` or ``.pt``/``.pth``/``.bin`` checkpoint (unwrapping ``{"state_dict": ...}``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    if not path.endswith((".pt", ".pth", ".bin", ".ckpt")):
        raise ValueError(f"unsupported checkpoint type {path!r}: expected .safetensors, .pt, .pth, .bin or .ckpt")
    data = torch.load(path, map_location="cpu", weights_only=True)
    while isinstance(data, Mapping) and not any(isinstance(v, torch.Tensor) for v in data.values()):
        inner = next((data[k] for k in _WRAPPER_KEYS if isinstance(data.get(k), Mapping)), None)
        if inner is None:
            raise ValueError(f"{path} holds no tensors at its top level nor under {list(_WRAPPER_KEYS)}")
        data = inner
    return dict(data)


def _strip_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a wrapper prefix (``module.`` from DDP, ``model.``, ``_orig_mod.``) that every key shares."""
    for prefix in _PREFIXES:
        if state_dict and all(key.startswith(prefix) for key in state_dict):
            return _strip_prefix({key[len(prefix):]: value for key, value in state_dict.items()})
    return state_dict


def rename_original_wan_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan (+ MHLA) keys -> Diffusers ``WanTransformer3DModel`` (+ our processor) keys.

    The mixing conv weight ``(M, M, 1, 1)`` becomes the processor's ``(M, M)`` matrix. Raises
    ``ValueError`` listing every key that matches no rule.
    """
    renamed: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in _strip_prefix(dict(state_dict)).items():
        for pattern, target in _RULES:
            match = pattern.match(key)
            if match:
                new_key = match.expand(target)
                if new_key.endswith("processor.mixing"):
                    value = value.reshape(value.shape[0], value.shape[1])
                renamed[new_key] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{len(unknown)} keys of the checkpoint match no original-Wan or MHLA key: {sorted(unknown)}")
    return renamed


def original_wan_config(
    state_dict: Mapping[str, torch.Tensor], attention_head_dim: int = 128, **overrides: Any
) -> dict[str, Any]:
    """``WanTransformer3DModel`` config read off tensor shapes of a (renamed) state dict.

    Shapes fix everything but the head split; Wan uses ``attention_head_dim=128`` at every size.
    """
    try:
        patch = state_dict["patch_embedding.weight"]
        inner, in_channels = patch.shape[:2]
        patch_size = tuple(patch.shape[2:])
        config = dict(
            patch_size=patch_size,
            num_attention_heads=inner // attention_head_dim,
            attention_head_dim=attention_head_dim,
            in_channels=in_channels,
            out_channels=state_dict["proj_out.weight"].shape[0] // math.prod(patch_size),
            text_dim=state_dict["condition_embedder.text_embedder.linear_1.weight"].shape[1],
            freq_dim=state_dict["condition_embedder.time_embedder.linear_1.weight"].shape[1],
            ffn_dim=state_dict["blocks.0.ffn.net.0.proj.weight"].shape[0],
            num_layers=1 + max(int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")),
            cross_attn_norm="blocks.0.norm2.weight" in state_dict,
            qk_norm="rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in state_dict else None,
            eps=1e-6,
        )
    except KeyError as missing:
        raise ValueError(f"the checkpoint lacks {missing}, which every Wan transformer has: is it a Wan T2V checkpoint?") from None
    if inner % attention_head_dim:
        raise ValueError(f"inner dim {inner} does not split into heads of {attention_head_dim}; pass attention_head_dim")
    config.update(overrides)
    return config


def _mhla_config(renamed: Mapping[str, torch.Tensor], layout: Sequence[int] | None) -> MHLAConfig | None:
    """The released-setting :class:`MHLAConfig` the checkpoint's MHLA keys describe (``None`` if none)."""
    layers = sorted({int(k.split(".")[1]) for k in renamed if k.endswith("processor.mixing")})
    if not layers:
        stray = sorted(k for k in renamed if ".processor." in k)
        if stray:
            raise ValueError(f"MHLA keys without a block_attn.conv.weight mixing matrix: {stray}")
        return None

    def present(name: str) -> bool:
        found = [f"blocks.{i}.attn1.processor.{name}" in renamed for i in layers]
        if any(found) and not all(found):
            absent = [i for i, f in zip(layers, found) if not f]
            raise ValueError(f"MHLA layers {absent} lack `{name}` that the other MHLA layers have")
        return all(found)

    blocks = renamed[f"blocks.{layers[0]}.attn1.processor.mixing"].shape[0]
    if layout is None:
        if blocks != 150:
            raise ValueError(f"the checkpoint's mixing has {blocks} blocks; pass the block layout it was trained with")
        layout = (3, 5, 10)  # the released layout on the 21x30x50 grid
    if math.prod(layout) != blocks:
        raise ValueError(f"`layout` {tuple(layout)} has {math.prod(layout)} blocks but the checkpoint's mixing has {blocks}")
    return MHLAConfig.released_wan(
        gate=present("gate.weight"), layers=layers, layout=tuple(layout), output_norm=present("out_norm.weight"),
        lepe=present("lepe.weight"),
    )


def load_original_wan(
    checkpoint: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    layout: Sequence[int] | None = None,
    attention_head_dim: int = 128,
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """Build a Diffusers Wan transformer from an original-format checkpoint (file or state dict).

    MHLA layers are read from the keys: the layers that have ``block_attn.conv.weight`` become MHLA
    with the released setting (no denominator, per-head output RMSNorm, gate and LePE where their
    keys exist, mixing from the checkpoint). ``layout`` defaults to the released 3x5x10 when the
    mixing is 150x150. A checkpoint without MHLA keys gives a plain Wan transformer. Returns a
    :class:`MHLAWanTransformer3DModel` (so ``save_pretrained`` keeps MHLA) in eval mode.
    """
    from .models import MHLAWanTransformer3DModel

    state_dict = read_checkpoint(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else dict(checkpoint)
    renamed = rename_original_wan_keys(state_dict)
    mhla_config = _mhla_config(renamed, layout)
    config = original_wan_config(renamed, attention_head_dim=attention_head_dim, **config_overrides)
    transformer = MHLAWanTransformer3DModel(**config)
    if mhla_config is not None:
        convert_to_mhla(transformer, mhla_config)
    check_state_dict(transformer.state_dict(), renamed, "the checkpoint does not fit the Wan transformer its shapes describe")
    transformer.load_state_dict(renamed, strict=True)
    if dtype is not None:
        transformer.to(dtype)
    return transformer.eval()
