#!/usr/bin/env python
"""Fine-tune DiT class-to-image with MHLA (or train it with softmax): the library's trainer.

python finetune/train_dit.py --config finetune/configs/dit_xl2_256_mhla.yaml --data_dir DATA --output_dir RUN
accelerate launch finetune/train_dit.py --config ... (same as `python -m mhla_diffusion.finetune.train_dit`)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.finetune.entry import main  # noqa: E402  (torch loads after the options are checked)

if __name__ == "__main__":
    sys.exit(main("dit"))
