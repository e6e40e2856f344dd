"""What the page says around its samples (no server): captions, the loop vs end-to-end timing, the judge's table,
the embedded model's vocabulary and example prompts."""

from __future__ import annotations

import re

import numpy as np

from mhla_diffusion.embedded import VideoReading
from mhla_diffusion.embedded.worlds.moving_shapes import ATTRIBUTES, parse_caption
from mhla_diffusion.web.models import Generated
from mhla_diffusion.web.report import caption, example_prompts, summary, vocabulary_markdown


def _reading(colour: str, shape: str, direction: str, prompt: str, confidence: float = 0.9) -> VideoReading:
    from mhla_diffusion.embedded import requested_attributes

    return VideoReading(
        {"shape": shape, "colour": colour, "direction": direction},
        {"shape": confidence, "colour": 1.0, "direction": 1.0},
        requested_attributes(prompt),
    )


def _result(attention: str, step_ends: list[float], seconds: float, readings=None, note=None) -> Generated:
    samples = len(readings) if readings else 2
    return Generated(
        [np.zeros((1, 2, 2, 3))] * samples,
        list(range(5, 5 + samples)),
        seconds,
        attention,
        step_ends,
        readings or [None] * samples,
        note,
    )


def test_the_loop_is_timed_without_the_first_step_and_the_ratios_say_which_is_which():
    # step ends: the first step (unknown start, the warm-up) is not a duration; the others are 1, 1, 4 s (median 1)
    mhla = _result("mhla", [100.0, 101.0, 102.0, 106.0], 20.0)
    softmax = _result("softmax", [200.0, 202.0, 204.0, 205.0], 10.0)
    assert (mhla.step_seconds, softmax.step_seconds) == (1.0, 2.0)
    text = summary([mhla, softmax], "what")
    assert "| MHLA (linear attention) | 1.00 s | 20.00 s | 2 |" in text
    assert (
        "Denoising loop: softmax took 2.00x the MHLA time per step (median of steps 2-4, the first step is the warm-up"
        in text
    )
    assert "End to end: softmax took 0.50x the MHLA time (text encoder, denoising loop and VAE decode)." in text
    assert "End to end: softmax took 0.50x the MHLA time (denoising loop and VAE decode)." in summary(
        [mhla, softmax], "what", "denoising loop and VAE decode"
    )
    one_step = summary([_result("mhla", [5.0], 1.0), _result("softmax", [6.0], 2.0)], "what")
    assert "n/a (needs 2+ steps)" in one_step and "Denoising loop: not timed" in one_step
    assert "Judge" not in one_step  # no judge for these samples


def test_captions_and_the_judge_table_compare_each_reading_with_the_prompt():
    prompt = "a red circle moving left"
    right, wrong = _reading("red", "circle", "left", prompt), _reading("red", "square", "up", prompt, 0.5)
    assert caption(7) == "seed 7"
    assert caption(7, right) == (
        "seed 7 · judge: red circle, moving left (confidence 0.90: shape 0.90, colour 1.00, direction 1.00) ✓"
    )
    assert caption(8, wrong).endswith("✗")
    assert caption(9, _reading("red", "circle", "left", "something else")).endswith("direction 1.00)")  # nothing asked
    text = summary([_result("mhla", [0, 1], 2, [right, wrong]), _result("softmax", [0, 1], 2, [wrong, wrong])], "what")
    assert (
        "| 5 | red circle, moving left (confidence 0.90: shape 0.90, colour 1.00, direction 1.00) ✓ | red square"
        in text
    )
    assert "Read as asked: MHLA (linear attention) 1 of 2; Softmax attention (original) 0 of 2." in text
    unread = summary([_result("mhla", [0, 1], 2, note="the judge reads 9-frame 48x48 clips, not 5x48x48")], "what")
    assert "No judge reading: the judge reads 9-frame 48x48 clips, not 5x48x48." in unread


def test_the_vocabulary_and_example_prompts_come_from_the_training_data():
    examples = example_prompts()
    assert len(examples) == len(set(examples)) == len(ATTRIBUTES["shape"]) * len(ATTRIBUTES["colour"])
    used = {name: {parse_caption(text)[name] for text in examples} for name in ATTRIBUTES}
    assert used == {name: set(values) for name, values in ATTRIBUTES.items()}  # every word of the model, in use
    text = vocabulary_markdown()
    for name, values in ATTRIBUTES.items():
        assert f"{name}s: {', '.join(values)}" in text
    count = int(re.search(r"\((\d+) prompts", text).group(1))
    assert count == len(ATTRIBUTES["shape"]) * len(ATTRIBUTES["colour"]) * len(ATTRIBUTES["direction"])


def test_the_page_says_compare_runs_the_clis_softmax_teacher():
    """The demo's softmax side for the embedded models is the folder `mhla text-to-video --attention softmax` runs,
    and the page names it so (not "the original softmax attention" of the MHLA weights)."""
    from mhla_diffusion.embedded import embedded_model
    from mhla_diffusion.web.config import resolve_task_models
    from mhla_diffusion.web.report import intro_markdown

    video = resolve_task_models("text-to-video", None, None, None, None)
    image = resolve_task_models("class-to-image", None, None, None, None)
    assert video.softmax_model == str(embedded_model("text-to-video", "softmax"))
    assert image.softmax_model == str(embedded_model("class-to-image", "softmax"))
    intro = intro_markdown(video.describe(), image.describe(), 256)
    assert "softmax teacher" in intro and "--attention softmax" in intro
    assert "softmax model shapes-t2v-softmax" in intro and "softmax model digits-c2i-softmax" in intro
