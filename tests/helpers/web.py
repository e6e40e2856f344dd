"""What the web tests share: the demo server's form defaults and a handle on a running ``python app.py``."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Form defaults the server starts with (small, so a generation takes about a second on a CPU).
FRAMES, SIZE, STEPS = 9, 32, 2


def free_port() -> int:
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
