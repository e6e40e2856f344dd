"""Text-to-video trainer on a tiny Wan pipeline and synthetic clips: learning, outputs that load with
the pipelines, LoRA, resume equality, the latent cache, run folders and bad inputs."""

from __future__ import annotations

import json
import shutil

import imageio.v3 as iio
import pytest
import torch
from safetensors.torch import load_file

from helpers.finetune import Interrupted, WanEvaluator, base_wan_transformer, crash_at, metrics, wan_options
from helpers.media import make_video_set, write_image, write_video
from mhla_diffusion import load_mhla
from mhla_diffusion.finetune import train_wan
from mhla_diffusion.finetune.checkpointing import list_checkpoints
from mhla_diffusion.pipelines import MHLAWanPipeline


@pytest.mark.slow
def test_loss_decreases_and_outputs_load_with_the_pipelines(tmp_path, pipeline_dirs, video_set):
    base = pipeline_dirs["wan"]
    evaluate = WanEvaluator(base, video_set)
    before = evaluate(base_wan_transformer(base))
    options = wan_options(
        base,
        video_set,
        tmp_path / "run",
        max_train_steps=30,
        save_pipeline=True,
        validation_prompts=["a red square moving left"],
        validation_num_inference_steps=2,
    )
    final = train_wan.train(options)

    trained = load_mhla(final)
    assert type(trained).__name__ == "MHLAWanTransformer3DModel"
    after = evaluate(trained)
    assert after < 0.8 * before, (before, after)

    rows = metrics(tmp_path / "run")
    assert rows[0]["step"] == 0 and rows[0]["data/files_used"] == 9
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all(r["steps_per_s"] > 0 and r["grad_norm"] >= 0 and r["lr"] == 1e-3 for r in steps)

    pipe = MHLAWanPipeline.from_pretrained(tmp_path / "run" / "pipeline")
    assert pipe.mhla is not None
    x = torch.randn(1, 16, 3, 4, 4)
    text = torch.randn(1, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            pipe.transformer(hidden_states=x, timestep=torch.tensor([300]), encoder_hidden_states=text).sample,
            trained(hidden_states=x, timestep=torch.tensor([300]), encoder_hidden_states=text).sample,
        )
    video = tmp_path / "run" / "validation" / "step-00000030" / "00-a-red-square-moving-left.mp4"
    assert iio.imread(video).shape == (9, 32, 32, 3)


def _final_tensors(folder):
    tensors = load_file(str(folder / "mhla_weights.safetensors"))
    tensors.update(load_file(str(folder / "pytorch_lora_weights.safetensors")))
    return tensors


