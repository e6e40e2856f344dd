"""Bouncing shapes: motion that never ends, clips that extend each other, judge windows labelled by their motion."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest

from mhla_diffusion.embedded.worlds.bouncing_shapes import (
    SPEED_RANGE,
    bounce_path,
    bouncing_clip,
    bouncing_windows,
    render_bouncing,
)
from mhla_diffusion.embedded.worlds.moving_shapes import ATTRIBUTES, DIRECTIONS, FRAME_SIZE
from mhla_diffusion.embedded.worlds.shapes_dataset import write_shapes_dataset


def test_bounce_path_reflects_at_both_ends_and_keeps_its_speed():
    path = bounce_path(5.0, 2.0, 0.0, 10.0, 30)
    assert path.min() >= 0.0 and path.max() <= 10.0
    assert np.allclose(path[:4], [5, 7, 9, 9])  # 9 + 2 = 11 reflects to 9
    steps = np.abs(np.diff(path))
    assert steps.max() <= 2.0 + 1e-9
    assert np.isclose(np.median(steps), 2.0)
    with pytest.raises(ValueError, match="low < high"):
        bounce_path(11.0, 1.0, 0.0, 10.0, 3)


@pytest.mark.parametrize("k", range(6))
def test_a_clip_stays_in_the_frame_moves_first_as_its_caption_says_and_bounces(k):
    clip = bouncing_clip(k, 48, seed=3, num_frames=129)
    x, y = clip.centres.T
    assert SPEED_RANGE[0] <= clip.speed <= SPEED_RANGE[1]
    assert x.min() >= clip.radius - 1e-9 and x.max() <= FRAME_SIZE - 1 - clip.radius + 1e-9
    assert y.min() >= clip.radius - 1e-9 and y.max() <= FRAME_SIZE - 1 - clip.radius + 1e-9
    dx, dy = DIRECTIONS[clip.attributes["direction"]]
    moved = clip.centres[1] - clip.centres[0]
    assert np.sign(moved[0]) == dx and np.sign(moved[1]) == dy or np.allclose(moved, 0)
    jumps = np.linalg.norm(np.diff(clip.centres, axis=0), axis=1)
    assert jumps.max() <= clip.speed + 1e-9  # never faster than its speed, also at a bounce
    axis = 0 if dx else 1
    assert (np.diff(clip.centres[:, axis]) * (dx or dy) < 0).any(), "129 frames hold at least one bounce"
    # two colours only: background and the shape's
    assert len(np.unique(clip.frames.reshape(-1, 3), axis=0)) == 2


def test_a_longer_clip_begins_with_the_shorter_one_and_windows_draw_only_their_frames():
    short, long = bouncing_clip(7, 48, 1, 17), bouncing_clip(7, 48, 1, 65)
    assert np.array_equal(short.frames, long.frames[:17]) and np.array_equal(short.centres, long.centres[:17])
    window = bouncing_clip(7, 48, 1, 65, first=40)
    assert np.array_equal(window.frames, long.frames[40:]) and np.array_equal(window.centres, long.centres[40:])
    frames, centres = render_bouncing("circle", "red", "left", (20.0, 20.0), 12.0, 2.0, 9)
    assert frames.shape == (9, FRAME_SIZE, FRAME_SIZE, 3) and centres.shape == (9, 2)
    with pytest.raises(ValueError, match="first must be"):
        render_bouncing("circle", "red", "left", (20.0, 20.0), 12.0, 2.0, 9, first=9)


def test_window_labels_follow_the_motion_in_the_window():
    windows, labels, captions = bouncing_windows(64, seed=2)
    assert windows.shape == (64, 9, FRAME_SIZE, FRAME_SIZE, 3) and labels.shape == (64, 3)
    reversed_ = 0
    for (shape, colour, direction), caption in zip(labels, captions):
        words = caption.split()
        assert ATTRIBUTES["shape"][shape] == words[2] and ATTRIBUTES["colour"][colour] == words[1]
        start, now = DIRECTIONS[words[4]], DIRECTIONS[ATTRIBUTES["direction"][direction]]
        assert now in (start, (-start[0], -start[1]))  # the caption's axis, either way
        reversed_ += now != start
    assert 0 < reversed_ < 64  # windows after a bounce read the reversed direction
    again = bouncing_windows(64, seed=2, start=10, count=3)
    assert np.array_equal(again[0], windows[10:13]) and np.array_equal(again[1], labels[10:13])


def test_the_dataset_writer_writes_bouncing_clips_of_the_asked_length(tmp_path):
    folder = write_shapes_dataset(tmp_path / "data", 3, seed=5, bouncing_frames=17)
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    assert [row["num_frames"] for row in rows] == [17, 17, 17]
    clip = bouncing_clip(1, 3, 5, 17)
    assert np.array_equal(iio.imread(folder / rows[1]["file_name"]), clip.frames)
    assert rows[1]["text"] == clip.caption
