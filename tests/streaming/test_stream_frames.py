"""The chunk rule of streaming generation (utils/stream_frames.py): which frame counts stream in which chunks, the
default chunk, and the error that names the nearest counts that fit."""

from __future__ import annotations

import pytest

from mhla_diffusion.utils.stream_frames import stream_chunks


@pytest.mark.parametrize("chunk_frames", [1, 2, 3, 4])
@pytest.mark.parametrize("num_chunks", [1, 2, 5])
def test_whole_chunks_stream_and_their_frames_add_up(chunk_frames, num_chunks):
    num_frames = 1 + 4 * (num_chunks * chunk_frames - 1)
    chunks = stream_chunks(num_frames, chunk_frames)
    assert (chunks.chunk_frames, chunks.num_chunks, chunks.latent_frames) == (
        chunk_frames,
        num_chunks,
        num_chunks * chunk_frames,
    )
    decoded = [chunks.video_frames(i) for i in range(num_chunks)]
    assert decoded[0] == 1 + 4 * (chunk_frames - 1) and all(n == 4 * chunk_frames for n in decoded[1:])
    assert sum(decoded) == num_frames


@pytest.mark.parametrize(("num_frames", "chunk_frames"), [(81, 3), (29, 2), (25, 1), (1, 1), (9, 3)])
def test_the_default_chunk_is_the_largest_of_3_2_1_that_divides_the_latent_frames(num_frames, chunk_frames):
    assert stream_chunks(num_frames).chunk_frames == chunk_frames


@pytest.mark.parametrize(
    ("num_frames", "chunk_frames", "nearest"),
    [
        (30, 2, "nearest: 29 or 37"),  # 1 + 4 (2n - 1): 5, 13, 21, 29, 37
        (33, 2, "nearest: 29 or 37"),  # a count the VAE can produce, but 9 latent frames are not whole chunks of 2
        (13, 3, "nearest: 9 or 21"),
        (1, 2, "nearest: 5"),  # nothing below
        (0, None, "nearest: 1"),
        (10, None, "nearest: 9 or 13"),  # any 4k + 1 streams in the default chunks
    ],
)
def test_a_count_that_does_not_fit_names_the_nearest_that_do(num_frames, chunk_frames, nearest):
    with pytest.raises(ValueError, match=f"{num_frames} frames do not stream .*{nearest}$"):
        stream_chunks(num_frames, chunk_frames)


@pytest.mark.parametrize("bad", [0, -2, True, 2.5])
def test_chunk_frames_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="chunk_frames must be a positive number of latent frames"):
        stream_chunks(29, bad)


def test_chunks_follow_a_temporal_patch():
    assert stream_chunks(1 + 4 * 7, None, patch=2).chunk_frames == 2  # 8 latent frames: 3 is not a multiple of 2
    with pytest.raises(ValueError, match="multiple of the transformer's temporal patch size 2"):
        stream_chunks(21, 3, patch=2)


@pytest.mark.parametrize(("num_frames", "num_chunks"), [(1, 1), (9, 2), (17, 3), (129, 17)])
def test_a_first_chunk_of_one_latent_frame_then_chunks_of_4(num_frames, num_chunks):
    chunks = stream_chunks(num_frames, 4, temporal=2, first_chunk_frames=1)  # the embedded VAE: 1 + 2k -> 1 + k
    assert (chunks.num_chunks, chunks.first_frames, chunks.chunk_frames) == (num_chunks, 1, 4)
    sizes = [chunks.latent_frames_of(i) for i in range(num_chunks)]
    assert sizes == [1] + [4] * (num_chunks - 1) and sum(sizes) == chunks.latent_frames == (num_frames - 1) // 2 + 1
    decoded = [chunks.video_frames(i) for i in range(num_chunks)]
    assert decoded == [1] + [8] * (num_chunks - 1) and sum(decoded) == num_frames


def test_a_first_chunk_equal_to_the_others_is_the_plain_rule():
    assert stream_chunks(29, 2, first_chunk_frames=2) == stream_chunks(29, 2)
    assert stream_chunks(29, 2).first_frames == 2


def test_a_count_that_does_not_fit_a_first_chunk_names_the_nearest_that_do():
    with pytest.raises(
        ValueError, match=r"128 frames do not stream in a first chunk of 1 and chunks of 4 .*nearest: 121 or 129$"
    ):
        stream_chunks(128, 4, temporal=2, first_chunk_frames=1)
    with pytest.raises(ValueError, match="first_chunk_frames needs chunk_frames"):
        stream_chunks(129, None, temporal=2, first_chunk_frames=1)
    with pytest.raises(ValueError, match="first_chunk_frames must be a positive number of latent frames"):
        stream_chunks(129, 4, temporal=2, first_chunk_frames=0)
