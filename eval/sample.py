#!/usr/bin/env python
"""Sample a pipeline for evaluation into ADM's .npz format, on one or many GPUs (`mhla eval-sample`).

accelerate launch eval/sample.py --pipeline facebook/DiT-XL-2-256 --output-dir samples/dit --num-samples 50000"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["eval-sample", *sys.argv[1:]]))
