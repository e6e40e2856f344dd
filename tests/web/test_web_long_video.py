"""The "Long video" tab: its input checks and model settings (no server), and a streamed video through the shared
``demo_server`` (whose long-video model is the untrained stand-in of ``long_video_root``, 48x48, the embedded VAE's
2x time factor: 129 frames are 65 chunks of one latent frame) by API and in headless Chromium: frames appear while
it runs, Stop ends it after the current chunk, and the kept video holds exactly the frames made."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.web import BROWSER_ARGS, chromium

pytest.importorskip("gradio", reason="the web demo needs gradio (pip install -e .[test])")

EMBEDDED_T2V = Path(__file__).resolve().parents[2] / "mhla_diffusion" / "embedded" / "models" / "shapes-t2v-mhla"
PROMPT = "a red circle moving left"


def _request(chunk_frames: int | None = None, **changes):
    """``long_video_request`` for the embedded VAE's geometry, with the form's defaults unless ``changes``."""
    from mhla_diffusion.utils.geometry import VideoGeometry
    from mhla_diffusion.web.validation import Limits, long_video_request

    values = dict(prompt=PROMPT, negative_prompt="", seed=0, steps=2, guidance=2.0, num_frames=129, height=48, width=48)
    values.update(changes)
    return long_video_request(*values.values(), Limits(), VideoGeometry.from_folder(EMBEDDED_T2V), chunk_frames)


def _config(*argv: str):
    from mhla_diffusion.web.app import build_parser
    from mhla_diffusion.web.config import config_from_args

    return config_from_args(build_parser().parse_args(list(argv)))


def _kept_frames(chunks: int) -> int:
    """Frames of the first ``chunks`` chunks of one latent frame each with the embedded VAE: 1, then 2 a chunk."""
    return 1 + 2 * (chunks - 1)


# ---------------------------------------------------------------- checks before any model work


def test_a_long_video_request_is_cut_into_chunks():
    request = _request()
    assert (request.num_frames, request.height, request.width, request.steps) == (129, 48, 48, 2)
    assert (request.chunks.chunk_frames, request.chunks.num_chunks) == (1, 65)  # 65 latent frames: 5 x 13
    chunks = _request(num_frames=17).chunks  # 9 latent frames: chunks of 3 (the rule's first choice)
    assert (chunks.chunk_frames, chunks.num_chunks) == (3, 3)
    chunks = _request(chunk_frames=2, num_frames=15).chunks  # the model's own chunk: 8 latent frames, 4 chunks
    assert (chunks.chunk_frames, chunks.num_chunks) == (2, 4)


def test_a_frame_count_the_models_chunk_does_not_divide_names_the_nearest_that_fit():
    from mhla_diffusion.web.validation import DemoInputError

    with pytest.raises(
        DemoInputError, match=re.escape("Frames 129 is not supported: a streamed video has 1 + 2 x (n x 2 - 1) frames")
    ) as error:
        _request(chunk_frames=2)
    assert str(error.value).endswith("nearest: 127 or 131")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt": "  "}, "The prompt is empty: describe the video to generate"),
        (
            {"num_frames": 130},
            "Frames 130 is not supported: a streamed video has 2k + 1 frames (Wan's VAE maps 1 + 2k frames to "
            "1 + k latent frames); nearest: 129 or 131",
        ),
        ({"num_frames": 2000}, "Frames 2000 is out of range: use 1 to 1025"),
        ({"num_frames": "many"}, "Frames must be a whole number, got 'many'"),
        ({"num_frames": 12.5}, "Frames must be a whole number, got 12.5"),
        ({"steps": 0}, "Steps 0 is out of range: use 1 to 100"),
        ({"guidance": float("nan")}, "Guidance scale must be a finite number, got nan"),
        ({"seed": -1}, "Seed -1 is out of range: use 0 to 4294967295"),
        ({"height": 50}, "Height 50 is not supported: use a multiple of 16"),
        ({"width": 512}, "Width 512 is larger than the model supports: at most 256"),
    ],
)
def test_bad_long_video_inputs_are_one_readable_line(changes, message):
    from mhla_diffusion.web.validation import DemoInputError

    with pytest.raises(DemoInputError) as error:
        _request(**changes)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_long_video_settings_come_from_its_model(long_video_root):
    model = str(long_video_root / "shapes-long-mhla")
    long_video = _config("--long-model", model).long_video
    assert long_video.model == model and long_video.missing is None
    # 129 frames: 8x the embedded long-video model's 17-frame clips; the rest is the embedded model's own (the
    # stand-in's judges folder makes it an embedded folder)
    shown = (long_video.num_frames, long_video.height, long_video.width, long_video.steps, long_video.guidance_scale)
    assert shown == (129, 48, 48, 20, 2.0) and (long_video.fps, long_video.max_sequence_length) == (8, 16)
    assert _config("--long-model", model, "--long-num-frames", "33").long_video.num_frames == 33


def test_the_long_video_streams_with_the_chunk_its_model_records(long_video_root, tmp_path):
    import json
    import shutil

    shutil.copytree(long_video_root, tmp_path, dirs_exist_ok=True)
    index = tmp_path / "shapes-long-mhla" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_mhla_generation_defaults": {"chunk_frames": 2}}))
    model = str(tmp_path / "shapes-long-mhla")
    assert _config("--long-model", model, "--long-num-frames", "15").long_video.chunk_frames == 2
    with pytest.raises(ValueError, match=re.escape("129 frames do not stream in chunks of 2 latent frames")):
        _config("--long-model", model)  # the 129-frame default is 65 latent frames: not whole chunks of 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--long-model", str(EMBEDDED_T2V)], "has no block-causal MHLA layers: give a pipeline converted with"),
        (["--long-num-frames", "130"], "(--long-num-frames), does not suit"),
        (["--long-num-frames", "129", "--max-long-frames", "65"], "--long-num-frames 129 is more than --max-long"),
    ],
)
def test_a_long_video_model_or_default_that_cannot_stream_is_refused_at_start(long_video_root, argv, message):
    if "--long-model" not in argv:
        argv = ["--long-model", str(long_video_root / "shapes-long-mhla"), *argv]
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(*argv)


def test_without_the_embedded_long_video_model_the_tab_says_how_to_get_one(monkeypatch, tmp_path):
    from mhla_diffusion.embedded import locations
    from mhla_diffusion.web import config
    from mhla_diffusion.web.validation import Limits

    monkeypatch.setattr(
        config, "embedded_model", lambda task, attention: locations.embedded_model(task, attention, tmp_path)
    )
    long_video = config.resolve_long_video(None, None, Limits())
    assert long_video.model is None and long_video.num_frames == 129
    assert long_video.missing.startswith(
        "The embedded long-video model is not built yet: build it with `mhla build-embedded --stream`"
    )


# ---------------------------------------------------------------- the event's updates, on a stand-in for the model


class _Chunks:
    """A stand-in for ``ModelStore.stream_video``: chunk ``c`` is frames of value ``c / 100``; it ends after the
    chunk in which ``stop`` is seen, or raises ``failure`` after ``fail_after`` chunks."""

    def __init__(self, fail_after: int | None = None, failure: Exception = RuntimeError("out of memory")):
        self.fail_after, self.failure, self.stop_after = fail_after, failure, None

    def stream_video(self, request, on_frames, progress, stop, abandon):
        total = request.chunks.num_chunks * request.steps
        for chunk in range(request.chunks.num_chunks):
            if chunk == self.fail_after:
                raise self.failure
            for step in range(request.steps):
                progress(chunk * request.steps + step + 1, total)
            if chunk == self.stop_after:
                stop.set()
            on_frames(np.full((request.chunks.video_frames(chunk), 48, 48, 3), chunk / 100))
            if stop.is_set():
                return


def _run_event(store, request, unknown=()):
    """``stream_long_video``'s updates and progress calls, and the frames it saved (``None``: nothing saved)."""
    import threading

    from mhla_diffusion.web.long_video import stream_long_video

    saved, calls = [], []

    def save(frames):
        saved.append(frames)
        return "kept.mp4"

    updates = []
    error = None
    try:
        for update in stream_long_video(
            store, request, threading.Event(), save, lambda *a, **k: calls.append(a[0]), unknown
        ):
            updates.append(update)
    except Exception as raised:  # the page's error, checked by the caller
        error = raised
    return updates, calls, saved[0] if saved else None, error