@pytest.mark.slow
def test_interrupted_and_resumed_lora_run_equals_uninterrupted(tmp_path, pipeline_dirs, video_set):
    base = pipeline_dirs["wan"]
    common = dict(
        trainable="lora",
        lora_rank=4,
        lora_alpha=8,
        gradient_accumulation_steps=2,
        caption_dropout=0.5,
        max_train_steps=6,
        checkpointing_steps=2,
        cache_latents=True,
        cache_dir=str(tmp_path / "cache"),
        mhla={"layout": [1, 2, 2], "gate": True},
    )
    straight = train_wan.train(wan_options(base, video_set, tmp_path / "straight", **common))
    with pytest.raises(Interrupted):
        train_wan.train(wan_options(base, video_set, tmp_path / "resumed", **common), on_step_end=crash_at(5))
    assert [s for s, _ in list_checkpoints(tmp_path / "resumed")] == [2, 4]
    assert not (tmp_path / "resumed" / "final").exists()
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints" / "step-00000004").iterdir()) == [
        "custom_checkpoint_0.pkl",
        "optimizer.bin",
        "random_states_0.pkl",
        "scheduler.bin",
        "trainable_weights.safetensors",
    ]
    resumed = train_wan.train(wan_options(base, video_set, tmp_path / "resumed", resume="latest", **common))

    a, b = _final_tensors(straight), _final_tensors(resumed)
    assert a.keys() == b.keys() and any(".lora_B." in k for k in a) and any(".processor.gate." in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses = lambda run: {r["step"]: r["loss"] for r in metrics(tmp_path / run) if "loss" in r}  # noqa: E731
    assert losses("straight")[6] == losses("resumed")[6]
    assert not list((tmp_path / "resumed" / "checkpoints").glob(".tmp-*"))

    # the LoRA part loads with Diffusers' own loader on top of the MHLA weights
    pipe = MHLAWanPipeline.from_pretrained(base, mhla_weights=straight)
    plain = MHLAWanPipeline.from_pretrained(base, mhla_weights=straight)
    pipe.load_lora_weights(straight)
    x, text, t = torch.randn(1, 16, 3, 4, 4), torch.randn(1, 16, 32), torch.tensor([600])
    with torch.no_grad():
        with_lora = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
        without = plain.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
    assert (with_lora - without).abs().max() > 1e-4


@pytest.mark.slow
def test_latent_cache_matches_online_encoding_and_is_reused(tmp_path, pipeline_dirs, video_set, monkeypatch):
    base = pipeline_dirs["wan"]
    data = tmp_path / "data"
    shutil.copytree(video_set, data)
    (data / "broken.mp4").write_bytes(b"\x00" * 256)
    (data / "broken.txt").write_text("a broken clip")
    common = dict(trainable="mhla", max_train_steps=2, learning_rate=1e-2)
    train_wan.train(wan_options(base, data, tmp_path / "online", **common))
    cache = tmp_path / "cache"
    train_wan.train(wan_options(base, data, tmp_path / "cached", cache_latents=True, cache_dir=str(cache), **common))

    online, cached = metrics(tmp_path / "online"), metrics(tmp_path / "cached")
    assert cached[0]["data/skipped_corrupt"] == online[0]["data/skipped_corrupt"] == 1
    for a, b in zip([r for r in online if "loss" in r], [r for r in cached if "loss" in r]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    weights = [load_file(str(tmp_path / run / "final" / "mhla_weights.safetensors")) for run in ("online", "cached")]
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=1e-4, atol=1e-5)
    assert len(list((cache / "latents").rglob("*.safetensors"))) == 9
    assert len(list((cache / "prompts").rglob("*.safetensors"))) == 9 + 1  # 9 captions + the empty prompt

    # a complete cache needs neither the data nor any encoder
    real_load = train_wan.load_component

    def no_encoders(source, name, *args, **kwargs):
        assert name not in ("vae", "text_encoder", "tokenizer"), f"{name} loaded despite the cache"
        return real_load(source, name, *args, **kwargs)

    monkeypatch.setattr(train_wan, "load_component", no_encoders)
    shutil.rmtree(data)
    train_wan.train(wan_options(base, data, tmp_path / "again", cache_latents=True, cache_dir=str(cache), **common))
    with pytest.raises(ValueError, match="built with other settings .*max_sequence_length"):
        train_wan.train(
            wan_options(
                base,
                data,
                tmp_path / "other",
                cache_latents=True,
                cache_dir=str(cache),
                max_sequence_length=8,
                **common,
            )
        )


@pytest.fixture
def shapes(monkeypatch) -> list[tuple[int, ...]]:
    """The latent batch shapes the trainer draws flow-matching inputs for, in order (filled as a run trains)."""
    seen: list[tuple[int, ...]] = []
    real = train_wan.flow_match_inputs
    monkeypatch.setattr(
        train_wan,
        "flow_match_inputs",
        lambda latents, *a, **k: seen.append(tuple(latents.shape)) or real(latents, *a, **k),
    )
    return seen


@pytest.mark.slow
def test_images_and_videos_of_several_sizes_train_in_buckets(tmp_path, pipeline_dirs, shapes):
    data = tmp_path / "mixed"
    data.mkdir()
    write_video(data / "wide.mp4", 10, 32, 48)
    write_video(data / "tall.mp4", 10, 48, 32, direction="left")
    write_video(data / "short.mp4", 6, 32, 32)
    write_image(data / "still.png", 40, 40)
    for stem in ("wide", "tall", "short", "still"):
        (data / f"{stem}.txt").write_text(f"a {stem} thing")
    options = wan_options(
        pipeline_dirs["wan"],
        data,
        tmp_path / "run",
        resolution_buckets=[[32, 32], [32, 48], [48, 32]],
        frame_buckets=[5, 9],
        train_batch_size=1,
        max_train_steps=4,
        trainable="attention",
    )
    train_wan.train(options)
    assert sorted(shapes) == sorted([(1, 16, 3, 4, 6), (1, 16, 3, 6, 4), (1, 16, 2, 4, 4), (1, 16, 1, 4, 4)])


@pytest.mark.slow
def test_run_folders_are_never_reused_by_accident(tmp_path, pipeline_dirs, video_set):
    base = pipeline_dirs["wan"]
    user_folder = tmp_path / "mine"
    user_folder.mkdir()
    (user_folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a training run folder"):
        train_wan.train(wan_options(base, video_set, user_folder, overwrite_output_dir=True))
    assert (user_folder / "notes.txt").read_text() == "keep me"

    run = tmp_path / "run"
    train_wan.train(wan_options(base, video_set, run, trainable="mhla", max_train_steps=2))
    with pytest.raises(FileExistsError, match="already holds a training run"):
        train_wan.train(wan_options(base, video_set, run, trainable="mhla", max_train_steps=2))
    with pytest.raises(FileExistsError, match="nothing to resume"):  # finished, but without checkpoints
        train_wan.train(wan_options(base, video_set, run, trainable="mhla", max_train_steps=3, resume="latest"))
    train_wan.train(
        wan_options(
            base, video_set, run, trainable="mhla", max_train_steps=2, overwrite_output_dir=True, checkpointing_steps=5
        )
    )
    assert [s for s, _ in list_checkpoints(run)] == [2]  # the end of a run is always checkpointed
    # extend the finished run from its last checkpoint up to step 3
    train_wan.train(
        wan_options(base, video_set, run, trainable="mhla", max_train_steps=3, resume="latest", checkpointing_steps=5)
    )
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3]
    train_wan.train(wan_options(base, video_set, run, trainable="mhla", max_train_steps=1, overwrite_output_dir=True))
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1] and not list_checkpoints(run)


