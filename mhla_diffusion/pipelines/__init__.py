"""Sampling pipelines over Diffusers' ``WanPipeline`` and ``DiTPipeline`` with MHLA (``mhla_diffusion.pipelines``)."""

from .dit import MHLADiTPipeline
from .mhla_mixin import MHLAPipelineMixin
from .wan import MHLAWanPipeline

__all__ = ["MHLADiTPipeline", "MHLAPipelineMixin", "MHLAWanPipeline"]