def test_each_chunk_is_one_update_and_the_whole_video_is_saved_at_the_end():
    import gradio as gr

    request = _request(num_frames=9)  # 5 latent frames: 5 chunks of one, 1 + 4 x 2 frames
    updates, calls, saved, error = _run_event(_Chunks(), request)
    assert error is None and len(updates) == 1 + 5 + 1
    assert updates[0] == (None, "Starting ...", None)
    for chunk, (newest, line, video) in enumerate(updates[1:6], start=1):
        assert isinstance(video, type(gr.skip())) and newest.dtype == np.uint8
        assert line.startswith(f"Chunk {chunk} of 5 done: {_kept_frames(chunk)} of 9 frames so far")
        assert (newest == round(255 * (chunk - 1) / 100)).all()  # the chunk's own last frame
    assert saved.shape == (9, 48, 48, 3) and saved.dtype == np.uint8
    newest, line, video = updates[-1]
    assert video == "kept.mp4" and line.startswith("Done: 9 frames in 5 chunks")
    assert calls[0] == (0, 10) and calls[-1] == (10, 10) and len(calls) == 11  # every step of every chunk


def test_stop_saves_what_was_made_and_names_it():
    store = _Chunks()
    store.stop_after = 2
    updates, _, saved, error = _run_event(store, _request(num_frames=129))
    assert error is None and saved.shape[0] == _kept_frames(3) == 5
    assert updates[-1][1].startswith("Stopped: kept 5 of 129 frames (3 of 65 chunks)")


