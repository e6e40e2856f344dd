"""Text-to-video: Diffusers' ``WanPipeline`` with MHLA self-attention (Wan2.1, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B)."""

from __future__ import annotations

import functools
from typing import Any

from diffusers import WanPipeline

from .wan_video import MHLAWanVideoMixin

__all__ = ["MHLAWanPipeline"]


class MHLAWanPipeline(MHLAWanVideoMixin, WanPipeline):
    """``WanPipeline`` whose transformers may use MHLA (see :class:`MHLAPipelineMixin` and :class:`MHLAWanVideoMixin`).

    Sampling is Diffusers' own: schedulers swap as usual, and ``generator``, ``output_type``,
    ``callback_on_step_end``, CFG, negative prompts and ``prompt_embeds`` behave as in ``WanPipeline``; so do
    Wan2.2's ``expand_timesteps`` (TI2V-5B) and ``transformer_2`` / ``boundary_ratio`` / ``guidance_scale_2``
    (A14B). Before any work, a size the model cannot generate (e.g. larger than its position encoding holds,
    or not a multiple of 32 px under TI2V-5B's x16 VAE) is refused with a readable ``ValueError``. A token grid
    smaller than the MHLA block layout on some axis (an image-sized 1-frame call under a video layout) is fine:
    its extra blocks are empty.
    """

    _stock_pipeline_name = "WanPipeline"

    @functools.wraps(WanPipeline.__call__)  # Diffusers' signature and docs (inspect.signature follows __wrapped__)
    def __call__(self, *args: Any, **kwargs: Any):
        return self.checked_call(args, kwargs)
