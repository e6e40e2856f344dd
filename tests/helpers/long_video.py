"""A stand-in for the embedded long-video model: a block-causal MHLA pipeline laid out as ``mhla build-embedded
--stream`` exports ``shapes-long-mhla`` (``<root>/shapes-long-mhla`` with ``<root>/judges/long-video`` beside it),
so ``embedded_model("long-video", "mhla", root)`` and ``embedded_folder`` find it.

It is the committed embedded text-to-video softmax teacher converted to causal MHLA, untrained: it streams at the
embedded size (48x48, the embedded VAE's 2x time factor) in seconds, but draws noise, not shapes. Its judge is a copy
of the committed video judge. (The ``long_video_root`` fixture of ``tests/conftest.py`` builds it once a session.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: The conversion: one temporal block row per latent frame, 6 x 6 spatial blocks over the 12 x 12 tokens of 48 x 48.
LONG_VIDEO_CONFIG = dict(layout=(1, 6, 6), causal=True)


def write_long_video_model(root: Path) -> Path:
    """Write the stand-in into ``root`` (module docstring); returns the pipeline folder ``root/shapes-long-mhla``."""
    from mhla_diffusion import MHLAConfig, MHLAWanStreamingPipeline
    from mhla_diffusion.embedded import embedded_judge, embedded_model

    folder = Path(root) / "shapes-long-mhla"
    pipe = MHLAWanStreamingPipeline.from_pretrained(embedded_model("text-to-video", "softmax"))
    pipe.convert_to_mhla(MHLAConfig(**LONG_VIDEO_CONFIG))
    pipe.save_pretrained(folder)
    shutil.copytree(embedded_judge("video"), Path(root) / "judges" / "long-video")
    return folder