def test_a_failure_after_some_chunks_keeps_them_then_shows_the_error():
    import gradio as gr

    updates, _, saved, error = _run_event(_Chunks(fail_after=2), _request(num_frames=129), unknown=["zebra"])
    assert saved.shape[0] == 3 and updates[-1][2] == "kept.mp4"
    assert updates[-1][1].startswith("Failed: kept 3 of 129 frames (2 of 65 chunks).")
    assert "does not know 'zebra'" in updates[-1][1]
    assert isinstance(error, gr.Error) and "Generation failed (RuntimeError): out of memory" in str(error)
    updates, _, saved, error = _run_event(_Chunks(fail_after=0), _request(num_frames=129))
    assert saved is None and len(updates) == 1 and isinstance(error, gr.Error)


# ---------------------------------------------------------------- through the server


def _wait_for_outputs(job, count: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while len(job.outputs()) < count:
        assert not job.done(), f"the long video ended before {count} updates: {job.outputs()}"
        assert time.monotonic() < deadline, f"fewer than {count} updates within {timeout} s"
        time.sleep(0.05)
    return job.outputs()


@pytest.mark.slow  # a demo server process
def test_stop_keeps_the_frames_made_and_they_are_the_streams_own(client, long_video_root):
    import imageio.v3 as iio
    import imageio_ffmpeg
    import torch

    from mhla_diffusion import MHLAWanStreamingPipeline

    job = client.submit(PROMPT, "", 5, 2, 2.0, 129, 48, 48, api_name="/generate_long_video")
    updates = _wait_for_outputs(job, 3)  # "Starting", then the first two chunks' newest frames
    assert re.fullmatch(r"Chunk 2 of 65 done: 3 of 129 frames so far \(\d+\.\d s\)", updates[2][1]), updates[2]
    client.predict(api_name="/stop_long_video")
    newest, status, video = job.result(timeout=60)
    stopped = re.fullmatch(
        r"Stopped: kept (\d+) of 129 frames \((\d+) of 65 chunks\), \d+\.\d s\. The video below holds them; "
        r"its download button saves it\.",
        status,
    )
    assert stopped, status
    frames, chunks = int(stopped.group(1)), int(stopped.group(2))
    assert 2 <= chunks < 65 and frames == _kept_frames(chunks)
    video = video if isinstance(video, str) else video["video"]
    assert imageio_ffmpeg.count_frames_and_secs(video)[0] == frames
    # the newest frame shown is the stream's own last frame: the same call straight to the pipeline
    pipe = MHLAWanStreamingPipeline.from_pretrained(long_video_root / "shapes-long-mhla")
    pipe.set_progress_bar_config(disable=True)
    made: list[np.ndarray] = []

    def collect(chunk: np.ndarray) -> None:
        made.extend(chunk[0])
        if len(made) >= frames:
            pipe._interrupt = True  # the stream ends after the next chunk

    with torch.inference_mode():
        pipe(
            prompt=PROMPT,
            num_frames=129,
            height=48,
            width=48,
            num_inference_steps=2,
            guidance_scale=2.0,
            generator=torch.Generator("cpu").manual_seed(5),
            max_sequence_length=16,
            on_frames=collect,
            return_frames=False,
        )
    expected = np.clip(np.floor(255 * made[frames - 1].astype(np.float64) + 0.5), 0, 255)
    shown = iio.imread(newest if isinstance(newest, str) else newest["path"]).astype(np.float64)
    assert shown.shape == (48, 48, 3) and np.abs(shown - expected).max() <= 2  # the server runs 2 threads


@pytest.mark.slow  # a demo server process
def test_bad_long_video_input_through_the_api_is_a_readable_error(client):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=re.escape("Frames 130 is not supported: a streamed video has 2k + 1 frames")):
        client.predict(PROMPT, "", 0, 2, 2.0, 130, 48, 48, api_name="/generate_long_video")


