"""``attention: softmax``: the trainers train a model's own attention (softmax teachers from scratch),
write plain Diffusers outputs, and an MHLA fine-tune then starts from the written pipeline. Models
as the demo's: Wan with patch (1, 1, 1); DiT with 10 classes, patch 1, VAE x2, numeric class folders."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from helpers.finetune import assert_same_final_weights, dit_options, killed_and_resumed, metrics, wan_options
from helpers.media import make_digit_classes
from mhla_diffusion import get_mhla_conversion, load_transformer
from mhla_diffusion.finetune import train_dit, train_wan
from mhla_diffusion.finetune.engine import _cpu_copy
from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline


@pytest.fixture(scope="module")
def wan_patch1(tmp_path_factory):
    """A tiny stock WanPipeline folder whose transformer has patch (1, 1, 1): 32x32, 9 frames -> 3x4x4 tokens."""
    from mhla_diffusion.models.tiny import tiny_wan_pipeline, tiny_wan_transformer

    pipe = tiny_wan_pipeline()
    pipe.transformer = tiny_wan_transformer(patch_size=(1, 1, 1))
    folder = tmp_path_factory.mktemp("wan_patch1")
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A 10-class DiT pipeline (patch 1, VAE x2: 32 px -> 16x16 tokens; no id2label) and class folders 0..9."""
    from mhla_diffusion.models.tiny import tiny_dit_pipeline, tiny_dit_transformer

    root = tmp_path_factory.mktemp("digits")
    pipe = tiny_dit_pipeline()
    pipe.transformer = tiny_dit_transformer(sample_size=16, patch_size=1, num_embeds_ada_norm=10)
    pipe.save_pretrained(root / "pipeline")  # the stock DiTPipeline saves no id2label
    return root / "pipeline", make_digit_classes(root / "data")


