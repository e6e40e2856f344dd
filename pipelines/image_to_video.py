#!/usr/bin/env python
"""Generate videos from an image and prompts with Wan image-to-video + MHLA (`mhla image-to-video`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["image-to-video", *sys.argv[1:]]))
