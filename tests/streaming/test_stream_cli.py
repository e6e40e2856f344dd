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


def _stream_past_the_rotary_table(folder, out, num_frames: int, call: dict, chunk_frames: str | None) -> None:
    """``--stream --num-frames num_frames`` from ``folder`` equals the pipeline's ``call`` frame for frame."""
    from mhla_diffusion.utils.geometry import VideoGeometry

    # the tiny model's rotary table holds 32 latent frames: one pass is capped at 125 frames, a stream is not
    assert VideoGeometry.from_folder(folder).max_size()[0] < num_frames
    extra = ("--num-frames", str(num_frames), "--format", "frames")
    assert text_to_video_stream(folder, out, *PROMPT, *extra, steps=1, chunk_frames=chunk_frames) == 0
    (written,) = [path for path in out.iterdir() if path.is_dir()]
    frames = np.stack([iio.imread(path) for path in sorted(written.glob("frame_*.png"))])
    settings = json.loads(written.with_suffix(".json").read_text())
    assert (settings["status"], settings["frames_written"], len(frames)) == ("complete", num_frames, num_frames)
    # one attention call sees one chunk: its latent frames x the 2 x 3 tokens of a frame
    assert settings["speed"]["attention_tokens"] == call["chunk_frames"] * 6
    pipe = MHLAWanStreamingPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    call = {**STREAM_CALL, "num_frames": num_frames, "num_inference_steps": 1, **call}
    np.testing.assert_array_equal(frames, float_to_uint8(pipe(**call, generator=seeded(4)).frames[0]))


def test_a_stream_of_129_frames_runs_past_the_rotary_table(causal_pipeline_dir, tmp_path):
    _stream_past_the_rotary_table(causal_pipeline_dir, tmp_path, 129, {"chunk_frames": 3}, "3")


@pytest.mark.slow  # 33 chunks, streamed twice
def test_a_stream_of_1025_frames_in_the_models_recorded_chunks(causal_pipeline_dir, tmp_path):
    import shutil

    from mhla_diffusion.utils.model_defaults import RECORD_KEY

    folder = shutil.copytree(causal_pipeline_dir, tmp_path / "model")
    index = json.loads((folder / "model_index.json").read_text())
    index[RECORD_KEY] = {"chunk_frames": 8, "first_chunk_frames": 1}  # 1 + 4 x (1 + 32 x 8 - 1) = 1025 frames
    (folder / "model_index.json").write_text(json.dumps(index))
    call = {"chunk_frames": 8, "first_chunk_frames": 1}
    _stream_past_the_rotary_table(folder, tmp_path / "out", 1025, call, None)


def test_ctrl_c_keeps_every_finished_chunk_and_completes_the_settings(
    causal_pipeline_dir, tmp_path, monkeypatch, capsys
):
    denoise, calls = MHLAWanStreamingPipeline._denoise_chunk, []

    def interrupted_in_chunk_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return denoise(self, *args, **kwargs)

    monkeypatch.setattr(MHLAWanStreamingPipeline, "_denoise_chunk", interrupted_in_chunk_3)
    assert text_to_video_stream(causal_pipeline_dir, tmp_path, *PROMPT) == 130
    (video,) = tmp_path.glob("*.mp4")
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1] == (
        f"mhla text-to-video: interrupted: kept 13 of 29 frames (2 of 4 chunks) in {video} "
        f"(settings: {video.with_suffix('.json')})"
    )
    settings = json.loads(video.with_suffix(".json").read_text())
    assert (settings["status"], settings["frames_written"], settings["chunks_written"]) == ("interrupted", 13, 2)
    assert settings["wall_time_s"] > 0
    assert iio.imread(video, plugin="pyav").shape == (13, 32, 48, 3)


def test_the_pipeline_call_hands_an_interrupt_what_it_delivered(causal_pipeline_dir, monkeypatch):
    from mhla_diffusion.pipelines.interrupt import GenerationInterrupted

    pipe = MHLAWanStreamingPipeline.from_pretrained(causal_pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    delivered = []

    def on_frames(frames):
        delivered.append(frames)
        if len(delivered) == 3:
            raise KeyboardInterrupt  # Ctrl-C while the third chunk is handed on

    with pytest.raises(GenerationInterrupted) as raised:
        pipe(**STREAM_CALL, generator=seeded(4), on_frames=on_frames)
    error = raised.value
    assert (error.frames_kept, error.chunks_done, error.num_chunks) == (13, 2, 4)
    assert str(error) == "interrupted: kept 13 of 29 frames (2 of 4 chunks)"
    np.testing.assert_array_equal(error.frames, np.concatenate(delivered[:2], axis=1))


def _streamed_subprocess(folder, out, num_frames: str):
    """``mhla text-to-video --stream`` as its own process group, in chunks of 1 latent frame."""
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "mhla_diffusion.cli", "text-to-video", "--stream", "--model", str(folder)]
    command += ["--output-dir", str(out), "--num-frames", num_frames, "--chunk-frames", "1", "--height", "32"]
    command += ["--width", "48", "--max-sequence-length", "16", "--steps", "2", *PROMPT]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Ctrl-C's default action even where this test runs with SIGINT ignored (a background job of a shell)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=default_sigint,
    )