def _equal_states(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_wan_softmax_teacher_then_mhla_student(tmp_path, wan_patch1, video_set):
    from diffusers import WanPipeline, WanTransformer3DModel

    teacher = tmp_path / "teacher"
    final = train_wan.train(
        wan_options(
            wan_patch1,
            video_set,
            teacher,
            attention="softmax",
            mhla={},
            max_train_steps=3,
            save_pipeline=True,
            validation_prompts=["a red square moving left"],
            validation_num_inference_steps=2,
        )
    )
    assert (final / "config.json").is_file() and not (final / "mhla_config.json").exists()
    stock = WanPipeline.from_pretrained(teacher / "pipeline")
    assert type(stock.transformer) is WanTransformer3DModel and get_mhla_conversion(stock.transformer) is None
    assert tuple(stock.transformer.config.patch_size) == (1, 1, 1)
    assert _equal_states(stock.transformer, load_transformer(str(final)))
    assert not _equal_states(stock.transformer, load_transformer(str(wan_patch1)))  # it trained
    assert MHLAWanPipeline.from_pretrained(teacher / "pipeline").mhla is None
    assert list((teacher / "validation" / "step-00000003").glob("*.mp4"))

    # the MHLA fine-tune starts from the teacher's pipeline folder, with attention transfer
    student = tmp_path / "student"
    train_wan.train(
        wan_options(
            teacher / "pipeline", video_set, student, attention_transfer_steps=2, max_train_steps=2, save_pipeline=True
        )
    )
    assert any("transfer/loss" in row for row in metrics(student))
    converted = MHLAWanPipeline.from_pretrained(student / "pipeline")
    assert converted.mhla is not None and converted.mhla.layout == (1, 2, 2)

    # a softmax run refuses a pipeline that already has MHLA layers, before touching its output folder
    with pytest.raises(ValueError, match="holds an MHLA transformer"):
        train_wan.train(wan_options(student / "pipeline", video_set, tmp_path / "again", attention="softmax", mhla={}))
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_wan_softmax_lora_and_size_checks(tmp_path, pipeline_dirs, wan_patch1, video_set):
    from diffusers import WanPipeline

    run = tmp_path / "lora"
    final = train_wan.train(
        wan_options(
            wan_patch1,
            video_set,
            run,
            attention="softmax",
            mhla={},
            trainable="lora",
            lora_rank=4,
            lora_alpha=4,
            max_train_steps=2,
            save_pipeline=True,
        )
    )
    assert sorted(p.name for p in final.iterdir()) == ["pytorch_lora_weights.safetensors"]
    base = WanPipeline.from_pretrained(wan_patch1)
    base.load_lora_weights(final)
    fused = WanPipeline.from_pretrained(run / "pipeline").transformer
    assert not any(".lora_" in name for name, _ in fused.named_parameters())
    assert not _equal_states(fused, load_transformer(str(wan_patch1)))

    # sizes are checked against the VAE scale x patch: 40 px is fine with patch 1, not with patch 2
    task = train_wan.WanTask(wan_options(wan_patch1, video_set, tmp_path / "a", resolution_buckets=[[32, 40]]))
    task._check_sizes()
    with pytest.raises(
        ValueError,
        match=r"32x40 .*width 40 must be a positive multiple of 16 \(VAE x4 in time and x8 "
        r"in space, patch 1x2x2\)",
    ):
        train_wan.train(wan_options(pipeline_dirs["wan"], video_set, tmp_path / "b", resolution_buckets=[[32, 40]]))
    assert not (tmp_path / "b").exists()


def test_wan_frame_counts_and_validation_sizes_follow_the_model(tmp_path, pipeline_dirs, wan_patch1, video_set):
    """The options take any positive sizes; the trainer judges them with the model's geometry, before any work.
    Validation sizes are also what Diffusers' WanPipeline takes (multiples of 16, even with patch 1)."""
    options = wan_options(wan_patch1, video_set, tmp_path / "a", num_frames=80, frame_buckets=[9])  # options take it
    with pytest.raises(
        ValueError, match=r"80 frames is not supported: use 4k\+1 \(1, 5, 9, 13, ...\) \(VAE x4 in time"
    ):
        train_wan.WanTask(options)._check_sizes()
    validation = dict(validation_prompts=["a cat"], validation_height=32)
    train_wan.WanTask(
        wan_options(wan_patch1, video_set, tmp_path / "b", validation_width=48, **validation)
    )._check_sizes()
    for model in (wan_patch1, pipeline_dirs["wan"]):
        task = train_wan.WanTask(wan_options(model, video_set, tmp_path / "c", validation_width=40, **validation))
        with pytest.raises(ValueError, match=r"validation size 32x40 .*width 40 must be a positive multiple of 16"):
            task._check_sizes()
    # sizes past the position encoding (tiny Wan: 32 RoPE positions per axis -> at most 512 px)
    task = train_wan.WanTask(
        wan_options(pipeline_dirs["wan"], video_set, tmp_path / "d", resolution_buckets=[[32, 528]])
    )
    with pytest.raises(ValueError, match="width 528 is larger than the model supports: at most 512"):
        task._check_sizes()


@pytest.mark.slow
def test_dit_softmax_teacher_resumes_and_seeds_an_mhla_student(tmp_path, digits):
    from diffusers import DiTPipeline, DiTTransformer2DModel

    base, data = digits
    common = dict(
        attention="softmax",
        resolution=32,
        random_flip=False,
        max_train_steps=4,
        checkpointing_steps=2,
        ema_decay=0.8,
        save_pipeline=True,
    )
    final = train_dit.train(
        dit_options(base, data, tmp_path / "a", validation_classes=["7"], validation_num_inference_steps=2, **common)
    )
    killed_and_resumed(train_dit.train, functools.partial(dit_options, base, data, **common), tmp_path / "b", at=3)
    for folder in assert_same_final_weights(tmp_path / "a", tmp_path / "b"):
        assert not (tmp_path / "a" / folder / "mhla_config.json").exists()
    raw = load_transformer(str(tmp_path / "a" / "final-no-ema"))
    assert not _equal_states(raw, load_transformer(str(final)))  # EMA
    copy = _cpu_copy(raw, raw.state_dict())  # the FSDP final save's rebuild
    assert get_mhla_conversion(copy) is None and _equal_states(copy, raw)

    stock = DiTPipeline.from_pretrained(tmp_path / "a" / "pipeline")
    assert type(stock.transformer) is DiTTransformer2DModel and get_mhla_conversion(stock.transformer) is None
    assert stock.labels == {str(i): i for i in range(10)}  # id2label from the class folders
    assert _equal_states(stock.transformer, load_transformer(str(final)))
    pipe = MHLADiTPipeline.from_pretrained(tmp_path / "a" / "pipeline")
    assert pipe.mhla is None
    image = pipe(["7"], num_inference_steps=2, output_type="np").images[0]  # guided: null class 10, not 1000
    assert image.shape == (32, 32, 3)
    assert list((tmp_path / "a" / "validation" / "step-00000004").glob("*.png"))

    student = tmp_path / "student"
    train_dit.train(
        dit_options(
            tmp_path / "a" / "pipeline",
            data,
            student,
            resolution=32,
            random_flip=False,
            attention_transfer_steps=2,
            max_train_steps=2,
            save_pipeline=True,
        )
    )
    converted = MHLADiTPipeline.from_pretrained(student / "pipeline")
    assert converted.mhla is not None and converted.labels["7"] == 7
    assert any("transfer/loss" in row for row in metrics(student))


@pytest.mark.slow
def test_trainers_run_back_to_back_in_one_process(tmp_path, digits):
    """Two CLI runs in one process with different precision and accumulation (Accelerate's singletons
    would refuse the second without the reset at the end of a run); no logging handlers pile up."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    base, data = digits
    args = [
        "--pretrained_model",
        str(base),
        "--data_dir",
        str(data),
        "--attention",
        "softmax",
        "--resolution",
        "32",
        "--max_train_steps",
        "1",
        "--train_batch_size",
        "2",
        "--report_to",
        "none",
        "--checkpointing_steps",
        "0",
        "--ema_decay",
        "0",
        "--random_flip",
        "false",
    ]
    assert train_dit.main([*args, "--output_dir", str(tmp_path / "a"), "--mixed_precision", "no"]) == 0
    handlers = list(logging.getLogger().handlers)
    assert not AcceleratorState._shared_state and not PartialState._shared_state and not GradientState._shared_state
    assert (
        train_dit.main(
            [
                *args,
                "--output_dir",
                str(tmp_path / "b"),
                "--mixed_precision",
                "bf16",
                "--gradient_accumulation_steps",
                "2",
            ]
        )
        == 0
    )
    assert logging.getLogger().handlers == handlers
    assert (tmp_path / "b" / "final" / "config.json").is_file()
