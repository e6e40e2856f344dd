"""Import Wan checkpoints in the original (non-Diffusers) key format, with or without MHLA layers.

Which checkpoints: every Wan2.1 / Wan2.2 transformer in the original format -- T2V 1.3B and 14B,
I2V-14B (480P / 720P), FLF2V-14B, the two transformers of Wan2.2-A14B (one file or folder each) and
TI2V-5B -- as one ``.safetensors`` file, a sharded one (its folder or ``*.safetensors.index.json``)
or a ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` file. The model config is read off the tensors'
shapes and keys (:func:`original_wan_config`), or given (e.g. from :mod:`mhla_diffusion.utils.wan_configs`).

Original names (``blocks.{i}.self_attn.q``, ``ffn.0``, ``head.head``, ...) map one to one onto
Diffusers' ``WanTransformer3DModel``; image-to-video models add ``img_emb.proj.{0,1,3,4}`` (the CLIP
image-embedding MLP -> ``condition_embedder.image_embedder.{norm1, ff.net.0.proj, ff.net.2, norm2}``),
FLF2V ``img_emb.emb_pos`` (-> ``condition_embedder.image_embedder.pos_embed``), and every block's
image cross-attention ``cross_attn.{k_img, v_img, norm_k_img}`` (-> ``attn2.{add_k_proj, add_v_proj,
norm_added_k}``). The checkpoint released with the MHLA paper adds, per MHLA layer ``i``:

* ``blocks.{i}.self_attn.block_attn.conv.weight`` ``(M, M, 1, 1)``: the block-mixing matrix,
* ``blocks.{i}.self_attn.g_norm.weight`` ``(head_dim,)``: per-head output RMSNorm,
* ``blocks.{i}.self_attn.g.{weight,bias}``: SiLU gate (only in gated runs),
* ``blocks.{i}.self_attn.lepe.{weight,bias}``: depthwise 3x3x3 LePE (only with LePE).

Strict accounting: every key is mapped by an anchored rule (no substring replacement that could
mangle new names) and used exactly once; a key no rule knows, a parameter the model needs that the
file lacks, a key the model does not have and a wrong shape are one error listing them.

Memory: files are memory-mapped, the transformer is built on the meta device and takes the file's
tensors as its parameters (``load_state_dict(assign=True)``), so an import in the file's dtype holds
no second copy of the weights, and one in another dtype converts each tensor straight to it.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..config import MHLAConfig
from ..models.conversion import MHLA_CONFIG_KEY, convert_to_mhla
from .weight_files import dtype_on_load, read_state_dict, strip_wrapper_prefix
from .weights import check_state_dict

__all__ = [
    "checkpoint_files",
    "empty_original_wan",
    "empty_wan_transformer",
    "load_original_wan",
    "original_wan_config",
    "read_checkpoint",
    "rename_original_wan_keys",
]

_B = r"blocks\.(\d+)\."
_IMG = "condition_embedder.image_embedder."
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
# Image-to-video (Wan2.1 I2V / FLF2V): the CLIP image-embedding MLP and the image cross-attention.
_IMAGE_RULES: list[tuple[str, str]] = [
    (r"img_emb\.proj\.0\.(weight|bias)", _IMG + r"norm1.\1"),
    (r"img_emb\.proj\.1\.(weight|bias)", _IMG + r"ff.net.0.proj.\1"),
    (r"img_emb\.proj\.3\.(weight|bias)", _IMG + r"ff.net.2.\1"),
    (r"img_emb\.proj\.4\.(weight|bias)", _IMG + r"norm2.\1"),
    (r"img_emb\.emb_pos", _IMG + "pos_embed"),
    (_B + r"cross_attn\.(k|v)_img\.(weight|bias)", r"blocks.\1.attn2.add_\2_proj.\3"),
    (_B + r"cross_attn\.norm_k_img\.weight", r"blocks.\1.attn2.norm_added_k.weight"),
]
_MHLA_RULES: list[tuple[str, str]] = [
    (_B + r"self_attn\.block_attn\.conv\.weight", r"blocks.\1.attn1.processor.mixing"),
    (_B + r"self_attn\.g_norm\.weight", r"blocks.\1.attn1.processor.out_norm.weight"),
    (_B + r"self_attn\.g\.(weight|bias)", r"blocks.\1.attn1.processor.gate.\2"),
    (_B + r"self_attn\.lepe\.(weight|bias)", r"blocks.\1.attn1.processor.lepe.\2"),
]
_RULES = [(re.compile(p + "$"), r) for p, r in _BASE_RULES + _IMAGE_RULES + _MHLA_RULES]
_WRAPPER_KEYS = ("state_dict", "model", "module", "ema")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_INDEX_SUFFIX = ".safetensors.index.json"
#: Config fields the tensors' shapes and keys fix (the head split, ``eps`` and ``rope_max_seq_len`` they do not).
_SHAPE_FIELDS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "cross_attn_norm",
    "qk_norm",
    "image_dim",
    "added_kv_proj_dim",
    "pos_embed_seq_len",
)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files of a checkpoint: one file, the shards an ``*.safetensors.index.json`` names, or a folder's
    (its one index's shards, else every ``*.safetensors`` in it). Raises naming what is missing or ambiguous."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        indexes = sorted(path.glob("*" + _INDEX_SUFFIX))
        if len(indexes) > 1:
            raise ValueError(f"{path} holds several shard indexes {[i.name for i in indexes]}; pass the one to import")
        if indexes:
            return checkpoint_files(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} holds no .safetensors files nor a shard index; pass the checkpoint file itself")
        return files
    if path.name.endswith(_INDEX_SUFFIX):
        weight_map = _index_weight_map(path)
        files = [path.parent / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"shards named in {path} are missing from {path.parent}: {absent}")
        return files
    if path.suffix == ".safetensors" or path.suffix in _TORCH_SUFFIXES:
        return [path]
    raise ValueError(
        f"unsupported checkpoint {str(path)!r}: expected a .safetensors file, a sharded checkpoint's folder or "
        f"{_INDEX_SUFFIX}, or a {', '.join(_TORCH_SUFFIXES)} file"
    )


def _index_weight_map(index: Path) -> dict[str, str]:
    """``{key: shard file name}`` of a safetensors shard index."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{index} is not a safetensors shard index (no 'weight_map'): {error}") from None
    return dict(weight_map)


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Memory-mapped tensors of a checkpoint (see :func:`checkpoint_files` for what ``path`` may be).

    Nothing is read until used: ``.safetensors`` files through ``safe_open``, ``.pt``-style files with
    ``torch.load(mmap=True, weights_only=True)`` (unwrapping ``{"state_dict": ...}``, ``"model"``,
    ``"module"`` or ``"ema"``; a file in the legacy non-zip format is read whole, with a warning).
    A key in two shards, or shards that disagree with their index, is an error.
    """
    path = Path(path)
    files = checkpoint_files(path)
    tensors: dict[str, torch.Tensor] = {}
    duplicates: list[str] = []
    for file in files:
        for key, value in _read_file(file).items():
            if key in tensors:
                duplicates.append(f"{key} ({file.name})")
            tensors[key] = value
    if duplicates:
        raise ValueError(
            f"{len(duplicates)} keys occur in more than one of {[f.name for f in files]}: {sorted(duplicates)}"
        )
    index = next(iter(sorted(path.glob("*" + _INDEX_SUFFIX))), None) if path.is_dir() else path
    if index is not None and index.name.endswith(_INDEX_SUFFIX):
        listed = set(strip_wrapper_prefix(_index_weight_map(index)))  # the shards' keys lose their prefix too
        if listed != set(tensors):
            raise ValueError(
                f"the shards disagree with {index.name}: listed but absent {sorted(listed - set(tensors))}, "
                f"present but not listed {sorted(set(tensors) - listed)}"
            )
    return tensors


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file, memory-mapped where the format allows."""
    return read_state_dict(file, _unwrap)


