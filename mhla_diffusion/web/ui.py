"""The Gradio page: a text-to-video tab and a class-to-image tab, MHLA beside softmax, and a "Long video" tab
(:mod:`.long_video`) that streams one video chunk by chunk.

Each click generates a small gallery of samples (seeds ``seed``, ``seed + 1``, ...) per attention,
shown at 256 px with nearest-neighbour scaling (:data:`PAGE_CSS`; the files the gallery downloads are
the native-size PNG / mp4), each captioned with its seed and, for an embedded model, the judge's reading.
The form's size limits are the model's own (:func:`~mhla_diffusion.web.validation.video_bounds`); a stop
button ends a running generation after its current denoising step; unknown prompt words are named
under the prompt as it is typed.

Import this module only after :func:`mhla_diffusion.web.app.prepare_environment` (it turns
analytics off and points Gradio's cache into the demo's temporary folder before Gradio loads).
"""

from __future__ import annotations

import os
from typing import Any, Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no telemetry threads

import gradio as gr

from ..embedded.locations import embedded_folder
from ..utils.choices import ATTENTIONS, Attention
from ..utils.geometry import MAX_SEED, VideoGeometry
from .config import DemoConfig
from .events import StopFlags, guarded, lenient_number, pick_seed, session_of, size_box
from .long_video import LONG_VIDEO_CSS, long_video_tab
from .models import Generated, ModelStore
from .outputs import SessionOutputs
from .report import (
    TITLES,
    caption,
    example_prompts,
    intro_markdown,
    summary,
    unknown_words_note,
    vocabulary_markdown,
)
from .validation import Limits, image_request, video_bounds, video_request

__all__ = ["PAGE_CSS", "build_demo"]

#: Events share this concurrency group, so the queue's limit covers both tabs together.
CONCURRENCY_ID = "generate"
#: Samples at a readable size: 256 px cells, nearest-neighbour scaling (the files stay at native size),
#: captions under the sample instead of over it. (Gradio's gallery class names; the browser test measures the result.)
DISPLAY_PX = 256
PAGE_CSS = f"""
.mhla-samples .grid-wrap {{ height: auto !important; max-height: none !important; overflow: visible !important; }}
.mhla-samples .grid-container {{ grid-template-columns: repeat(auto-fill, {DISPLAY_PX + 8}px) !important; }}
.mhla-samples .thumbnail-item {{ width: {DISPLAY_PX}px; height: auto !important; aspect-ratio: auto !important;
    box-sizing: content-box; display: flex; flex-direction: column; }}
.mhla-samples .thumbnail-item img, .mhla-samples .thumbnail-item video {{ width: {DISPLAY_PX}px !important;
    height: {DISPLAY_PX}px !important; object-fit: contain; }}
.mhla-samples img, .mhla-samples video {{ image-rendering: pixelated; }}
.mhla-samples .caption-label {{ position: static !important; max-width: {DISPLAY_PX}px !important;
    white-space: normal !important; transform: none !important; }}
#t2v-unknown p {{ color: var(--error-text-color); font-weight: 600; }}
#t2v-summary th, #c2i-summary th, #t2v-summary td:first-child, #c2i-summary td:first-child {{ white-space: nowrap; }}
{LONG_VIDEO_CSS}"""
#: After a video generation: the gallery's videos play, muted and looped.
PLAY_VIDEOS = """() => { setTimeout(() => {
    for (const video of document.querySelectorAll('#t2v-mhla video, #t2v-softmax video')) {
        video.muted = true; video.loop = true; video.play().catch(() => {});
    }
}, 500); }"""


def _runs(compare: bool) -> list[Attention]:
    return list(ATTENTIONS) if compare else ["mhla"]


