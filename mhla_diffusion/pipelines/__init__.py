"""Sampling pipelines over Diffusers' ``WanPipeline``, ``WanImageToVideoPipeline`` and ``DiTPipeline`` with MHLA
(``mhla_diffusion.pipelines``), and the streaming Wan pipeline of block-causal MHLA (``wan_streaming``).

Names are re-exported lazily (PEP 562): importing :mod:`.outputs` (torch-free) does not load Diffusers.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "MHLADiTPipeline": ".dit",
    "MHLAPipelineMixin": ".mhla_mixin",
    "MHLAWanImageToVideoPipeline": ".wan_i2v",
    "MHLAWanPipeline": ".wan",
    "MHLAWanStreamingPipeline": ".wan_streaming",
    "MHLAWanVideoMixin": ".wan_video",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
