#!/usr/bin/env python
"""Fine-tune Wan2.1 text-to-video with MHLA (or train it with softmax): the library's trainer.

python finetune/train_wan.py --config finetune/configs/wan2.1_t2v_1.3b_mhla.yaml --data_dir DATA --output_dir RUN
accelerate launch finetune/train_wan.py --config ... (same as `python -m mhla_diffusion.finetune.train_wan`)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from mhla_diffusion.finetune.entry import main  # noqa: E402  (torch loads after the options are checked)

if __name__ == "__main__":
    sys.exit(main("wan"))
