"""The web demo as users meet it: ``python app.py`` started here, called through ``gradio_client`` and,
once, driven in headless Chromium (Debian's ``chromium``; no browser download).

One server for the session (``demo_server`` in ``tests/web/conftest.py``), on tiny pipelines built by the
``pipeline_dirs`` fixture; it is shut down with SIGTERM at the end and must exit 0 having deleted its
temporary outputs.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.web import BROWSER_ARGS, FRAMES, REPO, SIZE, STEPS, chromium, gallery

#: Every test here starts processes or trains (``pytest -m 'not slow'`` skips them).
pytestmark = pytest.mark.slow

pytest.importorskip("gradio", reason="the web demo needs gradio (pip install -e .[test])")
gradio_client = pytest.importorskip("gradio_client")


def _path(value) -> Path:
    """The one sample of a one-sample gallery."""
    (item,) = gallery(value)
    return item[0]


def _video_shape(path: Path) -> tuple[int, int, int]:
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        frames = [frame for frame in reader]
    return len(frames), *frames[0].shape[:2]


def test_video_with_softmax_comparison(client):
    mhla, softmax, summary = client.predict(
        "a red circle moving left", "", 3, STEPS, 5.0, FRAMES, SIZE, SIZE, True, api_name="/generate_video"
    )
    for value in (mhla, softmax):
        path = _path(value)
        assert path.suffix == ".mp4" and path.read_bytes()[4:8] == b"ftyp"
        assert _video_shape(path) == (FRAMES, SIZE, SIZE)
    assert _path(mhla).read_bytes() != _path(softmax).read_bytes()
    assert gallery(mhla)[0][1] == "seed 3"  # the tiny model has no judge: the seed alone
    assert "MHLA" in summary and "Softmax" in summary and re.search(r"\d+\.\d\d s", summary)
    assert "Denoising loop: softmax took" in summary and "End to end: softmax took" in summary


def test_video_without_comparison(client):
    mhla, softmax, summary = client.predict(
        "a blue square moving up", "red", 0, 1, 0.0, 5, 48, SIZE, False, api_name="/generate_video"
    )
    assert _video_shape(_path(mhla)) == (5, 48, SIZE)
    assert softmax == [] and "Softmax" not in summary
    assert "n/a (needs 2+ steps)" in summary  # one step: no loop time after the warm-up step


def test_images_by_name_and_id(client):
    from PIL import Image

    mhla, softmax, summary = client.predict("goldfish", 0, STEPS, 4.0, True, api_name="/generate_image")
    for value in (mhla, softmax):
        path = _path(value)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            assert image.size == (16, 16) and image.mode == "RGB"
    assert "id 1" in summary
    mhla, softmax, summary = client.predict("3", 1, 1, 4.0, False, api_name="/generate_image")
    assert softmax == [] and "id 3" in summary and _path(mhla).suffix == ".png"
    assert "text encoder" not in summary  # class-to-image has none


BAD_VIDEO = [
    (("  ", "", 0, STEPS, 5.0, FRAMES, SIZE, SIZE, False), "prompt is empty"),
    (("a cat", "", 0, STEPS, 5.0, FRAMES, 50, SIZE, False), "multiple of 16"),
    # the form's bound is the model's own: the tiny model's position table ends at 512 px
    (("a cat", "", 0, STEPS, 5.0, FRAMES, SIZE, 528, False), "greater than maximum value 512"),
    # the steps slider checks its own range (Gradio's message); validation.video_request checks it again
    (("a cat", "", 0, 0, 5.0, FRAMES, SIZE, SIZE, False), "less than minimum value 1"),
    (("a cat", "", 0, 999, 5.0, FRAMES, SIZE, SIZE, False), "greater than maximum value 50"),
    (("a cat", "", 0, STEPS, 5.0, 10, SIZE, SIZE, False), "4k+1"),
]
BAD_IMAGE = [
    (("zebra", 0, STEPS, 4.0, False), "Unknown class 'zebra'"),
    (("5000", 0, STEPS, 4.0, False), "Unknown class"),
]


def test_bad_input_is_a_readable_error_and_the_server_keeps_serving(client):
    from gradio_client.exceptions import AppError

    calls = [(args, expected, "/generate_video") for args, expected in BAD_VIDEO]
    calls += [(args, expected, "/generate_image") for args, expected in BAD_IMAGE]
    for args, expected, api in calls:
        with pytest.raises(AppError) as caught:
            client.predict(*args, api_name=api)
        message = str(caught.value)
        assert expected in message and "Traceback" not in message, message
    mhla, _, _ = client.predict("a cat", "", 0, 1, 5.0, FRAMES, SIZE, SIZE, False, api_name="/generate_video")
    assert _path(mhla).is_file()
    # one frame at 16 px: token grid (1, 1, 1) under the 2x2x2 layout, once refused, now empty blocks
    mhla, _, _ = client.predict("a cat", "", 0, 1, 5.0, 1, 16, 16, False, api_name="/generate_video")
    assert _path(mhla).is_file()


def test_page_is_offline_and_local(demo_server):
    with urllib.request.urlopen(demo_server.url + "/config", timeout=5) as response:
        config = json.load(response)
    assert not any(str(sheet).startswith("http") for sheet in config.get("stylesheets", []))
    assert config.get("analytics_enabled") is False
    assert "share" not in demo_server.log_text().lower() or "gradio.live" not in demo_server.log_text()
    assert demo_server.output_root().is_dir()


# ---------------------------------------------------------------- the browser


#: The page's (looping, playing) videos paused on a middle frame, for the screenshot.
STILL = """async () => {
    await new Promise((done) => setTimeout(done, 1000));  // after the page's own play() calls
    await Promise.all([...document.querySelectorAll("video")].map((v) => new Promise((done) => {
        v.pause();
        v.addEventListener("seeked", done, {once: true});
        v.currentTime = v.duration / 2;
    })));
}"""
VIDEO_LOADED = """(id) => {
    const videos = [...document.querySelectorAll(`#${id} video`)];
    return videos.length > 0 && videos.every((v) => v.src && v.readyState >= 2 && !v.error);
}"""


def test_generate_video_in_chromium(demo_server, tmp_path):
    executable = chromium()
    from playwright.sync_api import sync_playwright

    save = os.environ.get("MHLA_SAVE_SCREENSHOT")
    screenshot = REPO / "docs" / "web-demo.png" if save == "1" else Path(save) if save else tmp_path / "web-demo.png"
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    external: list[str] = []

    def local_only(route):
        url = route.request.url
        if url.startswith((demo_server.url, "data:", "blob:")):
            route.continue_()
        else:
            external.append(url)
            route.abort()

    sessions_before = {path.name for path in demo_server.output_root().iterdir()}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=BROWSER_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 820}).new_page()
            page.route("**/*", local_only)
            page.goto(demo_server.url, wait_until="domcontentloaded")
            prompt = page.locator("#t2v-prompt textarea")
            prompt.wait_for(timeout=30_000)
            prompt.fill("a green circle moving right")
            page.locator("#t2v-generate").click()
            for element in ("t2v-mhla", "t2v-softmax"):
                page.wait_for_function(VIDEO_LOADED, arg=element, timeout=60_000)
            page.locator("#t2v-summary").get_by_text("End to end: softmax took").wait_for(timeout=10_000)
            page.evaluate(STILL)  # headless Chromium draws playing videos blank in screenshots
            page.screenshot(path=str(screenshot), full_page=True)
            # a bad input shows a readable error in the page, not a stack trace
            page.locator("#t2v-height input").fill("50")
            page.locator("#t2v-generate").click()
            page.get_by_text("multiple of 16").first.wait_for(timeout=30_000)
            assert "Traceback" not in page.content()
            (session,) = {path.name for path in demo_server.output_root().iterdir()} - sessions_before
            page.close()  # the tab's session ends: its output folder goes
            deadline = time.monotonic() + 10
            while (demo_server.output_root() / session).exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not (demo_server.output_root() / session).exists(), "session outputs not cleaned up"
        finally:
            browser.close()
    assert external == [], f"the page fetched outside hosts: {external}"
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
