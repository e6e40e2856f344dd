"""What the web tests share: the demo server's form defaults and a handle on a running ``python app.py``."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Form defaults the server starts with (small, so a generation takes about a second on a CPU).
FRAMES, SIZE, STEPS = 9, 32, 2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (servers, process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoServer:
    """A ``python app.py`` subprocess and what the tests need from it."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def output_root(self) -> Path:
        match = re.search(r"outputs: (\S+)", self.log_text())
        assert match, self.log_text()
        return Path(match.group(1))


def gallery(value) -> list[tuple[Path, str]]:
    """A gallery output as ``gradio_client`` returns it (``[{"image" | "video": path, "caption": text}, ...]``,
    ``[]`` when empty): ``[(file, caption), ...]``."""
    assert isinstance(value, list), value
    items = []
    for item in value:
        media = item.get("video") or item.get("image")
        if isinstance(media, dict):  # older gradio_client versions
            media = media.get("video") or media.get("path")
        assert isinstance(media, str), item
        items.append((Path(media), item.get("caption") or ""))
    return items


#: Chromium flags of the browser tests: headless on a CPU machine, nothing fetched in the background.
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    """Debian's Chromium, or skip (fail when MHLA_REQUIRE_BROWSER=1, as in CI)."""
    required = os.environ.get("MHLA_REQUIRE_BROWSER") == "1"
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    problem = None
    if path is None:
        problem = "no `chromium` on PATH (apt-get install -y chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "playwright is not installed (pip install -e .[test])"
    if problem:
        if required:
            pytest.fail(f"MHLA_REQUIRE_BROWSER=1 but {problem}")
        pytest.skip(problem)
    return path
