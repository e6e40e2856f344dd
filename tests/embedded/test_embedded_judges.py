"""Quality judges: short trainings beat chance on held-out data; save/load; the evaluator's feature path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhla_diffusion.embedded import (
    ATTRIBUTES,
    ImageJudge,
    VideoJudge,
    class_accuracy,
    clips_to_filmstrips,
    filmstrips_to_clips,
    generate_clips,
    judge_features,
    load_judge,
    load_judge_features,
    prompt_accuracy,
    save_judge,
    shape_clip,
    train_image_judge,
    train_video_judge,
)
from mhla_diffusion.embedded.worlds.moving_shapes import FRAME_SIZE, NUM_FRAMES
from mhla_diffusion.eval import ArrayImages, Reference, compute_activations, evaluate, frechet_distance


@pytest.fixture(scope="module")
def held_out_clips():
    return generate_clips(96, seed=7)  # the judges train on data_seed 1000


@pytest.fixture(scope="module")
def short_video_judge():
    return train_video_judge(steps=100, batch_size=16, width=8, embed_dim=32, lr=3e-3)


@pytest.mark.slow
def test_short_video_training_beats_chance_on_fresh_clips(short_video_judge, held_out_clips):
    judge = short_video_judge
    clips, labels, _ = held_out_clips
    accuracy = prompt_accuracy(judge, clips, labels)
    # chance: colour and direction 1/4. Shape needs a longer run (see train_video_judge's defaults).
    assert accuracy["colour"] >= 0.8 and accuracy["direction"] >= 0.8, accuracy
    by_name = [shape_clip(k, 96, seed=7).attributes for k in range(96)]
    assert prompt_accuracy(judge, clips, by_name) == accuracy


@pytest.mark.slow
def test_short_image_training_beats_chance_on_held_out_digits(digit_split):
    split = digit_split
    judge = train_image_judge(split.train_images, split.train_labels, steps=60, batch_size=64)
    accuracy = class_accuracy(judge, split.test_images, split.test_labels)
    assert accuracy >= 0.8, accuracy  # chance: 0.1


def test_bad_judge_input_is_named(held_out_clips):
    clips, labels, _ = held_out_clips
    judge = VideoJudge(width=4, embed_dim=8)
    with pytest.raises(ValueError, match="shape"):
        prompt_accuracy(judge, clips[:2], [{"shape": "star", "colour": "red", "direction": "up"}] * 2)
    with pytest.raises(ValueError, match="lack"):
        prompt_accuracy(judge, clips[:1], [{"shape": "circle"}])
    with pytest.raises(ValueError, match="attributes for 2 clips"):
        prompt_accuracy(judge, clips[:2], labels[:3])
    with pytest.raises(ValueError, match="uint8"):
        prompt_accuracy(judge, clips[:2].astype(np.float32), labels[:2])
    with pytest.raises(ValueError, match="labels"):
        class_accuracy(ImageJudge(width=4, embed_dim=8), np.zeros((2, 32, 32, 3), np.uint8), [0, 10])


def test_save_and_load_round_trip(tmp_path, held_out_clips):
    clips, _, _ = held_out_clips
    torch.manual_seed(1)
    video, image = VideoJudge(width=4, embed_dim=8), ImageJudge(width=4, embed_dim=8)
    save_judge(video, tmp_path / "video", metadata={"note": "untrained"})
    save_judge(image, tmp_path / "image")
    loaded = load_judge(tmp_path / "video")
    assert isinstance(loaded, VideoJudge) and loaded.metadata == {"note": "untrained"}
    x = torch.from_numpy(clips[:3]).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    with torch.no_grad():
        assert all(torch.equal(loaded(x)[k], video(x)[k]) for k in ATTRIBUTES)
        y = torch.zeros(2, 3, 32, 32)
        assert torch.equal(load_judge(tmp_path / "image")(y), image(y))
    features = load_judge_features(tmp_path / "video")
    assert features.weights_path.endswith("judge.safetensors") and len(features.weights_sha256) == 64
    with pytest.raises(FileExistsError):
        save_judge(video, tmp_path / "video")
    with pytest.raises(FileNotFoundError, match="not a saved judge"):
        load_judge(tmp_path)


@pytest.mark.slow
def test_video_judge_features_through_the_evaluator(short_video_judge, held_out_clips):
    clips, labels, _ = held_out_clips
    extractor = judge_features(short_video_judge)
    strips = clips_to_filmstrips(clips)
    assert strips.shape == (96, NUM_FRAMES * FRAME_SIZE, FRAME_SIZE, 3)
    assert np.array_equal(filmstrips_to_clips(strips, NUM_FRAMES), clips)
    out = extractor(torch.from_numpy(strips[:5]).permute(0, 3, 1, 2))
    assert out["pool"].shape == (5, extractor.pool_dim) == (5, 32)
    assert out["spatial"].shape == (5, *extractor.spatial_shape) == (5, FRAME_SIZE // 16, FRAME_SIZE // 16, 8)
    assert out["logits_unbiased"].shape == (5, extractor.num_logits) == (5, 11)
    with pytest.raises(ValueError, match="filmstrips"):
        extractor(torch.zeros(2, 3, 64, 64, dtype=torch.uint8))

    reds = strips[labels[:, 1] == ATTRIBUTES["colour"].index("red")]
    blues = strips[labels[:, 1] == ATTRIBUTES["colour"].index("blue")]
    red1, red2, blue = (
        compute_activations(ArrayImages(x), extractor, 16, progress=False).pool_stats
        for x in (reds[:12], reds[12:], blues[:12])
    )
    # the judge has learnt colour: red vs blue is further apart than red vs other red clips
    assert frechet_distance(red1, blue) > 2 * frechet_distance(red1, red2)
    # 12 clips in 32 dimensions: a singular covariance, so the self-distance is 0 up to round-off
    assert abs(frechet_distance(red1, red1)) < 1e-4 * frechet_distance(red1, blue)
    report = evaluate(
        ArrayImages(strips), Reference("same", ArrayImages(strips)), extractor, batch_size=32, progress=False
    )
    assert abs(report["metrics"]["fid"]) < 1e-6 and report["metrics"]["precision"] == report["metrics"]["recall"] == 1.0


def test_image_judge_features_through_the_evaluator(digit_split):
    split = digit_split
    torch.manual_seed(3)
    extractor = judge_features(ImageJudge(width=8, embed_dim=16))
    images = split.test_images[:64]
    out = extractor(torch.from_numpy(images).permute(0, 3, 1, 2))
    assert out["pool"].shape == (64, 16) and out["spatial"].shape == (64, 8, 8, 8)
    assert out["logits_unbiased"].shape == (64, 10)
    bigger = torch.from_numpy(np.repeat(np.repeat(images[:4], 2, 1), 2, 2)).permute(0, 3, 1, 2)
    assert extractor(bigger)["pool"].shape == (4, 16)  # other sizes are resized
    report = evaluate(
        ArrayImages(images), Reference("same", ArrayImages(images)), extractor, batch_size=32, progress=False
    )
    assert abs(report["metrics"]["fid"]) < 1e-6
    ones, sevens = split.test_images[split.test_labels == 1], split.test_images[split.test_labels == 7]
    fid = evaluate(
        ArrayImages(ones),
        Reference("sevens", ArrayImages(sevens)),
        extractor,
        progress=False,
        with_precision_recall=False,
    )["metrics"]["fid"]
    assert fid > 1e-3