def _run_compared(
    compare: bool,
    steps: int,
    progress: gr.Progress,
    generate: Callable[[Attention, Callable[[int, int], None]], Generated],
    save: Callable[[Generated], list[Any]],
) -> tuple[list[Generated], dict[str, list[Any]]]:
    """MHLA (and, with ``compare``, softmax) one after the other on one progress bar; the results
    and ``{attention: the saved samples}``."""
    runs = _runs(compare)
    results, paths = [], {}
    for index, attention in enumerate(runs):
        progress((index * steps, len(runs) * steps), desc=f"{TITLES[attention]}: starting")
        result = generate(attention, _progress_for(progress, index, len(runs), steps, attention))
        results.append(result)
        paths[attention] = save(result)
    return results, paths


def _progress_for(progress: gr.Progress, index: int, count: int, steps: int, attention: Attention):
    def report(step: int, total: int) -> None:
        progress((index * steps + step, count * steps), desc=f"{TITLES[attention]}: step {step}/{total}", unit="steps")

    return report


def _galleries(results: list[Generated], paths: dict[str, list[Any]]) -> tuple[list[tuple[str, str]], ...]:
    """(MHLA gallery, softmax gallery): ``(file, caption)`` per sample; an empty softmax gallery without compare."""
    by_attention = {r.attention: r for r in results}
    galleries = []
    for attention in ATTENTIONS:
        result = by_attention.get(attention)
        galleries.append(
            []
            if result is None
            else [
                (str(path), caption(seed, reading))
                for path, seed, reading in zip(paths[attention], result.seeds, result.readings)
            ]
        )
    return tuple(galleries)


def _seed_row(tab: str, samples: int, limits: Limits) -> tuple[Any, Any, Any]:
    """A tab's seed box, its random-seed button and the samples slider, in one row (``tab``: the elem_id prefix)."""
    with gr.Row():
        seed = lenient_number(
            gr.Number(label="Seed", value=0, precision=0, minimum=0, maximum=MAX_SEED, elem_id=f"{tab}-seed")
        )
        dice = gr.Button("Random seed", elem_id=f"{tab}-random-seed", scale=0)
        count = lenient_number(
            gr.Slider(
                1,
                limits.max_samples,
                value=samples,
                step=1,
                label="Samples (seeds seed, seed+1, ...)",
                elem_id=f"{tab}-samples",
            )
        )
    return seed, dice, count


def _run_controls(tab: str, what: str, steps: int, guidance: float, limits: Limits) -> tuple[Any, ...]:
    """A tab's steps and guidance sliders, its compare box and its generate and stop buttons, in that order."""
    steps_slider = lenient_number(
        gr.Slider(1, limits.max_steps, value=steps, step=1, label="Steps", elem_id=f"{tab}-steps")
    )
    guidance_slider = lenient_number(
        gr.Slider(0, limits.max_guidance, value=guidance, step=0.5, label="Guidance scale", elem_id=f"{tab}-guidance")
    )
    compare = gr.Checkbox(value=True, label="Compare with softmax attention (same seeds)", elem_id=f"{tab}-compare")
    with gr.Row():
        run = gr.Button(f"Generate {what}", variant="primary", elem_id=f"{tab}-generate")
        stop = gr.Button("Stop", variant="stop", elem_id=f"{tab}-stop")
    return steps_slider, guidance_slider, compare, run, stop


def _results_column(tab: str) -> tuple[Any, Any, Any]:
    """A tab's output column: the MHLA gallery, the softmax gallery and the summary under them."""
    with gr.Column(scale=3):
        galleries = [
            gr.Gallery(
                label=TITLES[attention],
                elem_id=f"{tab}-{attention}",
                elem_classes=["mhla-samples"],
                height="auto",
                object_fit="contain",
            )
            for attention in ATTENTIONS
        ]
        info = gr.Markdown(elem_id=f"{tab}-summary")
    return (*galleries, info)


