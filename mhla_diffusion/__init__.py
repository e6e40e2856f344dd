"""mhla-diffusion: Multi-Head Linear Attention (MHLA) for Diffusers' Wan2.1 and DiT transformers."""

from .attention import mhla_attention
from .attention_reference import mhla_attention_reference
from .block_layout import auto_layout, block_plan, num_blocks, token_block_ids
from .config import MHLAConfig
from .cpu_memory import retain_freed_memory
from .conversion import (
    MHLAConversion,
    convert_to_mhla,
    get_mhla_conversion,
    image_token_grid,
    revert_mhla,
    softmax_attention,
    video_token_grid,
)
from .mixing import block_distances, mixing_init
from .models import MHLADiTTransformer2DModel, MHLAWanTransformer3DModel
from .processors import DiTMHLAProcessor, MHLAProcessor, WanMHLAProcessor
from .weights import load_mhla, load_transformer, save_mhla

# Diffusers loads a component declared as ["mhla_diffusion", "MHLAWanTransformer3DModel"] in a
# model_index.json only if this package also exposes the base class it checks against.
from diffusers import ModelMixin  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "DiTMHLAProcessor",
    "MHLADiTTransformer2DModel",
    "MHLAConfig",
    "MHLAConversion",
    "MHLAProcessor",
    "MHLAWanTransformer3DModel",
    "WanMHLAProcessor",
    "auto_layout",
    "block_distances",
    "block_plan",
    "convert_to_mhla",
    "get_mhla_conversion",
    "image_token_grid",
    "load_mhla",
    "load_transformer",
    "mhla_attention",
    "mhla_attention_reference",
    "mixing_init",
    "num_blocks",
    "retain_freed_memory",
    "revert_mhla",
    "save_mhla",
    "softmax_attention",
    "token_block_ids",
    "video_token_grid",
]
