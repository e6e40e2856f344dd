"""Text-to-video: Diffusers' ``WanPipeline`` with MHLA self-attention."""

from __future__ import annotations

import inspect
from typing import Any

from diffusers import WanPipeline

from ..geometry import VideoGeometry, check_layout_fits
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

    @property
    def geometry(self) -> VideoGeometry:
        """This pipeline's size rules, read from its transformer and VAE configs."""
        return VideoGeometry.from_pipeline(self)

    def token_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Token grid (frames, height, width) this pipeline's transformer sees for a video size
        (frames rounded down to ``k * temporal + 1`` as ``WanPipeline`` does)."""
        return self.geometry.token_grid(num_frames, height, width, strict=False)

    def check_mhla_size(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` when the video's token grid cannot hold the MHLA block layout."""
        conversion = self.mhla
        if conversion is None:
            return
        check_layout_fits(self.token_grid(num_frames, height, width), conversion.layout,
                          f"a {num_frames}x{height}x{width} video", "generate more frames or a larger size")

    def __call__(self, *args: Any, **kwargs: Any):
        bound = inspect.signature(WanPipeline.__call__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        self.check_mhla_size(bound.arguments["num_frames"], bound.arguments["height"], bound.arguments["width"])
        return super().__call__(*args, **kwargs)

    __call__.__doc__ = WanPipeline.__call__.__doc__
