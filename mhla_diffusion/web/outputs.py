"""Per-session output folders under one temporary root, removed when sessions end and at exit."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..pipelines.outputs import OutputPlan, save_image, save_video

__all__ = ["SessionOutputs"]

_SAFE = re.compile(r"[^A-Za-z0-9_-]")


class SessionOutputs:
    """``root/<session>/`` holds what one browser session generated.

    A folder goes when its session ends (:meth:`remove`, called from the page's unload event), when
    no request used it for ``max_age_s`` (sessions of API clients never "unload"), and at exit
    (:meth:`remove_all`).
    """

    def __init__(self, root: str | Path | None = None, max_age_s: float = 3600.0):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="mhla-demo-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._counter = 0

    def folder(self, session: str | None) -> Path:
        """The session's folder (created, and marked as used now); stale folders of others are swept."""
        name = _SAFE.sub("_", session or "anonymous")[:64] or "anonymous"
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        os.utime(path)  # mtime = last use
        self.sweep(keep=path)
        return path

    def _next_stem(self, session: str | None, kind: str) -> Path:
        with self._lock:
            self._counter += 1
            number = self._counter
        return self.folder(session) / f"{kind}-{number:05d}"

    def save_video(self, session: str | None, frames: np.ndarray, attention: str, fps: int) -> Path:
        """Write an H.264 mp4 into the session's folder."""
        stem = self._next_stem(session, f"video-{attention}")
        return save_video(frames, OutputPlan(stem.with_suffix(".mp4"), stem.with_suffix(".json")), "mp4", fps)

    def save_image(self, session: str | None, image: np.ndarray, attention: str) -> Path:
        """Write a PNG into the session's folder."""
        stem = self._next_stem(session, f"image-{attention}")
        return save_image(image, OutputPlan(stem.with_suffix(".png"), stem.with_suffix(".json")))

    def remove(self, session: str | None) -> None:
        """Delete one session's folder (its session ended)."""
        if session:
            shutil.rmtree(self.root / _SAFE.sub("_", session)[:64], ignore_errors=True)

    def sweep(self, keep: Path | None = None) -> None:
        """Delete session folders unused for ``max_age_s``."""
        cutoff = time.time() - self.max_age_s
        for path in self.root.iterdir():
            try:
                if path != keep and path.is_dir() and path.stat().st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True)
            except FileNotFoundError:
                pass

    def remove_all(self) -> None:
        """Delete the whole root (server shutdown)."""
        shutil.rmtree(self.root, ignore_errors=True)
