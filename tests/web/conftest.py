"""Fixtures of the web tests: one ``python app.py`` on the tiny pipelines (and the long-video stand-in of
``long_video_root``) for the whole session (every web test module shares it), one on the embedded models (judges,
vocabulary, the model's size limits), and a ``gradio_client`` for each.

Each is shut down with SIGTERM at the end and must exit 0 having deleted its temporary outputs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers.web import FRAMES, REPO, SIZE, STEPS, DemoServer, free_port


@contextlib.contextmanager
def _running_demo(root, argv: list[str]):
    """``python app.py --port P *argv`` serving in ``root``'s temp folder until the block ends; then SIGTERM, and it
    must exit 0 having deleted its temporary outputs."""
    (root / "tmp").mkdir()
    port = free_port()
    log = root / "server.log"
    env = {
        **os.environ,
        "TMPDIR": str(root / "tmp"),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("GRADIO_TEMP_DIR", None)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(port), *argv],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = DemoServer(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:  # a dead server must not be mistaken for a stale one on the port
                pytest.fail(f"app.py exited with {proc.returncode}:\n{server.log_text()}")
            try:
                with urllib.request.urlopen(server.url + "/config", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"app.py did not serve within 120 s:\n{server.log_text()}")
            time.sleep(0.25)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, server.log_text()
    assert not server.output_root().exists(), "temporary outputs left behind"


@pytest.fixture(scope="session")
def demo_server(pipeline_dirs, long_video_root, tmp_path_factory):
    pytest.importorskip("gradio", reason="the web demo needs gradio (pip install -e .[test])")
    argv = []
    if os.environ.get("MHLA_DEMO_TEST_MODELS") != "embedded":  # "embedded": the app's defaults, for the screenshot only
        argv = [
            "--long-model",
            str(long_video_root / "shapes-long-mhla"),
            "--t2v-model",
            str(pipeline_dirs["wan"]),
            "--t2v-mhla-weights",
            str(pipeline_dirs["wan_mhla"]),
            "--c2i-model",
            str(pipeline_dirs["dit"]),
            "--c2i-mhla-weights",
            str(pipeline_dirs["dit_mhla"]),
            "--num-frames",
            str(FRAMES),
            "--height",
            str(SIZE),
            "--width",
            str(SIZE),
            "--video-steps",
            str(STEPS),
            "--image-steps",
            str(STEPS),
            "--max-steps",
            "50",
            "--samples",
            "1",
        ]
    with _running_demo(tmp_path_factory.mktemp("webdemo"), argv) as server:
        yield server


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    """``python app.py`` on its defaults, the embedded models (their judges, vocabulary and size limits), with
    STEPS-step forms so a click takes about a second."""
    pytest.importorskip("gradio", reason="the web demo needs gradio (pip install -e .[test])")
    argv = ["--video-steps", str(STEPS), "--image-steps", str(STEPS), "--samples", "2"]
    with _running_demo(tmp_path_factory.mktemp("webdemo-embedded"), argv) as server:
        yield server


@pytest.fixture(scope="session")
def client(demo_server, tmp_path_factory):
    gradio_client = pytest.importorskip("gradio_client")
    downloads = tmp_path_factory.mktemp("downloads")
    return gradio_client.Client(demo_server.url, verbose=False, download_files=str(downloads))


@pytest.fixture(scope="session")
def embedded_client(embedded_server, tmp_path_factory):
    gradio_client = pytest.importorskip("gradio_client")
    downloads = tmp_path_factory.mktemp("downloads-embedded")
    return gradio_client.Client(embedded_server.url, verbose=False, download_files=str(downloads))
