"""Resuming after a kill cut a checkpoint save or a cache write: the trainer sets the run folder right
and finishes with the weights of the uninterrupted run (issue: leftovers that blocked every resume)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers.finetune import dit_options
from mhla_diffusion.finetune import train_dit

COMMON = dict(max_train_steps=6, checkpointing_steps=2, cache_latents=True, train_batch_size=3)
STEP = "step-{:08d}"


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _old_alone(run):  # cut between the renames of a re-save of step 4: step-4 is hidden
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / STEP.format(6))
    os.replace(checkpoints / STEP.format(4), checkpoints / f".old-{STEP.format(4)}")
    return 4


def _old_beside_step(run):  # the reproduction: cut while deleting the old copy of step 6
    old = run / "checkpoints" / f".old-{STEP.format(6)}"
    old.mkdir()
    shutil.copy(run / "checkpoints" / STEP.format(6) / "optimizer.bin", old)
    return 6


def _tmp_alone(run):  # cut while writing step 6
    checkpoints = run / "checkpoints"
    os.replace(checkpoints / STEP.format(6), checkpoints / f".tmp-{STEP.format(6)}")
    (checkpoints / f".tmp-{STEP.format(6)}" / "model.safetensors").unlink(missing_ok=True)
    return 4


def _old_and_tmp(run):  # cut between the renames: the new save is complete but unnamed, the old one moved aside
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / STEP.format(4), checkpoints / f".tmp-{STEP.format(4)}")
    os.replace(checkpoints / STEP.format(4), checkpoints / f".old-{STEP.format(4)}")
    shutil.rmtree(checkpoints / STEP.format(6))
    return 4


def _half_cache_entry(run):  # a kill during the latent pre-pass: a temporary entry that nothing reads
    entry = next((run / "cache" / "latents").rglob("*.safetensors"))
    (entry.parent / f".{entry.name}.{_dead_pid()}.tmp").write_bytes(entry.read_bytes()[:100])
    return 6


@pytest.mark.slow
def test_resume_from_every_leftover_equals_uninterrupted(tmp_path, pipeline_dirs, image_classes, caplog):
    caplog.set_level(logging.INFO)
    base = pipeline_dirs["dit"]
    reference = tmp_path / "reference"
    train_dit.train(dit_options(base, image_classes, reference, **COMMON))
    expected = load_file(str(reference / "final" / "diffusion_pytorch_model.safetensors"))
    for plant in (_old_alone, _old_beside_step, _tmp_alone, _old_and_tmp, _half_cache_entry):
        run = tmp_path / plant.__name__
        shutil.copytree(reference, run)
        resumed_at = plant(run)
        caplog.clear()
        train_dit.train(dit_options(base, image_classes, run, resume="latest", **COMMON))
        assert f"resumed from {run / 'checkpoints' / STEP.format(resumed_at)} " in caplog.text, plant.__name__
        assert "checkpoints: " in caplog.text or "latent cache: removed" in caplog.text  # each action is logged
        leftovers = [p for p in run.rglob(".*") if p.name not in (".run.lock",)]
        assert leftovers == [], (plant.__name__, leftovers)
        got = load_file(str(run / "final" / "diffusion_pytorch_model.safetensors"))
        for key in expected:
            assert torch.equal(expected[key], got[key]), (plant.__name__, key)
