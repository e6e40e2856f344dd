"""The words the demo's page shows around its samples: captions, the timing and judge summary, the vocabulary.

Plain text and Markdown from :class:`~mhla_diffusion.web.models.Generated` results; no Gradio, so each
rule is checked without a server (``tests/web/test_web_report.py``).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from ..benchmarks.crossover import speed_context
from ..embedded.worlds.moving_shapes import ATTRIBUTES, caption_for

__all__ = [
    "TITLES",
    "caption",
    "example_prompts",
    "intro_markdown",
    "summary",
    "unknown_words_note",
    "vocabulary_markdown",
]

#: What each attention is called on the page.
TITLES = {"mhla": "MHLA (linear attention)", "softmax": "Softmax attention (original)"}


def intro_markdown(video_models: str, image_models: str, display_px: int) -> str:
    """The text at the top of the page; ``video_models`` / ``image_models``: each task's models, as
    :meth:`~mhla_diffusion.web.config.TaskModels.describe` names them (the softmax side of *compare* included)."""
    return (
        "# Multi-Head Linear Attention for diffusion\n"
        "MHLA replaces softmax self-attention with linear attention over token blocks (cost O(N) in the "
        "number of tokens). Tick *compare* to run the same seeds with the softmax model named below: for the "
        "embedded models the softmax teacher the MHLA model was converted from, the model `mhla text-to-video "
        "--attention softmax` runs. Samples are "
        f"shown at {display_px} px (nearest neighbour); "
        "the gallery's download button gives the files at their own size.\n\n"
        f"Text-to-video: `{video_models}`  \nClass-to-image: `{image_models}`"
    )


def unknown_words_note(words: Sequence[str]) -> str:
    """The warning for prompt words the model's tokenizer does not know."""
    return (
        f"The model's tokenizer does not know {', '.join(map(repr, words))}: "
        "the video is generated without {}.".format("it" if len(words) == 1 else "them")
    )


def _verdict(reading: Any) -> str:
    """`` ✓`` / `` ✗`` when the reading can be compared with what was asked, else nothing."""
    return {True: " ✓", False: " ✗", None: ""}[reading.matches]


def caption(seed: int, reading: Any = None) -> str:
    """A sample's caption: its seed and, for an embedded model, the judge's reading (✓: as asked)."""
    return f"seed {seed}" + (f" · {reading.describe()}{_verdict(reading)}" if reading is not None else "")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a (needs 2+ steps)"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _timing(results: Sequence[Any], end_to_end: str) -> list[str]:
    """The timing table and, with two results, the softmax / MHLA ratio of the loop and of the whole call
    (``end_to_end``: what the whole call runs, e.g. "text encoder, denoising loop and VAE decode")."""
    lines = ["| attention | denoising loop: median step | end to end | samples |", "|---|---|---|---|"]
    lines += [
        f"| {TITLES[r.attention]} | {_duration(r.step_seconds)} | {r.seconds:.2f} s | {len(r.arrays)} |"
        for r in results
    ]
    if len(results) != 2:
        return lines + _speed_context(results)
    mhla, softmax = results
    samples = len(mhla.arrays)
    batch = f"all {samples} samples" if samples > 1 else "the sample"
    lines.append("")
    if mhla.step_seconds and softmax.step_seconds:
        lines.append(
            f"Denoising loop: softmax took {softmax.step_seconds / mhla.step_seconds:.2f}x the MHLA time per step "
            f"(median of steps 2-{len(mhla.step_ends)}, the first step is the warm-up; a step runs {batch} "
            "with classifier-free guidance).  "
        )
    else:
        lines.append("Denoising loop: not timed (the median step needs 2+ steps; the first is the warm-up).  ")
    if mhla.seconds > 0:
        lines.append(f"End to end: softmax took {softmax.seconds / mhla.seconds:.2f}x the MHLA time ({end_to_end}).")
    return lines + _speed_context(results)


def _speed_context(results: Sequence[Any]) -> list[str]:
    """Where MHLA's attention overtakes softmax attention, and where this model's size stands (under the timings)."""
    context = speed_context(results[0].tokens)
    return [] if context is None else ["", f"*Speed in context:* {context['note']}."]


def _judged(results: Sequence[Any]) -> list[str]:
    """The judge's reading of every sample, one row per seed, and how many were read as asked."""
    notes = [r.judge_note for r in results if r.judge_note]
    if notes:
        return ["", f"No judge reading: {notes[0]}."]
    if not any(reading is not None for r in results for reading in r.readings):
        return []
    lines = [
        "",
        "**Judge** (a classifier trained on the data, never on a model's samples; ✓: read as asked)",
        "",
        "| seed | " + " | ".join(TITLES[r.attention] for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for index, seed in enumerate(results[0].seeds):
        cells = [
            reading.describe().removeprefix("judge: ") + _verdict(reading)
            for reading in (r.readings[index] for r in results)
        ]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    counts = [
        (
            TITLES[r.attention],
            sum(bool(reading.matches) for reading in r.readings),
            sum(reading.matches is not None for reading in r.readings),
        )
        for r in results
    ]
    if all(asked for _, _, asked in counts):
        lines += [
            "",
            "Read as asked: " + "; ".join(f"{title} {right} of {asked}" for title, right, asked in counts) + ".",
        ]
    return lines


def summary(results: Sequence[Any], what: str, end_to_end: str = "text encoder, denoising loop and VAE decode") -> str:
    """The Markdown under the samples: what was asked (``what``), the timings and the judge's readings;
    ``end_to_end`` names what the end-to-end time covers."""
    return "\n".join([f"**{what}**", "", *_timing(results, end_to_end), *_judged(results)])


def example_prompts() -> list[str]:
    """Prompts that use every word of the embedded text-to-video model: each shape in each colour, the
    directions in turn (12 prompts)."""
    shapes, colours, directions = ATTRIBUTES["shape"], ATTRIBUTES["colour"], ATTRIBUTES["direction"]
    return [
        caption_for(shape, colour, directions[index % len(directions)])
        for index, (shape, colour) in enumerate(itertools.product(shapes, colours))
    ]


def vocabulary_markdown() -> str:
    """The embedded text-to-video model's vocabulary, from the data it was trained on."""
    count = 1
    for values in ATTRIBUTES.values():
        count *= len(values)
    words = " · ".join(f"{name}s: {', '.join(values)}" for name, values in ATTRIBUTES.items())
    return (
        f"**Words this model knows** ({count} prompts of the form *a &lt;colour&gt; &lt;shape&gt; moving "
        f"&lt;direction&gt;*): {words}"
    )
