"""A trainer start that cannot succeed fails before any work, in one line, and leaves ``--output_dir`` as it
found it (issue 46); a 0 that turns something off is logged once at start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from helpers.finetune import wan_values
from mhla_diffusion.finetune.checkpointing import RUN_CONFIG, check_resume_checkpoint, check_run_dir
from mhla_diffusion.finetune.entry import main
from mhla_diffusion.finetune.options import DiTTrainOptions, WanTrainOptions


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


# ---------------------------------------------------------------- --resume that is not a checkpoint


def test_resume_of_a_folder_that_is_no_checkpoint_fails_first_and_writes_nothing(
    tmp_path, pipeline_dirs, video_set, capsys
):
    not_a_checkpoint = tmp_path / "some_folder"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "notes.txt").write_text("not a checkpoint")
    config = tmp_path / "wan.yaml"
    config.write_text(yaml.safe_dump(wan_values(pipeline_dirs["wan"], video_set, tmp_path / "run")))
    assert main("wan", ["--config", str(config), "--resume", str(not_a_checkpoint)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"--resume {not_a_checkpoint} is not a checkpoint (no custom_checkpoint_0.pkl, random_states_0.pkl" in err
    assert "<output_dir>/checkpoints/step-N" in err and "Accelerate's state files" in err
    assert not (tmp_path / "run").exists()  # the corrected rerun starts a new run there
    assert check_run_dir(tmp_path / "run", None, False) == "new"


def _fake_checkpoint(folder: Path, weights: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True)
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", weights):
        (folder / name).write_bytes(b"")
    return folder


def test_resume_checkpoint_rule(tmp_path):
    options = WanTrainOptions().to_dict()
    check_resume_checkpoint(str(_fake_checkpoint(tmp_path / "a" / "checkpoints" / "step-00000002")), options)
    check_resume_checkpoint(str(_fake_checkpoint(tmp_path / "b", "trainable_weights.safetensors")), options)
    check_resume_checkpoint("latest", options)
    no_weights = _fake_checkpoint(tmp_path / "c", "scheduler.bin")
    with pytest.raises(ValueError, match=rf"--resume {no_weights} is not a checkpoint \(no weights\)"):
        check_resume_checkpoint(str(no_weights), options)
    other = tmp_path / "dit_run"
    step = _fake_checkpoint(other / "checkpoints" / "step-00000004")
    (other / RUN_CONFIG).write_text(yaml.safe_dump(DiTTrainOptions().to_dict()))
    with pytest.raises(
        ValueError, match=r"is a checkpoint of another trainer's run: .* \(clamp_mixing, class_dropout, class_map\)"
    ):
        check_resume_checkpoint(str(step), options)


# ---------------------------------------------------------------- a failure before the first step


class _FirstStepFails(RuntimeError):
    pass


def _fail(*args, **kwargs):
    raise _FirstStepFails("out of memory at the first step")


@pytest.mark.parametrize("where", ["new", "empty", "nested"])
def test_a_run_that_fails_before_its_first_step_leaves_output_dir_as_it_found_it(
    tmp_path, pipeline_dirs, image_classes, monkeypatch, where
):
    from helpers.finetune import dit_options
    from mhla_diffusion.finetune import train_dit

    run = tmp_path / "run" if where != "nested" else tmp_path / "a" / "b" / "run"
    if where == "empty":
        run.mkdir()
    monkeypatch.setattr(train_dit.DiTTask, "batch_loss", _fail)
    with pytest.raises(_FirstStepFails):  # after the lock, Accelerate's logs/, run_config.yaml and trackers
        train_dit.train(dit_options(pipeline_dirs["dit"], image_classes, run, max_train_steps=2))
    if where == "empty":
        assert run.is_dir() and not any(run.iterdir())
    else:
        assert not run.exists() and not (tmp_path / "a").exists()


def test_a_failed_resume_keeps_the_run_as_it_was(tmp_path, pipeline_dirs, image_classes, monkeypatch):
    from helpers.finetune import dit_options
    from mhla_diffusion.finetune import train_dit

    run = tmp_path / "run"
    train_dit.train(dit_options(pipeline_dirs["dit"], image_classes, run, max_train_steps=2, checkpointing_steps=1))
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    monkeypatch.setattr(train_dit.DiTTask, "batch_loss", _fail)
    options = dit_options(
        pipeline_dirs["dit"], image_classes, run, max_train_steps=3, checkpointing_steps=1, resume="latest"
    )
    for step in sorted((run / "checkpoints").iterdir()):  # real checkpoints pass the rule
        check_resume_checkpoint(str(step), options.to_dict())
    with pytest.raises(_FirstStepFails):
        train_dit.train(options)
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after.keys() == before.keys()
    assert after[Path(RUN_CONFIG)] == before[Path(RUN_CONFIG)]


# ---------------------------------------------------------------- sizes from the config files, before any weights


#: What reads weights or data in the class-to-image trainer's setup: none may run before `resolution` is checked.
_EXPENSIVE = (
    "load_mhla_transformer",
    "load_softmax_transformer",
    "new_dit_transformer",
    "load_vae",
    "load_component",
    "encoder_identity",
    "index_class_folder",
    "count_classes",
)


def _not_yet(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran before `resolution` was checked")

    return refuse


@pytest.mark.parametrize("scratch", [False, True], ids=["pretrained", "model_size"])
def test_dit_resolution_is_checked_from_the_config_files_before_any_weights_load(
    tmp_path, pipeline_dirs, image_classes, monkeypatch, scratch
):
    from helpers.finetune import dit_options, dit_scratch_options
    from mhla_diffusion.finetune import train_dit

    for name in _EXPENSIVE:
        monkeypatch.setattr(train_dit, name, _not_yet(name))
    run = tmp_path / "run"
    make = dit_scratch_options if scratch else dit_options
    options = make(pipeline_dirs["dit"], image_classes, run, resolution=18, cache_latents=True)
    # the tiny pipeline: VAE x2 (its vae/config.json), patch 2 (transformer/config.json, or DiT-S/2's)
    with pytest.raises(ValueError, match=r"`resolution` 18 must be a multiple of 4 \(VAE x2, patch 2, from the model"):
        train_dit.train(options)
    assert not run.exists()


def test_the_issues_example_a_bad_resolution_with_the_recipe(tmp_path, pipeline_dirs, image_classes, capsys):
    recipe = ["--config", "finetune/configs/dit_s2_256_from_scratch_mhla.yaml"]
    local = ["--vae_model", str(pipeline_dirs["dit"]), "--data_dir", str(image_classes)]  # no hub, tiny VAE x2
    run = tmp_path / "run"
    assert main("dit", [*recipe, *local, "--resolution", "250", "--output_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: `resolution` 250 must be a multiple of 4 (VAE x2, patch 2, from the model's config files)"
    ]
    assert not run.exists()
