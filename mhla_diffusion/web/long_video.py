"""The "Long video" tab: one video streamed chunk by chunk from a block-causal MHLA model, shown as it is made.

Its click event is a generator. The model streams in a worker thread (:meth:`ModelStore.stream_video`) and each
decoded chunk reaches the page at once: the newest frame (at 256 px, pixels kept square) and a line saying how
far the video is; the progress bar counts every denoising step of every chunk (``gr.Progress``). *Stop* ends the
video after the chunk being denoised, which is finished and kept: the frames made so far are written as an mp4
that the page plays and offers for download (the player's download button), as it does at the end of a whole
video. The frames are kept as ``uint8`` until then (129 frames of 48x48: 0.9 MB).

Import this module only after :func:`mhla_diffusion.web.app.prepare_environment` (it imports Gradio).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import gradio as gr
import numpy as np

from ..pipelines.interrupt import kept_line
from ..pipelines.outputs import float_to_uint8
from ..utils.geometry import MAX_SEED, VideoGeometry
from .config import DemoConfig
from .events import StopFlags, guarded, lenient_number, pick_seed, session_of, size_box
from .models import ModelStore
from .outputs import SessionOutputs
from .report import unknown_words_note
from .validation import LongVideoRequest, long_video_request, video_bounds

__all__ = ["LONG_VIDEO_CSS", "StreamState", "long_video_tab", "stream_long_video"]

#: The newest frame and the video at a readable size, pixels kept square (the files stay at their own size).
LONG_VIDEO_CSS = """
#long-frame img, #long-video video { width: 256px !important; height: 256px !important; object-fit: contain;
    image-rendering: pixelated; }
"""


@dataclass
class StreamState:
    """What a streamed long video has made so far: its frames ``(H, W, 3)`` as ``uint8`` and its chunks."""

    request: LongVideoRequest
    started: float
    frames: list[np.ndarray]
    chunks_done: int = 0

    def add(self, chunk: np.ndarray) -> None:
        """A decoded chunk ``(F_chunk, H, W, 3)`` (floats in [0, 1])."""
        self.frames.extend(float_to_uint8(chunk))
        self.chunks_done += 1

    @property
    def complete(self) -> bool:
        return self.chunks_done == self.request.chunks.num_chunks

    def progress_line(self) -> str:
        """The line under the newest frame while the video is being made."""
        r = self.request
        return (
            f"Chunk {self.chunks_done} of {r.chunks.num_chunks} done: {len(self.frames)} of {r.num_frames} frames "
            f"so far ({time.perf_counter() - self.started:.1f} s)"
        )

    def failed_line(self) -> str:
        """The line when the model failed after some chunks: what was kept."""
        r = self.request
        kept = kept_line(len(self.frames), r.num_frames, self.chunks_done, r.chunks.num_chunks)
        return f"Failed: {kept}. The video below holds them; its download button saves it."

    def final_line(self) -> str:
        """The line once the video has ended: complete, or stopped with what was kept."""
        r = self.request
        seconds = time.perf_counter() - self.started
        if self.complete:
            return f"Done: {r.num_frames} frames in {r.chunks.num_chunks} chunks, {seconds:.1f} s."
        kept = kept_line(len(self.frames), r.num_frames, self.chunks_done, r.chunks.num_chunks)
        return f"Stopped: {kept}, {seconds:.1f} s. The video below holds them; its download button saves it."


def _stream(
    store: ModelStore, request: LongVideoRequest, stop: threading.Event, abandon: threading.Event
) -> Iterator[tuple[str, Any]]:
    """Run :meth:`ModelStore.stream_video` in a worker thread; yields ``("step", (done, total))``,
    ``("frames", chunk)`` as they come, then ``("end", None)`` or ``("error", exception)``."""
    feed: queue.Queue[tuple[str, Any]] = queue.Queue()

    def work() -> None:
        try:
            store.stream_video(
                request,
                lambda chunk: feed.put(("frames", chunk)),
                lambda done, total: feed.put(("step", (done, total))),
                stop,
                abandon,
            )
            feed.put(("end", None))
        except BaseException as error:  # handed to the page's event, which shows it
            feed.put(("error", error))

    threading.Thread(target=work, name="long-video", daemon=True).start()
    while True:
        kind, value = feed.get()
        yield kind, value
        if kind in ("end", "error"):
            return


def _frame_rule(geometry: VideoGeometry, chunk_frames: int | None) -> str:
    """The frame counts a stream takes, for the form: ``2k+1`` (any chunk of 3, 2 or 1 latent frames), or with
    the model's chunk ``C``, ``1 + 2 (n x C - 1)``."""
    t = geometry.vae_scale_temporal
    return f"{t}k+1" if chunk_frames is None else f"1 + {t} (n x {chunk_frames} - 1)"


def _raise(error: BaseException) -> None:
    raise error


