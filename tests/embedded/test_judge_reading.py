"""The judges' readings of single samples: the value and confidence per attribute, compared with the prompt."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest

from mhla_diffusion.embedded import (
    JudgeReader,
    embedded_judge,
    generate_clips,
    requested_attributes,
    split_digits,
)
from mhla_diffusion.embedded.judges import judge_reading
from mhla_diffusion.pipelines.outputs import OutputPlan, save_image, save_video

#: Every level k / 255 and every half-step (k + 0.5) / 255 between them (the last one clamps to 255).
HALF_STEPS = np.concatenate([np.arange(256) / 255, (np.arange(256) + 0.5) / 255])


def test_real_clips_are_read_as_their_captions_with_confidence():
    reader = JudgeReader(embedded_judge("video"))
    clips, _, captions = generate_clips(8, seed=123)  # clips the judge never saw
    readings = reader.read_videos(clips, captions)
    assert [f"a {r.values['colour']} {r.values['shape']} moving {r.values['direction']}" for r in readings] == captions
    assert all(r.matches for r in readings)
    for reading in readings:
        assert 0 < reading.confidence <= min(reading.confidences.values()) <= 1
        assert reading.to_json()["reading"] == reading.text and reading.to_json()["matches_prompt"] is True
    # the same clip under another prompt: read the same, compared with what that prompt asks
    other = reader.read_videos(clips[:1], ["a cat"])[0]
    assert other.values == readings[0].values and other.matches is None and other.requested == {}
    # floats in [0, 1] (a pipeline's output) are read as the writers round them
    assert reader.read_videos(clips[:1] / 255.0, captions[:1])[0].values == readings[0].values


def test_requested_attributes_are_the_values_the_prompt_names_once():
    assert requested_attributes("A Red circle, moving LEFT!") == {
        "shape": "circle",
        "colour": "red",
        "direction": "left",
    }
    assert requested_attributes("a red or blue circle") == {"shape": "circle"}  # two colours: none asked


def test_samples_of_another_size_are_refused_and_digits_are_read():
    video = JudgeReader(embedded_judge("video"))
    assert video.unreadable((5, 48, 48, 3)) == "the judge reads 9-frame 48x48 clips, not 5x48x48"
    with pytest.raises(ValueError, match="9-frame 48x48 clips, not 5x48x48"):
        video.read_videos(np.zeros((1, 5, 48, 48, 3), np.uint8), ["a red circle moving left"])
    image = JudgeReader(embedded_judge("image"))
    split = split_digits(seed=0)
    images, labels = split.test_images[:20], split.test_labels[:20]
    readings = image.read_images(images, labels.tolist())
    assert np.mean([r.matches for r in readings]) >= 0.9
    assert {r.label for r in readings} <= {str(i) for i in range(10)}
    assert image.unreadable((64, 64, 3)) == "the judge reads 32x32 images, not 64x64"


class _Handed(Exception):
    """Stops a reading at the judge's input, carrying the uint8 samples handed to it."""


def _bytes_handed_to_the_judge(monkeypatch, read) -> np.ndarray:
    def stop(samples):
        raise _Handed(np.asarray(samples))

    monkeypatch.setattr(judge_reading, "images_to_tensor", stop)
    monkeypatch.setattr(judge_reading, "clips_to_tensor", stop)
    with pytest.raises(_Handed) as handed:
        read()
    return handed.value.args[0]


def test_the_judges_read_the_bytes_the_output_writers_save(tmp_path, monkeypatch):
    image = np.resize(HALF_STEPS, (32, 32, 3))
    written = iio.imread(save_image(image, OutputPlan(tmp_path / "image.png", tmp_path / "image.json")))
    reader = JudgeReader(embedded_judge("image"))
    read = _bytes_handed_to_the_judge(monkeypatch, lambda: reader.read_images(image[None], [None]))
    np.testing.assert_array_equal(read[0], written)

    clip = np.resize(HALF_STEPS, (9, 48, 48, 3))
    folder = save_video(clip, OutputPlan(tmp_path / "clip", tmp_path / "clip.json"), "frames", fps=8)
    written = np.stack([iio.imread(folder / f"frame_{i:04d}.png") for i in range(len(clip))])
    reader = JudgeReader(embedded_judge("video"))
    read = _bytes_handed_to_the_judge(monkeypatch, lambda: reader.read_videos(clip[None], ["a red circle moving left"]))
    np.testing.assert_array_equal(read[0], written)
