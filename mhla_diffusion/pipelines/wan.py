"""Text-to-video: Diffusers' ``WanPipeline`` with MHLA self-attention."""

from __future__ import annotations

import inspect
from typing import Any

from diffusers import WanPipeline

from ..block_layout import validate_grid_layout
from .mhla_mixin import MHLAPipelineMixin

__all__ = ["MHLAWanPipeline"]


class MHLAWanPipeline(MHLAPipelineMixin, WanPipeline):
    """``WanPipeline`` whose transformer may use MHLA (see :class:`MHLAPipelineMixin`).

    Sampling is Diffusers' own: schedulers swap as usual, and ``generator``, ``output_type``,
    ``callback_on_step_end``, CFG, negative prompts and ``prompt_embeds`` behave as in ``WanPipeline``.
    Before any work, a video whose token grid is smaller than the MHLA block layout is refused.
    """

    _stock_pipeline_name = "WanPipeline"
    _stock_transformer_name = "WanTransformer3DModel"
    _mhla_transformer_name = "MHLAWanTransformer3DModel"

    def token_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Token grid (frames, height, width) this pipeline's transformer sees for a video size."""
        temporal, spatial = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial
        pt, ph, pw = self.transformer.config.patch_size
        if num_frames % temporal != 1:  # WanPipeline rounds the same way (with a warning)
            num_frames = num_frames // temporal * temporal + 1
        latent_frames = (max(num_frames, 1) - 1) // temporal + 1
        return latent_frames // pt, height // spatial // ph, width // spatial // pw

    def check_mhla_size(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` when the video's token grid cannot hold the MHLA block layout."""
        conversion = self.mhla
        if conversion is None:
            return
        grid = self.token_grid(num_frames, height, width)
        try:
            validate_grid_layout(grid, conversion.layout)
        except ValueError:
            raise ValueError(
                f"a {num_frames}x{height}x{width} video has token grid {grid}, smaller than the MHLA block layout "
                f"{conversion.layout} on some axis: generate more frames or a larger size"
            ) from None

    def __call__(self, *args: Any, **kwargs: Any):
        bound = inspect.signature(WanPipeline.__call__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        self.check_mhla_size(bound.arguments["num_frames"], bound.arguments["height"], bound.arguments["width"])
        return super().__call__(*args, **kwargs)

    __call__.__doc__ = WanPipeline.__call__.__doc__