def test_bad_inputs_fail_before_any_model_is_loaded(tmp_path, pipeline_dirs, video_set, monkeypatch, capsys):
    monkeypatch.setattr(
        train_wan, "load_mhla_transformer", lambda *a, **k: pytest.fail("model loaded before the data check")
    )
    data = tmp_path / "data"
    make_video_set(data, with_image=False)
    (data / "clip3.txt").unlink()
    base = pipeline_dirs["wan"]
    with pytest.raises(ValueError, match=r"have no caption \(e.g. \['clip3.mp4'\]\)"):
        train_wan.train(wan_options(base, data, tmp_path / "run"))
    empty = tmp_path / "empty"
    empty.mkdir()
    code = train_wan.main(
        [
            "--pretrained_model",
            str(base),
            "--data_dir",
            str(empty),
            "--output_dir",
            str(tmp_path / "r2"),
            "--mixed_precision",
            "no",
            "--height",
            "32",
            "--width",
            "32",
            "--num_frames",
            "9",
        ]
    )
    assert code == 2 and "error: no videos or images found" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="pretrained_model .*no-model not found"):
        train_wan.train(wan_options(tmp_path / "no-model", video_set, tmp_path / "r3"))


@pytest.mark.slow
def test_images_train_under_an_auto_layout_with_more_frame_blocks(tmp_path, pipeline_dirs, shapes):
    """The auto layout is chosen for the 9-frame training size; an image (1 latent frame) leaves the
    layout's other frame blocks empty instead of stopping the run."""
    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "clip.mp4", 10, 32, 32)
    write_image(data / "still.png", 32, 32)
    write_image(data / "other.png", 32, 32, color=(200, 40, 40))
    for stem in ("clip", "still", "other"):
        (data / f"{stem}.txt").write_text(f"a {stem} thing")
    final = train_wan.train(
        wan_options(
            pipeline_dirs["wan"],
            data,
            tmp_path / "run",
            mhla={"layout": "auto"},
            train_batch_size=1,
            max_train_steps=3,
            trainable="mhla",
        )
    )
    layout = json.loads((final / "mhla_config.json").read_text())["mhla_config"]["layout"]
    assert layout[0] > 1  # more frame blocks than an image's single latent frame
    assert sorted(shapes) == [(1, 16, 1, 4, 4), (1, 16, 1, 4, 4), (1, 16, 3, 4, 4)]
    losses = [r["loss"] for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 3 and all(loss == loss and loss < float("inf") for loss in losses)
