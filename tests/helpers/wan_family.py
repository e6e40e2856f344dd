"""The Wan variants beyond Wan2.1 text-to-video, at toy size: names, pipeline classes and fast call arguments.

The pipelines themselves come from :func:`mhla_diffusion.models.tiny.tiny_wan_pipeline` (saved to disk by the
``wan_family_dirs`` fixture in ``tests/conftest.py``).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

#: The variants of :data:`mhla_diffusion.models.tiny.WAN_VARIANTS` these tests cover (Wan2.1 T2V has its own tests).
VARIANTS = ("wan2.1-i2v", "wan2.2-ti2v", "wan2.2-a14b-t2v", "wan2.2-a14b-i2v")
#: Two-transformer variants (Wan2.2-A14B).
TWO_TRANSFORMERS = ("wan2.2-a14b-t2v", "wan2.2-a14b-i2v")
#: (variant, image-to-video) runs: TI2V-5B's one folder does both tasks.
RUNS = (
    ("wan2.1-i2v", True),
    ("wan2.2-ti2v", False),
    ("wan2.2-ti2v", True),
    ("wan2.2-a14b-t2v", False),
    ("wan2.2-a14b-i2v", True),
)
#: The layout every transformer of the fixture folders is converted with.
LAYOUT = (2, 2, 2)


def is_image_to_video(variant: str) -> bool:
    """Whether the variant's saved folder is a ``WanImageToVideoPipeline`` (TI2V-5B's is a ``WanPipeline``)."""
    return variant in ("wan2.1-i2v", "wan2.2-a14b-i2v")


def pipeline_class(image_to_video: bool) -> type:
    """``MHLAWanImageToVideoPipeline`` or ``MHLAWanPipeline``."""
    from mhla_diffusion.pipelines import MHLAWanImageToVideoPipeline, MHLAWanPipeline

    return MHLAWanImageToVideoPipeline if image_to_video else MHLAWanPipeline


def side(variant: str) -> int:
    """Height and width of the test videos: 64 px for TI2V-5B (x16 VAE, patch 2: multiples of 32), else 32."""
    return 64 if variant == "wan2.2-ti2v" else 32


def first_frame(size: int = 32, seed: int = 0) -> Image.Image:
    """A fixed random RGB image of ``size`` x ``size`` pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def text_tokens(variant: str) -> int:
    """``max_sequence_length`` of the test calls: 16, but Wan2.1-I2V needs Diffusers' 512 (its cross-attention
    reads the last 512 context tokens as text and the ones before as the image)."""
    return 512 if variant == "wan2.1-i2v" else 16


def call_args(variant: str, image_to_video: bool, seed: int = 0) -> dict:
    """Small, fast call arguments (9 frames, 2 steps, numpy output) for a tiny pipeline of ``variant``."""
    size = side(variant)
    args = dict(
        prompt="a red circle moving left",
        negative_prompt="blue",
        num_frames=9,
        height=size,
        width=size,
        num_inference_steps=2,
        max_sequence_length=text_tokens(variant),
        output_type="np",
    )
    if image_to_video:
        args["image"] = first_frame(size, seed)
    return args
