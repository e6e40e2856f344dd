#!/usr/bin/env python
"""Generate class-conditional images with DiT + MHLA (`mhla class-to-image`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["class-to-image", *sys.argv[1:]]))