# ---------------------------------------------------------------- in the browser

NEWEST_FRAME = """() => {
    const img = document.querySelector('#long-frame img');
    return img && img.complete && img.naturalWidth === 48 ? img.src : null;
}"""
VIDEO_LOADED = """() => {
    const v = document.querySelector('#long-video video');
    return v && v.src && v.readyState >= 2 && !v.error;
}"""


@pytest.mark.slow  # a demo server process
def test_a_long_video_streams_into_the_page_and_stop_keeps_it(demo_server, tmp_path):
    import imageio_ffmpeg
    from playwright.sync_api import sync_playwright

    executable = chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=BROWSER_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 1000}, accept_downloads=True).new_page()
            page.goto(demo_server.url, wait_until="domcontentloaded")
            page.get_by_role("tab", name="Long video").click()
            steps = page.locator("#long-steps input[type=number]")
            steps.wait_for(timeout=30_000)
            assert page.locator("#long-frames input").input_value() == "129"
            assert page.locator("#long-height input").input_value() == "48"
            steps.fill("2")
            steps.press("Enter")
            page.locator("#long-prompt textarea").fill(PROMPT)
            page.locator("#long-generate").click()
            # frames appear while the video is being made: two different newest frames, the line counting chunks,
            # the progress bar where the video will be, and no video yet
            first = page.wait_for_function(NEWEST_FRAME, timeout=60_000).json_value()
            page.locator("#long-status").get_by_text(re.compile(r"Chunk \d+ of 65 done")).wait_for(timeout=30_000)
            second = page.wait_for_function(
                f"(first) => {{ const src = ({NEWEST_FRAME})(); return src && src !== first ? src : null; }}",
                arg=first,
                timeout=30_000,
            ).json_value()
            assert second != first
            page.locator("#long-video").get_by_text(re.compile(r"chunk \d+/65")).wait_for(timeout=30_000)
            assert page.locator("#long-video video").count() == 0
            page.locator("#long-stop").click()
            status = page.locator("#long-status").get_by_text("Stopped: kept")
            status.wait_for(timeout=60_000)
            stopped = re.search(r"Stopped: kept (\d+) of 129 frames \((\d+) of 65 chunks\)", status.inner_text())
            assert stopped, status.inner_text()
            frames, chunks = int(stopped.group(1)), int(stopped.group(2))
            assert 2 <= chunks < 65 and frames == _kept_frames(chunks)
            page.wait_for_function(VIDEO_LOADED, timeout=30_000)
            with page.expect_download(timeout=30_000) as download:
                page.locator("#long-video").get_by_role("button", name="Download").click()
            kept = tmp_path / "kept.mp4"
            download.value.save_as(kept)
            assert imageio_ffmpeg.count_frames_and_secs(str(kept))[0] == frames
            assert "Traceback" not in page.content()
        finally:
            browser.close()
