"""``mhla bench --families``: each family's self-attention at its published default size, MHLA beside SDPA and
global linear attention on the same random inputs.

One row per family: the published model's heads and head width, its default video (or image) size's token grid
(:meth:`~mhla_diffusion.models.families.ModelFamily.default_grid`), the block layout a default ``MHLAConfig()``
chooses for it, and for the joint families (HunyuanVideo, CogVideoX, Flux) the text tokens that join the sequence:
SDPA attends over image + text tokens, MHLA is :func:`~mhla_diffusion.ops.joint.mhla_joint_attention` with the text
block. Every method starts from the raw projections (``φ = ReLU + eps`` inside the linear ones); the projections,
norms and RoPE around the attention are the same for all and left out. SANA-Video's own attention is the global
linear row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..config import MHLAConfig
from ..models.families import FAMILIES
from ..ops.attention import mhla_attention
from ..ops.block_layout import auto_layout, num_blocks
from ..ops.joint import joint_mixing_init, mhla_joint_attention
from ..ops.mixing import mixing_init
from .bench import _dims, feature_map, plain_linear_attention, time_calls

__all__ = ["FAMILY_COLUMNS", "FAMILY_MODELS", "FamilyModel", "family_attention_table"]


@dataclass(frozen=True)
class FamilyModel:
    """The published model a family's row measures: its self-attention's heads and head width, and the text tokens
    of a joint sequence (0: text through cross-attention)."""

    model: str
    heads: int
    head_dim: int
    text_tokens: int = 0


#: The model of each family's row (Diffusers' default configs; text lengths of their pipelines).
FAMILY_MODELS: dict[str, FamilyModel] = {
    "wan": FamilyModel("Wan2.1-T2V-1.3B", 12, 128),
    "skyreels-v2": FamilyModel("SkyReels-V2-DF-1.3B-540P", 12, 128),
    "hunyuan-video": FamilyModel("HunyuanVideo", 24, 128, text_tokens=256),
    "ltx-video": FamilyModel("LTX-Video", 32, 64),
    "cogvideox": FamilyModel("CogVideoX-5b", 48, 64, text_tokens=226),
    "sana-video": FamilyModel("SANA-Video-2B", 20, 112),
    "flux": FamilyModel("FLUX.1-dev", 24, 128, text_tokens=512),
}

FAMILY_COLUMNS = (
    ("family", "family", ""),
    ("model", "model", ""),
    ("grid", "grid", ""),
    ("tokens", "N", ",d"),
    ("text_tokens", "text", "d"),
    ("heads", "H x D", ""),
    ("layout", "layout", ""),
    ("blocks", "M", "d"),
    ("sdpa_s", "SDPA s", ".3f"),
    ("linear_s", "linear s", ".3f"),
    ("mhla_s", "MHLA s", ".3f"),
    ("sdpa_over_mhla", "SDPA / MHLA", ".1f"),
    ("mhla_over_linear", "MHLA / linear", ".2f"),
)


def family_attention_table(
    families: Sequence[str] = tuple(FAMILY_MODELS),
    grids: dict[str, tuple[int, ...]] | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    warmup: int = 1,
    sdpa_max_tokens: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """One row per family (see the module docstring); ``grids``, ``heads`` and ``head_dim`` override the published
    sizes (small runs), SDPA is skipped (``None`` in its columns) above ``sdpa_max_tokens`` image + text tokens."""
    device = torch.device(device)
    eps = MHLAConfig().eps
    rows = []
    for name in families:
        if name not in FAMILY_MODELS:
            raise ValueError(f"no bench row for family {name!r}: choose from {', '.join(FAMILY_MODELS)}")
        spec, family = FAMILY_MODELS[name], FAMILIES[name]
        grid = tuple((grids or {}).get(name) or family.default_grid())
        h, d = heads or spec.heads, head_dim or spec.head_dim
        layout = auto_layout(grid)
        tokens, text = math.prod(grid), spec.text_tokens
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, tokens, h, d, generator=g).to(device, dtype) for _ in range(3))
        tq, tk, tv = (torch.randn(1, text, h, d, generator=g).to(device, dtype) for _ in range(3))
        methods = _methods(q, k, v, tq, tk, tv, grid, layout, eps)
        if sdpa_max_tokens is not None and tokens + text > sdpa_max_tokens:
            del methods["sdpa"]
        timings = time_calls(methods, repeats, warmup, device, lambda line: log(f"  {name} {line}"))
        seconds = {method: t for method, (t, _) in timings.items()}
        sdpa = seconds.get("sdpa")
        rows.append(
            {
                "family": name,
                "model": spec.model,
                "grid": _dims(grid),
                "tokens": tokens,
                "text_tokens": text,
                "heads": f"{h} x {d}",
                "layout": _dims(layout),
                "blocks": num_blocks(layout),
                "sdpa_s": sdpa,
                "linear_s": seconds["linear"],
                "mhla_s": seconds["mhla"],
                "sdpa_over_mhla": None if sdpa is None else sdpa / seconds["mhla"],
                "mhla_over_linear": seconds["mhla"] / seconds["linear"],
            }
        )
        del q, k, v, tq, tk, tv, methods
    return rows


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's SDPA on ``(B, N, H, D)`` tensors (what Diffusers' ``native`` attention backend calls)."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _methods(q, k, v, tq, tk, tv, grid, layout, eps: float) -> dict[str, Callable[[], object]]:
    """SDPA, global linear attention and MHLA over image ``q, k, v`` ``(1, N, H, D)`` and text ``tq, tk, tv``
    ``(1, L, H, D)`` (``L`` may be 0), all from raw projections."""
    joint = tq.shape[1] > 0
    sq, sk, sv = (torch.cat(pair, dim=1) for pair in ((q, tq), (k, tk), (v, tv))) if joint else (q, k, v)
    methods: dict[str, Callable[[], object]] = {
        "sdpa": lambda: _sdpa(sq, sk, sv),
        "linear": lambda: plain_linear_attention(feature_map(sq, eps), feature_map(sk, eps), sv),
    }
    mixing = mixing_init(layout).to(q.device, q.dtype)
    if joint:
        mixing = joint_mixing_init(mixing)
        methods["mhla"] = lambda: mhla_joint_attention(q, k, v, tq, tk, tv, grid, layout, mixing, feature_eps=eps)
    else:
        methods["mhla"] = lambda: mhla_attention(q, k, v, grid, layout, mixing, feature_eps=eps)
    return methods
