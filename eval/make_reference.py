#!/usr/bin/env python
"""Reference statistics in ADM's .npz format from a folder or .npz of images (`mhla eval-ref`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["eval-ref", *sys.argv[1:]]))