def _unwrap(data: Any, where: str) -> Any:
    """The state dict inside ``data``: itself, or what :data:`_WRAPPER_KEYS` hold (nested ones too)."""
    while isinstance(data, Mapping) and not any(isinstance(v, torch.Tensor) for v in data.values()):
        inner = next((data[k] for k in _WRAPPER_KEYS if isinstance(data.get(k), Mapping)), None)
        if inner is None:
            raise ValueError(f"{where} holds no tensors at its top level nor under {list(_WRAPPER_KEYS)}")
        data = inner
    return data


def rename_original_wan_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan (+ I2V, + MHLA) keys -> Diffusers ``WanTransformer3DModel`` (+ our processor) keys.

    The mixing conv weight ``(M, M, 1, 1)`` becomes the processor's ``(M, M)`` matrix (a view, no
    copy). Raises ``ValueError`` listing every key that matches no rule.
    """
    renamed: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in strip_wrapper_prefix(state_dict).items():
        for pattern, target in _RULES:
            match = pattern.match(key)
            if match:
                new_key = match.expand(target)
                if new_key.endswith("processor.mixing") and value.dim() == 4:
                    value = value.reshape(value.shape[0], value.shape[1])
                # one-to-one: every rule keeps all its captured groups and no two rules share a target
                renamed[new_key] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"{len(unknown)} keys of the checkpoint match no original-Wan (T2V, I2V) or MHLA key: {sorted(unknown)}"
        )
    return renamed


def _first_block_tensor(state_dict: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """``blocks.{i}.<name>`` of the lowest block ``i`` that has it, or ``None``."""
    pattern = re.compile(_B + re.escape(name) + "$")
    found = [(int(m.group(1)), key) for key in state_dict if (m := pattern.match(key))]
    return state_dict[min(found)[1]] if found else None


def original_wan_config(
    state_dict: Mapping[str, torch.Tensor], attention_head_dim: int | None = None, **overrides: Any
) -> dict[str, Any]:
    """``WanTransformer3DModel`` keywords read off the tensor shapes and keys of a (renamed) state dict.

    Shapes fix everything but the head split (``attention_head_dim``, 128 for every Wan model),
    ``eps`` (1e-6) and ``rope_max_seq_len`` (1024), which take Wan's values unless overridden.
    Image conditioning: ``image_dim`` from ``image_embedder.norm1`` ``(image_dim,)``,
    ``added_kv_proj_dim`` from ``attn2.add_k_proj.weight`` ``(inner, added_kv_proj_dim)``,
    ``pos_embed_seq_len`` from ``image_embedder.pos_embed`` ``(1, L, image_dim)``; ``None`` without them.
    """
    head_dim = 128 if attention_head_dim is None else int(attention_head_dim)
    try:
        patch = state_dict["patch_embedding.weight"]
        inner, in_channels = patch.shape[:2]
        patch_size = tuple(patch.shape[2:])
        ffn = _first_block_tensor(state_dict, "ffn.net.0.proj.weight")
        if ffn is None:
            raise KeyError("blocks.0.ffn.0.weight")
        added_k = _first_block_tensor(state_dict, "attn2.add_k_proj.weight")
        image_norm = state_dict.get(_IMG + "norm1.weight")
        pos_embed = state_dict.get(_IMG + "pos_embed")
        config = dict(
            patch_size=patch_size,
            num_attention_heads=inner // head_dim,
            attention_head_dim=head_dim,
            in_channels=in_channels,
            out_channels=state_dict["proj_out.weight"].shape[0] // math.prod(patch_size),
            text_dim=state_dict["condition_embedder.text_embedder.linear_1.weight"].shape[1],
            freq_dim=state_dict["condition_embedder.time_embedder.linear_1.weight"].shape[1],
            ffn_dim=ffn.shape[0],
            num_layers=1 + max(int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")),
            cross_attn_norm=_first_block_tensor(state_dict, "norm2.weight") is not None,
            qk_norm="rms_norm_across_heads"
            if _first_block_tensor(state_dict, "attn1.norm_q.weight") is not None
            else None,
            eps=1e-6,
            image_dim=None if image_norm is None else image_norm.shape[0],
            added_kv_proj_dim=None if added_k is None else added_k.shape[1],
            rope_max_seq_len=1024,
            pos_embed_seq_len=None if pos_embed is None else pos_embed.shape[1],
        )
    except KeyError as missing:
        raise ValueError(
            f"the checkpoint lacks {missing}, which every Wan transformer has: is it a Wan checkpoint?"
        ) from None
    if inner % head_dim:
        raise ValueError(f"inner dim {inner} does not split into heads of {head_dim}; pass attention_head_dim")
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
        raise ValueError(
            f"`layout` {tuple(layout)} has {math.prod(layout)} blocks but the checkpoint's mixing has {blocks}"
        )
    return MHLAConfig.released_wan(
        gate=present("gate.weight"),
        layers=layers,
        layout=tuple(layout),
        output_norm=present("out_norm.weight"),
        lepe=present("lepe.weight"),
    )


def empty_wan_transformer(config: Mapping[str, Any], mhla_config: MHLAConfig | None = None) -> torch.nn.Module:
    """A :class:`MHLAWanTransformer3DModel` of ``config`` whose parameters are on the meta device.

    Takes no memory for parameters (a full-size 14B model builds in well under a second); the
    non-persistent buffers (RoPE tables, ``(1024, head_dim)``-sized) are real. With ``mhla_config``
    the chosen layers are converted, their new parameters on the meta device too. Fill it with
    ``load_state_dict(state_dict, assign=True)``.
    """
    from accelerate import init_empty_weights

    from ..models.transformers import MHLAWanTransformer3DModel

    with init_empty_weights(include_buffers=False):
        transformer = MHLAWanTransformer3DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    if mhla_config is not None:
        convert_to_mhla(transformer, mhla_config)
    return transformer


def _normalized(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _model_config(
    renamed: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | None,
    attention_head_dim: int | None,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """The config to build: inferred from the tensors, or ``config`` (checked against what the tensors fix)."""
    if config is None:
        return original_wan_config(renamed, attention_head_dim=attention_head_dim, **overrides)
    # config.json's `_class_name`, ... and the MHLA entry of a converted model's config: the checkpoint decides MHLA
    model_config = {k: v for k, v in config.items() if not k.startswith("_") and k != MHLA_CONFIG_KEY}
    model_config.update(overrides)
    given_head_dim = model_config.get("attention_head_dim", 128)
    if attention_head_dim is not None and attention_head_dim != given_head_dim:
        raise ValueError(f"attention_head_dim {attention_head_dim} contradicts the given config's {given_head_dim}")
    try:
        inferred = original_wan_config(
            renamed, attention_head_dim=1
        )  # the shape fields; the head split is checked below
    except ValueError:
        return model_config  # the strict key check names what is missing
    differ = [
        f"{k}: checkpoint {inferred[k]!r}, config {model_config[k]!r}"
        for k in _SHAPE_FIELDS
        if k in model_config and _normalized(model_config[k]) != _normalized(inferred[k])
    ]
    heads, width = model_config.get("num_attention_heads"), renamed["patch_embedding.weight"].shape[0]
    if heads is not None and heads * given_head_dim != width:
        differ.append(f"width: checkpoint {width}, config {heads} heads x {given_head_dim}")
    if differ:
        raise ValueError(
            f"the checkpoint does not fit the given config ({'; '.join(differ)}); "
            "give the config of the model the checkpoint was trained as, or none to infer it"
        )
    return model_config


def empty_original_wan(
    renamed: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    layout: Sequence[int] | None = None,
    attention_head_dim: int | None = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """The meta-device transformer (MHLA layers included) that a renamed original checkpoint fills exactly.

    ``renamed`` is :func:`rename_original_wan_keys`' output (its tensors may be on the meta device:
    only keys and shapes are read). Raises ``ValueError`` listing missing, unexpected and wrongly
    shaped keys, before any weight is read.
    """
    mhla_config = _mhla_config(renamed, layout)
    model_config = _model_config(renamed, config, attention_head_dim, config_overrides)
    transformer = empty_wan_transformer(model_config, mhla_config)
    described_by = "its shapes describe" if config is None else "its shapes and the given config describe"
    check_state_dict(
        transformer.state_dict(), dict(renamed), f"the checkpoint does not fit the Wan transformer {described_by}"
    )
    return transformer


def _cast(
    renamed: Mapping[str, torch.Tensor], dtype: torch.dtype | None, transformer: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Floating tensors in the dtype ``from_pretrained(dtype=dtype)`` gives them in ``transformer``
    (:func:`~mhla_diffusion.loaders.weight_files.dtype_on_load`), each converted on its own straight from the
    file; ``None``: unchanged."""
    if dtype is None:
        return dict(renamed)
    return {
        key: value.to(dtype_on_load(transformer, key, dtype)) if value.is_floating_point() else value
        for key, value in renamed.items()
    }


