#!/usr/bin/env python
"""FID / sFID / IS / precision-recall of samples against reference statistics (`mhla eval`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