def stream_long_video(
    store: ModelStore,
    request: LongVideoRequest,
    stop: threading.Event,
    save: Callable[[np.ndarray], Any],
    progress: Callable[..., Any],
    unknown: Sequence[str] = (),
) -> Iterator[tuple[np.ndarray | None, str, Any]]:
    """The long-video event's updates ``(newest frame, line, video)``: one as it starts, one per decoded chunk
    (``video`` left as it is: ``gr.skip()``), and, once the video has ended, ``save(frames (F, H, W, 3) uint8)``
    (the file it wrote) with the line that says how it ended. A failure after some chunks saves those first,
    then raises the page's error; ``progress((done, total), desc=..., unit=...)`` is ``gr.Progress``'s call.
    ``unknown``: prompt words the model does not know (named in the lines)."""
    state = StreamState(request, time.perf_counter(), [])
    note = f"\n\n**Note:** {unknown_words_note(unknown)}" if unknown else ""
    n = request.chunks.num_chunks
    progress((0, n * request.steps), desc=f"chunk 1/{n}: starting", unit="steps")
    yield None, "Starting ..." + note, None
    abandon = threading.Event()
    failure: BaseException | None = None
    try:
        for kind, value in _stream(store, request, stop, abandon):
            if kind == "step":
                done, total = value
                progress((done, total), desc=f"chunk {(done - 1) // request.steps + 1}/{n}", unit="steps")
            elif kind == "frames":
                state.add(value)
                yield state.frames[-1], state.progress_line() + note, gr.skip()
            elif kind == "error":
                failure = value
    finally:
        abandon.set()  # the page went away or the event was cancelled: the worker ends at its next step
    if failure is not None and not state.frames:
        guarded(lambda: _raise(failure))
    path = save(np.stack(state.frames))
    line = state.final_line() if failure is None else state.failed_line()
    yield state.frames[-1], line + note, str(path)
    if failure is not None:
        guarded(lambda: _raise(failure))


def long_video_tab(
    config: DemoConfig, store: ModelStore, outputs: SessionOutputs, events: dict[str, Any], instant: dict[str, Any]
) -> StopFlags:
    """The tab's form, outputs and events (call inside ``gr.Tabs``); ``events`` / ``instant``: the keyword
    arguments of generation events and of events that never wait. Returns its stop flags (the page forgets a
    session's when it ends)."""
    stops = StopFlags()
    long_video = config.long_video
    with gr.Tab("Long video", id="long"):
        if long_video is None or long_video.model is None:
            gr.Markdown(
                long_video.missing if long_video is not None else "No long-video model.", elem_id="long-missing"
            )
            return stops
        geometry = VideoGeometry.from_folder(long_video.model)
        bounds = video_bounds(geometry, config.limits)
        multiples = geometry.generation_multiple
        limits = config.limits
        gr.Markdown(
            "One video made chunk by chunk by a block-causal MHLA model: each chunk attends to the ones before it "
            "through a state of constant size, so the model's memory does not grow with the length. Frames appear "
            "as each chunk is decoded; *Stop* ends the video after the current chunk and keeps what was made. "
            f"Model: `{Path(long_video.model).name or long_video.model}`",
            elem_id="long-intro",
        )
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", value=config.defaults.prompt, lines=2, elem_id="long-prompt")
                negative = gr.Textbox(label="Negative prompt", value="", elem_id="long-negative")
                with gr.Row():
                    seed = lenient_number(
                        gr.Number(label="Seed", value=0, precision=0, minimum=0, maximum=MAX_SEED, elem_id="long-seed")
                    )
                    dice = gr.Button("Random seed", elem_id="long-random-seed", scale=0)
                with gr.Row():
                    frames = lenient_number(
                        gr.Number(
                            label=f"Frames ({_frame_rule(geometry, long_video.chunk_frames)}, up to "
                            f"{limits.max_long_frames})",
                            value=long_video.num_frames,
                            precision=0,
                            minimum=1,
                            maximum=limits.max_long_frames,
                            elem_id="long-frames",
                        )
                    )
                    height, width = (
                        size_box("long", axis, value, low, high, multiple)
                        for axis, value, low, high, multiple in (
                            ("height", long_video.height, bounds.min_height, bounds.max_height, multiples[0]),
                            ("width", long_video.width, bounds.min_width, bounds.max_width, multiples[1]),
                        )
                    )
                steps = lenient_number(
                    gr.Slider(1, limits.max_steps, value=long_video.steps, step=1, label="Steps", elem_id="long-steps")
                )
                guidance = lenient_number(
                    gr.Slider(
                        0,
                        limits.max_guidance,
                        value=long_video.guidance_scale,
                        step=0.5,
                        label="Guidance scale",
                        elem_id="long-guidance",
                    )
                )
                with gr.Row():
                    run = gr.Button("Generate long video", variant="primary", elem_id="long-generate")
                    stop_button = gr.Button("Stop (keep what was made)", variant="stop", elem_id="long-stop")
            with gr.Column(scale=3):
                newest = gr.Image(label="Newest frame", type="numpy", format="png", elem_id="long-frame")
                status = gr.Markdown(elem_id="long-status")
                video = gr.Video(
                    label="Long video", elem_id="long-video", autoplay=True, loop=True, buttons=["download"]
                )

    def generate(
        prompt: str,
        negative_prompt: str,
        seed: float,
        steps: float,
        guidance: float,
        num_frames: float,
        height: float,
        width: float,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),
    ):
        checked = guarded(
            lambda: long_video_request(
                prompt,
                negative_prompt,
                seed,
                steps,
                guidance,
                num_frames,
                height,
                width,
                limits,
                geometry,
                long_video.chunk_frames,
            )
        )
        unknown = store.unknown_words(checked.prompt, "long-video")
        if unknown:
            gr.Warning(unknown_words_note(unknown))
        session = session_of(request)

        def save(frames: np.ndarray) -> Any:
            return outputs.save_video(session, frames, "long", long_video.fps)

        yield from stream_long_video(store, checked, stops.start(session), save, progress, unknown)

    def stop(request: gr.Request) -> None:
        """End this session's long video after its current chunk; what was made is kept."""
        stops.flag(session_of(request)).set()

    run.click(
        generate,
        [prompt, negative, seed, steps, guidance, frames, height, width],
        [newest, status, video],
        api_name="generate_long_video",
        show_progress_on=[video],  # the bar where the video will be, not over the frames as they come
        **events,
    )
    stop_button.click(stop, None, None, api_name="stop_long_video", **instant)
    dice.click(lambda: pick_seed(1), None, [seed], api_name="random_long_seed", **instant)
    return stops
