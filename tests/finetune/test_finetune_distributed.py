"""A real two-process run: ``accelerate launch`` with two CPU processes (gloo), latent-cache pre-pass
split across them, an attention-transfer stage and DDP training of LoRA + MHLA, checkpoints holding
both processes' RNG states."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from helpers.finetune import metrics, subprocess_env, wan_values
from helpers.web import free_port
from mhla_diffusion.pipelines import MHLAWanPipeline

#: Every test here starts processes or trains (``pytest -m 'not slow'`` skips them).
pytestmark = pytest.mark.slow


def test_two_process_run_with_cache_prepass(tmp_path, pipeline_dirs, video_set):
    output, cache = tmp_path / "run", tmp_path / "cache"
    config = tmp_path / "wan.yaml"
    config.write_text(
        yaml.safe_dump(
            wan_values(
                pipeline_dirs["wan"],
                video_set,
                output,
                checkpointing_steps=2,
                trainable="lora",
                lora_rank=4,
                cache_latents=True,
                cache_dir=str(cache),
                validation_prompts=["a green square moving up"],
                validation_num_inference_steps=2,
                attention_transfer_steps=2,
            )
        )
    )
    # Accelerate's --cpu launcher starts one process; two CPU processes go through torchrun
    # (--multi_gpu) with ACCELERATE_USE_CPU, which gives MULTI_CPU with the gloo backend.
    env = dict(subprocess_env(), ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf"))
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "mhla_diffusion.finetune.train_wan",
        "--config",
        str(config),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    rows = metrics(output)
    assert rows[0]["num_processes"] == 2
    assert [r["step"] for r in rows if "transfer/loss" in r] == [1, 2]
    assert all(r["transfer/blocks.0.attn1"] > 0 for r in rows if "transfer/loss" in r)
    assert [r["step"] for r in rows if "loss" in r] == [3, 4, 5, 6]
    for step in (2, 4, 6):
        states = sorted(p.name for p in (output / "checkpoints" / f"step-{step:08d}").glob("random_states_*.pkl"))
        assert states == ["random_states_0.pkl", "random_states_1.pkl"]
    assert len(list((cache / "latents").rglob("*.safetensors"))) == 9
    assert len(list((cache / "prompts").rglob("*.safetensors"))) == 9 + 2  # captions, "", the validation prompt
    assert (output / "validation" / "step-00000006" / "00-a-green-square-moving-up.mp4").is_file()

    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=output / "final")
    pipe.load_lora_weights(output / "final")
    frames = pipe(
        prompt="a red square",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        max_sequence_length=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames[0]
    assert frames.shape == (5, 32, 32, 3)
