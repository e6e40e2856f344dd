"""The demo used well: several samples per click (each from its own seed), the judge's reading beside each sample of
an embedded model, the embedded vocabulary with example prompts, size limits from the model, a stop button, a
random seed, a warning for unknown words as they are typed, and samples shown at 256 px while the files stay
native (the browser test)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import numpy as np
import pytest

from helpers.web import BROWSER_ARGS, FRAMES, SIZE, STEPS, chromium, gallery

pytest.importorskip("gradio", reason="the web demo needs gradio (pip install -e .[test])")
gradio_client = pytest.importorskip("gradio_client")

from mhla_diffusion.embedded.locations import embedded_defaults  # noqa: E402
from mhla_diffusion.embedded.worlds.moving_shapes import ATTRIBUTES  # noqa: E402
from mhla_diffusion.utils.geometry import MAX_SEED  # noqa: E402
from mhla_diffusion.web.report import example_prompts  # noqa: E402

#: Every test here starts processes or trains (``pytest -m 'not slow'`` skips them).
pytestmark = pytest.mark.slow


def _frames(path) -> np.ndarray:
    import imageio.v3 as iio

    return np.stack(list(iio.imiter(path))).astype(np.float64)


def _components(server) -> dict[str, dict]:
    """The page's components by ``elem_id``, as ``/config`` describes them."""
    with urllib.request.urlopen(server.url + "/config", timeout=5) as response:
        components = json.load(response)["components"]
    return {c["props"]["elem_id"]: c for c in components if c.get("props", {}).get("elem_id")}


# ---------------------------------------------------------------- the tiny models' server


def test_several_samples_each_from_its_own_seed(client):
    mhla, softmax, summary = client.predict(
        "a red circle", "", 3, STEPS, 5.0, FRAMES, SIZE, SIZE, False, 2, api_name="/generate_video"
    )
    samples = gallery(mhla)
    assert [text for _, text in samples] == ["seed 3", "seed 4"] and softmax == []
    assert "seeds 3-4" in summary and "| 2 |" in summary
    batch = [_frames(path) for path, _ in samples]
    assert np.abs(batch[0] - batch[1]).mean() > 1  # two seeds, two videos
    (alone,) = gallery(
        client.predict("a red circle", "", 4, STEPS, 5.0, FRAMES, SIZE, SIZE, False, 1, api_name="/generate_video")[0]
    )
    assert np.abs(_frames(alone[0]) - batch[1]).mean() < 1.0  # the batch's second sample is what seed 4 gives alone


def test_random_seed_and_the_prompt_check(client):
    seeds = {client.predict(8, api_name="/random_seed") for _ in range(4)}
    assert len(seeds) > 1 and all(isinstance(s, int) and 0 <= s <= MAX_SEED - 7 for s in seeds)
    assert "does not know 'zebra'" in client.predict("a red zebra circle", api_name="/check_prompt")
    assert client.predict("a red circle", api_name="/check_prompt") == ""


def test_stop_ends_a_running_generation_and_the_next_one_runs(client, demo_server):
    from concurrent.futures import CancelledError

    from gradio_client.exceptions import AppError

    job = client.submit("a red circle", "", 0, 50, 5.0, FRAMES, SIZE, SIZE, True, 1, api_name="/generate_video")
    deadline = time.monotonic() + 60
    while not (job.status().progress_data or []) or job.status().progress_data[0].index < 1:
        assert not job.done(), "the generation ended before it could be stopped"
        assert time.monotonic() < deadline, "no progress within 60 s"
        time.sleep(0.05)
    client.predict(api_name="/stop")
    # the page's event is cancelled; the loop itself ends after its current step
    with pytest.raises((AppError, CancelledError)) as stopped:
        job.result(timeout=30)
    assert isinstance(stopped.value, CancelledError) or "Stopped: stopped after denoising step" in str(stopped.value)
    deadline = time.monotonic() + 30
    while not (logged := re.search(r"generation stopped after denoising step (\d+) of 50", demo_server.log_text())):
        assert time.monotonic() < deadline, demo_server.log_text()[-2000:]
        time.sleep(0.1)
    assert int(logged.group(1)) < 50
    mhla, _, _ = client.predict("a red circle", "", 0, 1, 5.0, FRAMES, SIZE, SIZE, False, 1, api_name="/generate_video")
    assert gallery(mhla)[0][0].is_file()  # the stop did not stick to the session's next generation


# ---------------------------------------------------------------- the embedded models' server


