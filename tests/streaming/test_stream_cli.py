"""``mhla text-to-video --stream`` (cli/stream.py, cli/generate.py) on the causal tiny pipeline: a video 4x longer
than its base chunk written while it runs, frame for frame what the pipeline gives, and every refusal before any
model loads."""

from __future__ import annotations

import json
import re

import imageio.v3 as iio
import numpy as np
import pytest

from helpers.models import seeded
from helpers.streaming import STREAM_CALL, text_to_video_stream
from mhla_diffusion import MHLAWanStreamingPipeline
from mhla_diffusion.pipelines import outputs
from mhla_diffusion.pipelines.outputs import float_to_uint8

PROMPT = ("--prompt", "a red circle moving left", "--negative-prompt", "blue", "--guidance-scale", "3", "--seed", "4")


def test_frames_are_appended_while_the_stream_runs_and_equal_the_pipelines(causal_pipeline_dir, tmp_path, monkeypatch):
    events = []
    denoise = MHLAWanStreamingPipeline._denoise_chunk
    append = outputs.VideoWriter.append

    def denoise_chunk(self, *args, **kwargs):
        events.append("denoise")
        return denoise(self, *args, **kwargs)

    def append_frames(self, frames):
        append(self, frames)
        events.append(len(list(self.plan.media.glob("*.png"))))  # the frames on disk now

    monkeypatch.setattr(MHLAWanStreamingPipeline, "_denoise_chunk", denoise_chunk)
    monkeypatch.setattr(outputs.VideoWriter, "append", append_frames)
    assert text_to_video_stream(causal_pipeline_dir, tmp_path, *PROMPT, "--format", "frames") == 0
    # each chunk's frames are on disk before the next chunk is denoised: 5, then 8 more per chunk
    assert events == ["denoise", 5, "denoise", 13, "denoise", 21, "denoise", 29]
    (folder,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    written = np.stack([iio.imread(path) for path in sorted(folder.glob("frame_*.png"))])
    settings = json.loads(folder.with_suffix(".json").read_text())
    assert (settings["stream"], settings["chunk_frames"], settings["num_chunks"], settings["num_frames"]) == (
        True,
        2,
        4,
        29,
    )
    monkeypatch.undo()
    pipe = MHLAWanStreamingPipeline.from_pretrained(causal_pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(**STREAM_CALL, generator=seeded(4)).frames[0]
    np.testing.assert_array_equal(written, float_to_uint8(frames))


def test_a_block_causal_softmax_model_streams_from_the_command_line(block_causal_softmax_dir, tmp_path):
    assert (
        text_to_video_stream(
            block_causal_softmax_dir, tmp_path, *PROMPT, "--attention", "softmax", "--format", "frames"
        )
        == 0
    )
    (folder,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    written = np.stack([iio.imread(path) for path in sorted(folder.glob("frame_*.png"))])
    pipe = MHLAWanStreamingPipeline.from_pretrained(block_causal_softmax_dir)
    pipe.set_progress_bar_config(disable=True)
    np.testing.assert_array_equal(written, float_to_uint8(pipe(**STREAM_CALL, generator=seeded(4)).frames[0]))


def test_a_models_recorded_first_chunk_and_context_noise_stream_from_the_command_line(causal_pipeline_dir, tmp_path):
    from helpers.models import with_record
    from mhla_diffusion.cli import main

    record = {"chunk_frames": 2, "first_chunk_frames": 1, "context_noise": 0.2}
    folder = with_record(causal_pipeline_dir, tmp_path / "model", record)
    size = ("--num-frames", "25", "--height", "32", "--width", "48", "--max-sequence-length", "16", "--steps", "2")
    out = tmp_path / "out"
    command = ["text-to-video", "--stream", "--model", str(folder), "--output-dir", str(out), *size, *PROMPT]
    assert main([*command, "--format", "frames"]) == 0
    (video,) = [path for path in out.iterdir() if path.is_dir()]
    written = np.stack([iio.imread(path) for path in sorted(video.glob("frame_*.png"))])
    settings = json.loads(video.with_suffix(".json").read_text())
    assert (settings["chunk_frames"], settings["first_chunk_frames"], settings["num_chunks"]) == (2, 1, 4)
    pipe = MHLAWanStreamingPipeline.from_pretrained(causal_pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    call = {**STREAM_CALL, "num_frames": 25, "first_chunk_frames": 1, "context_noise": 0.2}
    np.testing.assert_array_equal(written, float_to_uint8(pipe(**call, generator=seeded(4)).frames[0]))


@pytest.mark.slow  # imageio's ffmpeg writer is a process
def test_a_streamed_mp4_holds_every_frame(causal_pipeline_dir, tmp_path):
    import imageio

    assert text_to_video_stream(causal_pipeline_dir, tmp_path, *PROMPT, steps=1) == 0
    (video,) = tmp_path.glob("*.mp4")
    with imageio.get_reader(video, format="FFMPEG") as reader:
        assert reader.count_frames() == 29
    assert json.loads(video.with_suffix(".json").read_text())["output"] == str(video)


@pytest.mark.parametrize(
    ("folder", "extra", "message"),
    [
        ("causal", ("--num-frames", "30"), "30 frames do not stream in chunks of 2 latent frames:.*nearest: 29 or 37"),
        ("causal", ("--num-frames", "37", "--chunk-frames", "3"), "nearest: 33 or 45"),
        ("causal", ("--context-parallel", "2"), r"--stream has no context parallelism.*leave out --context-parallel"),
        ("causal", ("--format", "gif"), "use --format mp4 or frames"),
        ("causal", ("--attention", "softmax"), "leave out --attention softmax"),
        ("mhla", (), r"not block-causal ones: convert it with MHLAConfig\(causal=True\)"),
        ("softmax", (), r"has no MHLA layers: convert it with MHLAConfig\(causal=True\).*softmax_block_causal: true"),
        ("softmax", ("--attention", "softmax"), "is not one: train it with softmax_block_causal: true"),
        ("block-causal softmax", (), "a block-causal softmax model .*stream it with --attention softmax"),
    ],
)
def test_bad_streams_are_one_line_before_any_model_loads(
    causal_pipeline_dir, block_causal_softmax_dir, pipeline_dirs, tmp_path, capsys, monkeypatch, folder, extra, message
):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the command was refused")

    monkeypatch.setattr(MHLAWanStreamingPipeline, "from_pretrained", no_loading)
    model = {
        "causal": causal_pipeline_dir,
        "mhla": pipeline_dirs["wan"],
        "softmax": pipeline_dirs["wan"],
        "block-causal softmax": block_causal_softmax_dir,
    }[folder]
    weights = ("--mhla-weights", str(pipeline_dirs["wan_mhla"])) if folder == "mhla" else ()
    assert text_to_video_stream(model, tmp_path / "out", "--prompt", "a cat", *weights, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_chunk_frames_needs_stream(pipeline_dirs, tmp_path, capsys):
    from helpers.cli import text_to_video

    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "a cat", "--chunk-frames", "2") == 2
    assert "--chunk-frames is for --stream" in capsys.readouterr().err
