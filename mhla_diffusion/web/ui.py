"""The Gradio page: a text-to-video tab and a class-to-image tab, MHLA beside softmax.

Import this module only after :func:`mhla_diffusion.web.app.prepare_environment` (it turns
analytics off and points Gradio's cache into the demo's temporary folder before Gradio loads).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no telemetry threads

import gradio as gr

from ..geometry import VideoGeometry
from .config import DemoConfig
from .models import Attention, Generated, ModelStore
from .outputs import SessionOutputs
from .validation import DemoInputError, image_request, video_request

__all__ = ["build_demo"]

logger = logging.getLogger(__name__)

#: Events share this concurrency group, so the queue's limit covers both tabs together.
CONCURRENCY_ID = "generate"
_TITLES = {"mhla": "MHLA (linear attention)", "softmax": "Softmax attention (original)"}


def _session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None)


def _guarded(work: Callable[[], Any]) -> Any:
    """Run ``work``; bad input and failures become a readable ``gr.Error`` (never a stack trace in the page)."""
    try:
        return work()
    except gr.Error:
        raise
    except DemoInputError as error:
        raise gr.Error(str(error), title="Invalid input", print_exception=False) from None
    except Exception as error:  # the page gets one line, the console the traceback
        logger.exception("generation failed")
        message = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise gr.Error(f"Generation failed ({type(error).__name__}): {message}", title="Generation failed") from None


def _raw_unless_number(payload: Any) -> bool:
    """Whether Gradio's own number handling would fail on ``payload`` (text such as "abc", NaN, infinity)."""
    return isinstance(payload, bool) or not isinstance(payload, (int, float)) or not math.isfinite(payload)


def _checked(component: Any) -> Any:
    """``component`` (a Number or Slider) with its odd values (text from an API client such as "abc", NaN,
    infinity) passed on as they are to :mod:`.validation`, so the caller gets the page's readable message,
    not Gradio's conversion error and a traceback in the log. (An instance attribute: a subclass would
    make Gradio write a ``.pyi`` stub beside this module and need its own widget in the page.)"""
    preprocess = component.preprocess

    def lenient(payload: Any) -> Any:
        return payload if payload is not None and _raw_unless_number(payload) else preprocess(payload)

    component.preprocess = lenient
    return component


def _unknown_words_note(words: list[str]) -> str:
    return (f"The model's tokenizer does not know {', '.join(map(repr, words))}: "
            "the video is generated without {}.".format("it" if len(words) == 1 else "them"))


def _summary(results: list[Generated], what: str) -> str:
    lines = [f"**{what}**", "", "| attention | wall time |", "|---|---|"]
    lines += [f"| {_TITLES[r.attention]} | {r.seconds:.2f} s |" for r in results]
    if len(results) == 2 and results[0].seconds > 0:
        ratio = results[1].seconds / results[0].seconds
        lines += ["", f"Softmax took {ratio:.2f}x the MHLA time (same seed; wall times include the text encoder and VAE)."]
    return "\n".join(lines)


def _runs(compare: bool) -> list[Attention]:
    return ["mhla", "softmax"] if compare else ["mhla"]


def _run_compared(compare: bool, steps: int, progress: gr.Progress,
                  generate: Callable[[Attention, Callable[[int, int], None]], Generated],
                  save: Callable[[Generated], Any]) -> tuple[list[Generated], dict[str, Any]]:
    """MHLA (and, with ``compare``, softmax) one after the other on one progress bar; the results
    and ``{attention: saved output}``."""
    runs = _runs(compare)
    results, paths = [], {}
    for index, attention in enumerate(runs):
        progress((index * steps, len(runs) * steps), desc=f"{_TITLES[attention]}: starting")
        result = generate(attention, _progress_for(progress, index, len(runs), steps, attention))
        results.append(result)
        paths[attention] = save(result)
    return results, paths


def _progress_for(progress: gr.Progress, index: int, count: int, steps: int, attention: Attention):
    def report(step: int, total: int) -> None:
        progress((index * steps + step, count * steps), desc=f"{_TITLES[attention]}: step {step}/{total}", unit="steps")

    return report


def _paths(paths: dict[str, Any]) -> tuple[str | None, str | None]:
    """(MHLA output, softmax output or ``None``) as plain paths: API clients get files, not UI updates."""
    return tuple(str(paths[a]) if a in paths else None for a in ("mhla", "softmax"))  # type: ignore[return-value]