def test_embedded_samples_carry_the_judges_reading(embedded_client):
    d = embedded_defaults()
    mhla, softmax, summary = embedded_client.predict(
        "a red circle moving left", "", 0, 2, 5.0, d.num_frames, d.height, d.width, True, 2, api_name="/generate_video"
    )
    reading = (
        r"seed \d · judge: (red|green|blue|yellow) (circle|square|triangle), moving (left|right|up|down) "
        r"\(confidence [01]\.\d\d: shape [01]\.\d\d, colour [01]\.\d\d, direction [01]\.\d\d\)( ✓| ✗)"
    )
    for value in (mhla, softmax):
        samples = gallery(value)
        assert len(samples) == 2 and all(re.fullmatch(reading, text) for _, text in samples), samples
    assert "**Judge**" in summary and re.search(r"Read as asked: MHLA \(linear attention\) \d of 2; Softmax", summary)
    images, _, image_summary = embedded_client.predict("3", 5, 2, 4.0, False, 2, api_name="/generate_image")
    assert [text.split(" · ")[0] for _, text in gallery(images)] == ["seed 5", "seed 6"]
    assert all(
        re.fullmatch(r"seed \d · judge: \d \(confidence [01]\.\d\d\)( ✓| ✗)", text) for _, text in gallery(images)
    )
    assert "Read as asked: MHLA (linear attention)" in image_summary


def test_embedded_page_shows_the_vocabulary_and_the_models_size_limits(embedded_server, embedded_client):
    from gradio_client.exceptions import AppError

    components = _components(embedded_server)
    vocabulary = components["t2v-vocabulary"]["props"]["value"]
    assert all(word in vocabulary for values in ATTRIBUTES.values() for word in values)
    examples = [row[0] for row in components["t2v-examples"]["props"]["samples"]]
    assert examples == example_prompts()
    # the embedded model's position table ends at 256 px: the form's bounds, and the server's check
    assert components["t2v-height"]["props"]["maximum"] == components["t2v-width"]["props"]["maximum"] == 256
    d = embedded_defaults()
    with pytest.raises(AppError, match="greater than maximum value 256"):
        embedded_client.predict(
            "a red circle moving left", "", 0, 2, 5.0, d.num_frames, 272, d.width, False, 1, api_name="/generate_video"
        )


def test_the_tiny_models_page_has_no_vocabulary(demo_server):
    components = _components(demo_server)
    assert "t2v-vocabulary" not in components and "t2v-examples" not in components  # not the embedded model's words


SHOWN = """(selector) => [...document.querySelectorAll(selector)].map((img) => ({
    width: img.getBoundingClientRect().width, height: img.getBoundingClientRect().height,
    natural: [img.naturalWidth, img.naturalHeight], rendering: getComputedStyle(img).imageRendering,
}))"""


def test_samples_show_at_256_px_while_the_files_stay_native(embedded_server):
    from playwright.sync_api import sync_playwright

    executable = chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=BROWSER_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.goto(embedded_server.url, wait_until="domcontentloaded")
            prompt = page.locator("#t2v-prompt textarea")
            prompt.wait_for(timeout=30_000)
            # a word the model does not know is named under the prompt as it is typed; an example prompt clears it
            prompt.fill("a red zebra moving left")
            page.locator("#t2v-unknown").get_by_text("does not know 'zebra'").wait_for(timeout=30_000)
            page.locator("#t2v-examples").get_by_text(example_prompts()[5], exact=True).click()
            page.wait_for_function(
                "(text) => document.querySelector('#t2v-prompt textarea').value === text",
                arg=example_prompts()[5],
                timeout=10_000,
            )
            page.wait_for_function(
                "() => !document.querySelector('#t2v-unknown').innerText.includes('zebra')", timeout=10_000
            )
            seed = page.locator("#t2v-seed input")
            assert seed.input_value() == "0"
            page.locator("#t2v-random-seed").click()
            page.wait_for_function("() => document.querySelector('#t2v-seed input').value !== '0'", timeout=10_000)
            assert page.locator("#t2v-stop").is_visible()

            page.get_by_role("tab", name="Class to image").click()
            page.locator("#c2i-generate").click()
            page.locator("#c2i-summary").get_by_text("Read as asked:").wait_for(timeout=60_000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('#c2i-mhla img')].every((i) => i.complete)"
                " && document.querySelectorAll('#c2i-mhla img').length === 2",
                timeout=10_000,
            )
            shown = page.evaluate(SHOWN, "#c2i-mhla img")
            for image in shown:  # 32x32 PNGs (what the download button fetches) drawn at 256 px, pixels kept square
                assert image["natural"] == [32, 32] and image["rendering"] == "pixelated", shown
                assert image["width"] >= 256 and image["height"] >= 256, shown
            assert page.locator("#c2i-mhla").get_by_text(re.compile(r"seed 0 · judge: \d")).count() == 1
        finally:
            browser.close()