def load_original_wan(
    checkpoint: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    layout: Sequence[int] | None = None,
    attention_head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """Build a Diffusers Wan transformer from an original-format checkpoint (path or state dict).

    The model config is read off the tensors (:func:`original_wan_config`; T2V, I2V, FLF2V, TI2V), or
    taken from ``config`` (e.g. :func:`mhla_diffusion.utils.wan_configs.wan_transformer_config`), which must
    agree with the tensors. MHLA layers are read from the keys: the layers that have
    ``block_attn.conv.weight`` become MHLA with the released setting (no denominator, per-head
    output RMSNorm, gate and LePE where their keys exist, mixing from the checkpoint). ``layout``
    defaults to the released 3x5x10 when the mixing is 150x150. A checkpoint without MHLA keys gives
    a plain Wan transformer.

    Lean: the file is memory-mapped and its tensors become the parameters without a copy when
    ``dtype`` is ``None`` (the checkpoint's dtypes are kept) or equal to theirs; otherwise each
    tensor is converted straight to ``dtype`` (float32 for Diffusers' ``_keep_in_fp32_modules``:
    norms, time embedder, modulation tables). A state dict passed in is not copied either: its
    tensors become the model's. Returns a :class:`MHLAWanTransformer3DModel` (so
    ``save_pretrained`` keeps MHLA) in eval mode.
    """
    state_dict = read_checkpoint(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else dict(checkpoint)
    renamed = rename_original_wan_keys(state_dict)
    transformer = empty_original_wan(
        renamed, config=config, layout=layout, attention_head_dim=attention_head_dim, **config_overrides
    )
    transformer.load_state_dict(_cast(renamed, dtype, transformer), strict=True, assign=True)
    left = [name for name, t in (*transformer.named_parameters(), *transformer.named_buffers()) if t.is_meta]
    if left:  # cannot happen after the strict check; guards against a module with unsaved parameters
        raise RuntimeError(f"the import left tensors without data (meta device): {left}")
    return transformer.eval()
