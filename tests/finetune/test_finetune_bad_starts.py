"""A trainer start that cannot succeed fails before any work, in one line, and leaves ``--output_dir`` as it
found it (issue 46); a 0 that turns something off is logged once at start."""

from __future__ import annotations

import logging


def test_a_run_logs_what_zero_turns_off_once_at_start(tmp_path, pipeline_dirs, image_classes, caplog):
    from helpers.finetune import dit_options
    from mhla_diffusion.finetune import train_dit

    base = pipeline_dirs["dit"]
    options = dit_options(base, image_classes, tmp_path / "run", max_train_steps=1, checkpointing_steps=0)
    with caplog.at_level(logging.INFO, logger="mhla_diffusion.finetune.engine"):
        train_dit.train(options)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("off (set to 0)")]
    assert len(lines) == 1
    assert "checkpointing_steps 0: never: no resumable checkpoints" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