def build_demo(config: DemoConfig, store: ModelStore, outputs: SessionOutputs) -> gr.Blocks:
    """The Blocks app (not launched)."""
    defaults, limits = config.defaults, config.limits
    geometry = VideoGeometry.from_folder(config.video.model)  # the text-to-video model's size rules (from its configs)

    def generate_video(prompt: str, negative_prompt: str, seed: float, steps: float, guidance: float,
                       num_frames: float, height: float, width: float, compare: bool,
                       request: gr.Request, progress: gr.Progress = gr.Progress()):
        def work():
            checked = video_request(prompt, negative_prompt, seed, steps, guidance, num_frames, height, width, limits,
                                    geometry)
            unknown = store.pipeline("text-to-video").unknown_words(checked.prompt)
            if unknown:
                gr.Warning(_unknown_words_note(unknown))
            results, paths = _run_compared(
                compare, checked.steps, progress, lambda attention, report: store.generate_video(checked, attention, report),
                lambda result: outputs.save_video(_session(request), result.array, result.attention, defaults.fps))
            what = (f"{checked.num_frames} frames, {checked.height}x{checked.width}, {checked.steps} steps, "
                    f"guidance {checked.guidance_scale:g}, seed {checked.seed}")
            summary = _summary(results, what) + (f"\n\n**Note:** {_unknown_words_note(unknown)}" if unknown else "")
            return _paths(paths) + (summary,)

        return _guarded(work)

    def generate_image(class_label: str, seed: float, steps: float, guidance: float, compare: bool,
                       request: gr.Request, progress: gr.Progress = gr.Progress()):
        def work():
            labels, num_classes = store.class_labels()
            checked = image_request(class_label, seed, steps, guidance, labels, num_classes, limits)
            results, paths = _run_compared(
                compare, checked.steps, progress, lambda attention, report: store.generate_image(checked, attention, report),
                lambda result: outputs.save_image(_session(request), result.array, result.attention))
            what = (f"class {checked.class_label!r} (id {checked.class_id}), {checked.steps} steps, "
                    f"guidance {checked.guidance_scale:g}, seed {checked.seed}")
            return _paths(paths) + (_summary(results, what),)

        return _guarded(work)

    def end_session(request: gr.Request) -> None:
        outputs.remove(_session(request))

    classes = store.class_choices()
    events = dict(concurrency_limit=config.concurrency, concurrency_id=CONCURRENCY_ID)
    with gr.Blocks(title="MHLA diffusion demo", analytics_enabled=False, delete_cache=(600, 3600)) as demo:
        gr.Markdown(
            "# Multi-Head Linear Attention for diffusion\n"
            "MHLA replaces softmax self-attention with linear attention over token blocks (cost O(N) in the "
            "number of tokens). Tick *compare* to run the same seed with the original softmax attention.\n\n"
            f"Text-to-video: `{config.video.describe()}`  \nClass-to-image: `{config.image.describe()}`"
        )
        with gr.Tabs():
            with gr.Tab("Text to video", id="t2v"):
                with gr.Row():
                    with gr.Column(scale=2):
                        prompt = gr.Textbox(label="Prompt", value=defaults.prompt, lines=2, elem_id="t2v-prompt")
                        negative = gr.Textbox(label="Negative prompt", value=defaults.negative_prompt, elem_id="t2v-negative")
                        with gr.Row():
                            seed = _checked(gr.Number(label="Seed", value=0, precision=0, elem_id="t2v-seed"))
                            frames = _checked(gr.Number(label=f"Frames ({geometry.frame_rule(examples=False)})", value=defaults.num_frames,
                                               precision=0, elem_id="t2v-frames"))
                            height = _checked(gr.Number(label=f"Height (x{geometry.generation_multiple[0]})", value=defaults.height,
                                               precision=0, elem_id="t2v-height"))
                            width = _checked(gr.Number(label=f"Width (x{geometry.generation_multiple[1]})", value=defaults.width,
                                              precision=0, elem_id="t2v-width"))
                        steps = _checked(gr.Slider(1, limits.max_steps, value=defaults.video_steps, step=1, label="Steps", elem_id="t2v-steps"))
                        guidance = _checked(gr.Slider(0, limits.max_guidance, value=defaults.video_guidance_scale, step=0.5,
                                             label="Guidance scale", elem_id="t2v-guidance"))
                        compare = gr.Checkbox(value=True, label="Compare with softmax attention (same seed)", elem_id="t2v-compare")
                        run_video = gr.Button("Generate video", variant="primary", elem_id="t2v-generate")
                    with gr.Column(scale=3):
                        with gr.Row():
                            video_mhla = gr.Video(label=_TITLES["mhla"], autoplay=True, loop=True, elem_id="t2v-mhla")
                            video_softmax = gr.Video(label=_TITLES["softmax"], autoplay=True, loop=True, elem_id="t2v-softmax")
                        video_info = gr.Markdown(elem_id="t2v-summary")
            with gr.Tab("Class to image", id="c2i"):
                with gr.Row():
                    with gr.Column(scale=2):
                        label = gr.Dropdown(classes, value=classes[0] if classes else None, allow_custom_value=True,
                                            label="Class (name or id)", elem_id="c2i-class")
                        image_seed = _checked(gr.Number(label="Seed", value=0, precision=0, elem_id="c2i-seed"))
                        image_steps = _checked(gr.Slider(1, limits.max_steps, value=defaults.image_steps, step=1, label="Steps",
                                                elem_id="c2i-steps"))
                        image_guidance = _checked(gr.Slider(0, limits.max_guidance, value=defaults.image_guidance_scale, step=0.5,
                                                   label="Guidance scale", elem_id="c2i-guidance"))
                        image_compare = gr.Checkbox(value=True, label="Compare with softmax attention (same seed)",
                                                    elem_id="c2i-compare")
                        run_image = gr.Button("Generate image", variant="primary", elem_id="c2i-generate")
                    with gr.Column(scale=3):
                        with gr.Row():
                            image_mhla = gr.Image(label=_TITLES["mhla"], type="filepath", elem_id="c2i-mhla")
                            image_softmax = gr.Image(label=_TITLES["softmax"], type="filepath", elem_id="c2i-softmax")
                        image_info = gr.Markdown(elem_id="c2i-summary")
        run_video.click(generate_video, [prompt, negative, seed, steps, guidance, frames, height, width, compare],
                        [video_mhla, video_softmax, video_info], api_name="generate_video", **events)
        run_image.click(generate_image, [label, image_seed, image_steps, image_guidance, image_compare],
                        [image_mhla, image_softmax, image_info], api_name="generate_image", **events)
        demo.unload(end_session)
    demo.queue(default_concurrency_limit=config.concurrency, max_size=config.max_queue)
    return demo
