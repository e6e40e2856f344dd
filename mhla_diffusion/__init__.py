"""mhla-diffusion: Multi-Head Linear Attention (MHLA) for Diffusers' Wan (2.1, 2.2) and DiT transformers.

The public API below is imported on first use (PEP 562), so ``import mhla_diffusion`` and the
``mhla`` command start without loading torch or Diffusers. Layers and the import rule:
``docs/architecture.md``.
"""

from ._lazy import lazy_exports
from .utils.diffusers_warnings import install as _install_diffusers_warnings

__version__ = "0.1.0"

_EXPORTS = {
    "mhla_attention": ".ops.attention",
    "mhla_attention_fused": ".ops.fused_op",
    **dict.fromkeys(["mhla_attention_reference", "mhla_causal_attention_reference"], ".ops.naive"),
    **dict.fromkeys(
        ["CausalMHLAState", "causal_mixing_init", "causal_mixing_matrix", "mhla_causal_attention", "mhla_causal_step"],
        ".ops.causal",
    ),
    "mhla_causal_teacher_forcing": ".ops.teacher_forcing",
    **dict.fromkeys(["auto_layout", "block_plan", "num_blocks", "token_block_ids"], ".ops.block_layout"),
    "MHLAConfig": ".config",
    "retain_freed_memory": ".ops.cpu_memory",
    **dict.fromkeys(
        ["MHLAConversion", "convert_to_mhla", "get_mhla_conversion", "revert_mhla", "softmax_attention"],
        ".models.conversion",
    ),
    **dict.fromkeys(["image_token_grid", "video_token_grid"], ".utils.geometry"),
    **dict.fromkeys(["block_distances", "mixing_init"], ".ops.mixing"),
    **dict.fromkeys(["MHLADiTTransformer2DModel", "MHLAWanTransformer3DModel"], ".models.transformers"),
    **dict.fromkeys(
        ["MHLADiTPipeline", "MHLAWanImageToVideoPipeline", "MHLAWanPipeline", "MHLAWanStreamingPipeline"], ".pipelines"
    ),
    "GenerationInterrupted": ".pipelines.interrupt",
    **dict.fromkeys(["DiTMHLAProcessor", "MHLAProcessor", "WanMHLAProcessor"], ".models.processors"),
    **dict.fromkeys(["load_mhla", "load_transformer", "save_mhla"], ".loaders.weights"),
    **dict.fromkeys(["LoadPlan", "PipelinePlan", "plan_pipeline", "resolve_source"], ".loaders.plan"),
    # Diffusers loads a component declared as ["mhla_diffusion", "MHLAWanTransformer3DModel"] in a
    # model_index.json only if this package also exposes the base class it checks against.
    "ModelMixin": "diffusers",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
_install_diffusers_warnings()  # Diffusers' loaders that drop MHLA say so (logging only)
__all__ = sorted(name for name in _EXPORTS if name != "ModelMixin")
