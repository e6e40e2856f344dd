"""Stopping a run with SIGINT / SIGTERM: the step finishes, a checkpoint is written, one line says how to
resume, the exit is non-zero, and resuming from that checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.finetune import dit_options, metrics, subprocess_env
from mhla_diffusion.finetune import train_dit
from mhla_diffusion.finetune.interrupt import StopRequest, TrainingInterrupted

ROOT = Path(__file__).resolve().parents[2]
COMMON = dict(max_train_steps=150, checkpointing_steps=0, train_batch_size=2)


def test_second_sigint_stops_at_once_and_sigterm_never_does():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher forwarding the same Ctrl-C: still saving
        stop.step = 7
        with pytest.raises(TrainingInterrupted, match="stopped at once after step 7") as raised:
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def _interrupt(command: list[str], output: Path, group: bool, env: dict) -> subprocess.CompletedProcess:
    """Start ``command`` in its own process group; once the run has logged a few steps send SIGINT to the
    group (as a terminal's Ctrl-C) or to the started process alone; wait for it."""
    process = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if (output / "logs").is_dir() and sum("loss" in row for row in metrics(output)) >= 3:
            break
        time.sleep(0.02)
    assert process.poll() is None, process.communicate()
    if group:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_sigint_and_sigterm_save_a_checkpoint_that_resumes_exactly(tmp_path, pipeline_dirs, image_classes):
    base = pipeline_dirs["dit"]
    train_dit.train(dit_options(base, image_classes, tmp_path / "reference", **COMMON))
    expected = load_file(str(tmp_path / "reference" / "final" / "diffusion_pytorch_model.safetensors"))
    env = dict(subprocess_env(), ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf"))
    plain = [sys.executable, "finetune/train_dit.py"]
    # SIGINT to `accelerate launch` alone: the launcher stops its worker with SIGTERM
    launcher = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--num_processes", "1"]
    launcher += ["--mixed_precision", "no", "--dynamo_backend", "no", "finetune/train_dit.py"]
    for name, command, signum, code in (
        ("sigint", plain, signal.SIGINT, 130),
        ("launcher", launcher, signal.SIGINT, 1),
    ):
        output = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        workers = 1 if name == "sigint" else 0  # data workers get the terminal's Ctrl-C too
        options = dit_options(base, image_classes, output, dataloader_num_workers=workers, **COMMON)
        config.write_text(yaml.safe_dump(options.to_dict()))
        result = _interrupt([*command, "--config", str(config)], output, name == "sigint", env)
        saved = sorted((output / "checkpoints").glob("step-*"))
        assert len(saved) == 1, (name, result.stderr[-3000:])
        step = int(saved[0].name.split("-")[1])
        assert 3 <= step < COMMON["max_train_steps"], name
        if name == "sigint":
            assert result.returncode == code, result.stderr[-3000:]
            assert (
                result.stderr.strip().splitlines()[-1] == f"SIGINT: saved {saved[0].name}; resume with --resume latest"
            )
            assert "Traceback" not in result.stderr
        else:  # the launcher exits 130 itself
            assert result.returncode == 130, result.stderr[-3000:]
            assert f"SIGTERM: saved {saved[0].name}; resume with --resume latest" in result.stderr
        assert not (output / "final").exists()
        train_dit.train(dit_options(base, image_classes, output, resume="latest", **COMMON))
        got = load_file(str(output / "final" / "diffusion_pytorch_model.safetensors"))
        for key in expected:
            assert torch.equal(expected[key], got[key]), (name, key)
