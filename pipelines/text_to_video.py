#!/usr/bin/env python
"""Generate videos from prompts with Wan2.1 + MHLA (`mhla text-to-video`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["text-to-video", *sys.argv[1:]]))
