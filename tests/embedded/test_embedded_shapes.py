"""Moving-shapes clips: determinism, geometry, colours, captions, and the Wan trainer's folder format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.shapes import centroids, fill_ratio, shape_mask
from mhla_diffusion.embedded import (
    ATTRIBUTES,
    BACKGROUND,
    COLOURS,
    DIRECTIONS,
    FRAME_SIZE,
    NUM_COMBINATIONS,
    NUM_FRAMES,
    caption_for,
    generate_clips,
    parse_caption,
    shape_clip,
    write_shapes_dataset,
)
from mhla_diffusion.finetune.media import probe
from mhla_diffusion.finetune.video_data import VideoTextDataset, index_video_folder


def test_clip_is_a_function_of_seed_and_index():
    a, b = shape_clip(5, 100, seed=3), shape_clip(5, 100, seed=3)
    assert a.frames.dtype == np.uint8 and a.frames.shape == (NUM_FRAMES, FRAME_SIZE, FRAME_SIZE, 3)
    assert np.array_equal(a.frames, b.frames) and a.caption == b.caption
    assert np.array_equal(shape_clip(5, 10, seed=3).frames, a.frames)  # independent of the dataset size
    others = [shape_clip(5, 100, seed=s).frames for s in range(4, 8)]
    assert not any(np.array_equal(a.frames, o) for o in others)


def test_each_run_of_48_clips_covers_every_prompt_once():
    _, labels, captions = generate_clips(2 * NUM_COMBINATIONS, seed=1)
    for half in (labels[:NUM_COMBINATIONS], labels[NUM_COMBINATIONS:]):
        assert len({tuple(row) for row in half}) == NUM_COMBINATIONS
    assert len(set(captions)) == NUM_COMBINATIONS
    assert not np.array_equal(labels[:NUM_COMBINATIONS], labels[NUM_COMBINATIONS:])  # a new permutation per run


@pytest.mark.parametrize("k", range(0, 96, 5))
def test_clip_shows_its_caption(k):
    clip = shape_clip(k, 96, seed=2)
    attrs = clip.attributes
    assert clip.caption == f"a {attrs['colour']} {attrs['shape']} moving {attrs['direction']}"
    assert parse_caption(clip.caption) == attrs
    assert clip.labels == {name: ATTRIBUTES[name].index(attrs[name]) for name in ATTRIBUTES}
    mask = shape_mask(clip.frames)
    assert mask.any(axis=(1, 2)).all()
    # the whole shape stays inside the frame: nothing on the border in any frame
    assert not (mask[:, 0].any() or mask[:, -1].any() or mask[:, :, 0].any() or mask[:, :, -1].any())
    colours = {tuple(c) for c in clip.frames.reshape(-1, 3)}
    assert colours == {BACKGROUND, COLOURS[attrs["colour"]]}
    motion = centroids(clip.frames)[-1] - centroids(clip.frames)[0]
    dx, dy = DIRECTIONS[attrs["direction"]]
    along = motion[0] * dx + motion[1] * dy
    across = motion[0] * dy - motion[1] * dx
    assert along >= 0.9 * (NUM_FRAMES - 1) and abs(across) < 1.0, (motion, attrs)
    ratio = fill_ratio(clip.frames[0])
    expected = {"square": (0.9, 1.0), "circle": (0.65, 0.9), "triangle": (0.35, 0.62)}[attrs["shape"]]
    assert expected[0] <= ratio <= expected[1], (ratio, attrs)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="outside the dataset"):
        shape_clip(10, 10)
    with pytest.raises(ValueError, match="colour"):
        parse_caption("a purple circle moving left")
    with pytest.raises(ValueError, match="form"):
        parse_caption("red circle to the left")
    with pytest.raises(ValueError, match="direction"):
        caption_for("circle", "red", "sideways")


def test_dataset_folder_reads_back_losslessly_through_the_wan_data_loader(tmp_path):
    folder = write_shapes_dataset(tmp_path / "shapes", num_clips=5, seed=4)
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == [shape_clip(k, 5, seed=4).caption for k in range(5)]
    first = folder / rows[0]["file_name"]
    info = probe(first)
    assert (info.num_frames, info.height, info.width, info.is_video) == (NUM_FRAMES, FRAME_SIZE, FRAME_SIZE, True)

    samples, report = index_video_folder(folder, [(FRAME_SIZE, FRAME_SIZE)], [NUM_FRAMES])
    assert report.used == 5 and [s.caption for s in samples] == [r["text"] for r in rows]
    assert all(s.bucket == (NUM_FRAMES, FRAME_SIZE, FRAME_SIZE) for s in samples)
    dataset = VideoTextDataset(samples)
    for index in (0, 4):
        item = dataset[(index, 0)]
        expected = shape_clip(index, 5, seed=4).frames
        decoded = ((item["pixels"].permute(1, 2, 3, 0) + 1) * 127.5).round().numpy().astype(np.uint8)
        assert np.array_equal(decoded, expected)

    with pytest.raises(FileExistsError):
        write_shapes_dataset(folder, num_clips=2)
    write_shapes_dataset(folder, num_clips=2, seed=4, overwrite=True)
    assert len(list((folder / "clips").iterdir())) == 2