def build_demo(config: DemoConfig, store: ModelStore, outputs: SessionOutputs) -> gr.Blocks:
    """The Blocks app (not launched; launch it with ``css=PAGE_CSS``)."""
    defaults, limits = config.defaults, config.limits
    geometry = VideoGeometry.from_folder(config.video.model)  # the text-to-video model's size rules (from its configs)
    bounds = video_bounds(geometry, limits)
    embedded_video = embedded_folder(config.video.model) is not None
    stops = StopFlags()

    def generate_video(
        prompt: str,
        negative_prompt: str,
        seed: float,
        steps: float,
        guidance: float,
        num_frames: float,
        height: float,
        width: float,
        compare: bool,
        samples: float,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),
    ):
        def work():
            checked = video_request(
                prompt, negative_prompt, seed, steps, guidance, num_frames, height, width, limits, geometry, samples
            )
            stop = stops.start(session_of(request))
            unknown = store.unknown_words(checked.prompt)
            if unknown:
                gr.Warning(unknown_words_note(unknown))
            results, paths = _run_compared(
                compare,
                checked.steps,
                progress,
                lambda attention, report: store.generate_video(checked, attention, report, stop),
                lambda result: [
                    outputs.save_video(session_of(request), video, result.attention, defaults.fps)
                    for video in result.arrays
                ],
            )
            seeds = f"seed {checked.seed}" if checked.samples == 1 else f"seeds {checked.seed}-{checked.seeds[-1]}"
            what = (
                f"{checked.num_frames} frames, {checked.height}x{checked.width}, {checked.steps} steps, "
                f"guidance {checked.guidance_scale:g}, {seeds}"
            )
            text = summary(results, what) + (f"\n\n**Note:** {unknown_words_note(unknown)}" if unknown else "")
            return (*_galleries(results, paths), text)

        return guarded(work)

    def generate_image(
        class_label: str,
        seed: float,
        steps: float,
        guidance: float,
        compare: bool,
        samples: float,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),
    ):
        def work():
            labels, num_classes = store.class_labels()
            checked = image_request(class_label, seed, steps, guidance, labels, num_classes, limits, samples)
            stop = stops.start(session_of(request))
            results, paths = _run_compared(
                compare,
                checked.steps,
                progress,
                lambda attention, report: store.generate_image(checked, attention, report, stop),
                lambda result: [
                    outputs.save_image(session_of(request), image, result.attention) for image in result.arrays
                ],
            )
            seeds = f"seed {checked.seed}" if checked.samples == 1 else f"seeds {checked.seed}-{checked.seeds[-1]}"
            what = (
                f"class {checked.class_label!r} (id {checked.class_id}), {checked.steps} steps, "
                f"guidance {checked.guidance_scale:g}, {seeds}"
            )
            return (*_galleries(results, paths), summary(results, what, "denoising loop and VAE decode"))

        return guarded(work)

    def stop(request: gr.Request) -> None:
        """Stop this session's running generation after its current denoising step (queued ones are cancelled)."""
        stops.flag(session_of(request)).set()

    def random_seed(samples: float) -> int:
        return pick_seed(samples)

    def check_prompt(prompt: str) -> str:
        """The visible warning under the prompt: the words the model does not know (empty when it knows all)."""
        text = (prompt or "").strip() if isinstance(prompt, str) else ""
        unknown = store.unknown_words(text) if text else []
        return f"⚠ {unknown_words_note(unknown)}" if unknown else ""

    def end_session(request: gr.Request) -> None:
        outputs.remove(session_of(request))
        stops.forget(session_of(request))
        long_stops.forget(session_of(request))

    classes = store.class_choices()
    events = dict(concurrency_limit=config.concurrency, concurrency_id=CONCURRENCY_ID)
    instant = dict(concurrency_limit=None, show_progress="hidden")  # never waits behind a generation
    with gr.Blocks(title="MHLA diffusion demo", analytics_enabled=False, delete_cache=(600, 3600)) as demo:
        gr.Markdown(intro_markdown(config.video.describe(), config.image.describe(), DISPLAY_PX))
        with gr.Tabs():
            with gr.Tab("Text to video", id="t2v"):
                with gr.Row():
                    with gr.Column(scale=2):
                        prompt = gr.Textbox(label="Prompt", value=defaults.prompt, lines=2, elem_id="t2v-prompt")
                        prompt_warning = gr.Markdown(elem_id="t2v-unknown")
                        if embedded_video:
                            gr.Markdown(vocabulary_markdown(), elem_id="t2v-vocabulary")
                            gr.Examples(
                                [[text] for text in example_prompts()],
                                inputs=[prompt],
                                label="Example prompts (click one)",
                                examples_per_page=12,
                                elem_id="t2v-examples",
                            )
                        negative = gr.Textbox(
                            label="Negative prompt", value=defaults.negative_prompt, elem_id="t2v-negative"
                        )
                        seed, dice, samples = _seed_row("t2v", defaults.samples, limits)
                        with gr.Row():
                            frames = lenient_number(
                                gr.Number(
                                    label=f"Frames ({geometry.frame_rule(examples=False)}, up to {bounds.max_frames})",
                                    value=defaults.num_frames,
                                    precision=0,
                                    minimum=1,
                                    maximum=bounds.max_frames,
                                    elem_id="t2v-frames",
                                )
                            )
                            height = size_box(
                                "t2v",
                                "height",
                                defaults.height,
                                bounds.min_height,
                                bounds.max_height,
                                geometry.generation_multiple[0],
                            )
                            width = size_box(
                                "t2v",
                                "width",
                                defaults.width,
                                bounds.min_width,
                                bounds.max_width,
                                geometry.generation_multiple[1],
                            )
                        steps, guidance, compare, run_video, stop_video = _run_controls(
                            "t2v", "videos", defaults.video_steps, defaults.video_guidance_scale, limits
                        )
                    video_mhla, video_softmax, video_info = _results_column("t2v")
            with gr.Tab("Class to image", id="c2i"):
                with gr.Row():
                    with gr.Column(scale=2):
                        label = gr.Dropdown(
                            classes,
                            value=classes[0] if classes else None,
                            allow_custom_value=True,
                            label="Class (name or id)",
                            elem_id="c2i-class",
                        )
                        image_seed, image_dice, image_samples = _seed_row("c2i", defaults.samples, limits)
                        image_steps, image_guidance, image_compare, run_image, stop_image = _run_controls(
                            "c2i", "images", defaults.image_steps, defaults.image_guidance_scale, limits
                        )
                    image_mhla, image_softmax, image_info = _results_column("c2i")
            long_stops = long_video_tab(config, store, outputs, events, instant)
        video_event = run_video.click(
            generate_video,
            [prompt, negative, seed, steps, guidance, frames, height, width, compare, samples],
            [video_mhla, video_softmax, video_info],
            api_name="generate_video",
            **events,
        )
        video_event.then(None, js=PLAY_VIDEOS)
        image_event = run_image.click(
            generate_image,
            [label, image_seed, image_steps, image_guidance, image_compare, image_samples],
            [image_mhla, image_softmax, image_info],
            api_name="generate_image",
            **events,
        )
        stop_video.click(stop, None, None, cancels=[video_event], api_name="stop", **instant)
        stop_image.click(stop, None, None, cancels=[image_event], api_name="stop_image", **instant)
        dice.click(random_seed, [samples], [seed], api_name="random_seed", **instant)
        image_dice.click(random_seed, [image_samples], [image_seed], api_name="random_image_seed", **instant)
        prompt.change(check_prompt, [prompt], [prompt_warning], api_name="check_prompt", **instant)
        demo.load(check_prompt, [prompt], [prompt_warning], **instant)
        demo.unload(end_session)
    demo.queue(default_concurrency_limit=config.concurrency, max_size=config.max_queue)
    return demo
