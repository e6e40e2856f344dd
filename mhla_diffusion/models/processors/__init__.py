"""Diffusers attention processors that compute self-attention with MHLA."""

from .base import MHLAProcessor, apply_interleaved_rotary
from .dit import DiTMHLAProcessor
from .grid import TokenGridContext, TokenGridHook
from .wan import WanMHLAProcessor

__all__ = [
    "DiTMHLAProcessor",
    "MHLAProcessor",
    "TokenGridContext",
    "TokenGridHook",
    "WanMHLAProcessor",
    "apply_interleaved_rotary",
]