def _wait_for_chunks(process, out, chunks: int) -> dict:
    """The settings JSON once it says ``chunks`` chunks are in the file."""
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for path in out.glob("*.json"):
            settings = json.loads(path.read_text())
            if settings.get("chunks_written", 0) >= chunks:
                return settings
        time.sleep(0.05)
    raise AssertionError("the stream wrote no chunks")


@pytest.mark.slow  # starts a process and kills it
def test_a_killed_stream_leaves_a_playable_video_with_every_finished_chunk(causal_pipeline_dir, tmp_path):
    import os
    import signal

    import imageio

    process = _streamed_subprocess(causal_pipeline_dir, tmp_path, "1001")
    try:
        _wait_for_chunks(process, tmp_path, 3)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    (video,) = tmp_path.glob("*.mp4")
    settings = json.loads(video.with_suffix(".json").read_text())  # as it was after the last finished chunk
    assert settings["status"] == "running" and settings["frames_written"] >= 9
    for frames in (iio.imread(video, plugin="pyav"), np.stack(list(iter(imageio.get_reader(video, "FFMPEG"))))):
        assert len(frames) >= settings["frames_written"] and frames.shape[1:] == (32, 48, 3)


@pytest.mark.slow  # starts a process and interrupts it
def test_ctrl_c_to_a_streaming_process_is_one_line(causal_pipeline_dir, tmp_path):
    import os
    import signal

    process = _streamed_subprocess(causal_pipeline_dir, tmp_path, "1001")
    try:
        _wait_for_chunks(process, tmp_path, 2)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends the terminal's process group
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, err
    lines = [line for line in err.splitlines() if "interrupted" in line or "Traceback" in line]
    (video,) = tmp_path.glob("*.mp4")
    settings = json.loads(video.with_suffix(".json").read_text())
    assert settings["status"] == "interrupted"
    assert lines == [
        f"mhla text-to-video: interrupted: kept {settings['frames_written']} of 1001 frames "
        f"({settings['chunks_written']} of 251 chunks) in {video} (settings: {video.with_suffix('.json')})"
    ]
    assert len(iio.imread(video, plugin="pyav")) == settings["frames_written"]


def test_a_stream_says_its_length_and_cost_and_loading_draws_no_bars(causal_pipeline_dir, tmp_path, capsys):
    assert text_to_video_stream(causal_pipeline_dir, tmp_path, *PROMPT, steps=1) == 0
    err = capsys.readouterr().err
    assert "--stream: 29 frames (1.8 s at 16 fps) in 4 chunks: 7 transformer forwards;" in err
    assert "Loading" not in err  # Diffusers' and transformers' loading bars: only the generation's bar is drawn


def test_a_block_causal_model_without_stream_is_said_to_stream(causal_pipeline_dir, tmp_path, capsys):
    from mhla_diffusion.cli import main

    command = ["text-to-video", "--model", str(causal_pipeline_dir), "--output-dir", str(tmp_path), *PROMPT]
    command += ["--num-frames", "9", "--height", "32", "--width", "48", "--steps", "1", "--max-sequence-length", "16"]
    assert main(command) == 0
    err = capsys.readouterr().err
    assert (
        f"note: {causal_pipeline_dir} is block-causal (made to stream): generating the clip in one block-causal" in err
    )
    assert "add --stream" in err


def test_a_pipeline_saved_from_a_published_model_keeps_its_size(tmp_path):
    from mhla_diffusion import MHLAConfig
    from mhla_diffusion.models.tiny import tiny_wan_pipeline
    from mhla_diffusion.utils.model_defaults import RECORD_KEY, video_defaults

    published = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"  # a published model's folder, recognised by its name
    tiny_wan_pipeline().save_pretrained(published)
    pipe = MHLAWanStreamingPipeline.from_pretrained(published)
    pipe.convert_to_mhla(MHLAConfig(layout=(1, 2, 2), causal=True))
    pipe.save_pretrained(tmp_path / "wan-causal")  # as docs/streaming.md saves it
    record = json.loads((tmp_path / "wan-causal" / "model_index.json").read_text())[RECORD_KEY]
    assert record == {"num_frames": 81, "height": 480, "width": 832, "fps": 16}
    assert video_defaults(tmp_path / "wan-causal").missing_size == []
