"""Named steps of a long command (the build's stages, the experiment's runs) that run once each and
keep their time across interruptions.

A finished step leaves ``<work>/stages/<name>.json`` with its results and is skipped by a rerun. Its
``seconds`` add up the time of every attempt (``attempt_seconds``): an attempt killed without warning
(no chance to write its time) counts up to the last file it wrote under the ``watched`` folders, the
work after that being lost and done again by the next attempt.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["Stages"]

logger = logging.getLogger(__name__)


class Stages:
    """Runs the named steps of one command in ``work``; ``total`` and ``noun`` only shape the log
    ("stage 5/7 teachers ...")."""

    def __init__(self, work: Path, total: int, watched: Sequence[str], noun: str = "stage") -> None:
        self.work, self.total, self.watched, self.noun, self.count = Path(work), total, tuple(watched), noun, 0
        (self.work / "stages").mkdir(parents=True, exist_ok=True)

    def _last_write_since(self, started: float) -> float:
        latest = started
        for folder in self.watched:
            for path in (self.work / folder).rglob("*") if (self.work / folder).is_dir() else ():
                latest = max(latest, path.stat().st_mtime)
        return latest

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``fn()`` once: its result with ``seconds`` and ``attempt_seconds`` added, or the stored result
        of a finished step."""
        self.count += 1
        marker = self.work / "stages" / f"{name}.json"
        if marker.is_file():
            logger.info("%s %d/%d %s: already done (%s)", self.noun, self.count, self.total, name, marker)
            return json.loads(marker.read_text())
        attempts_file = self.work / "stages" / f"{name}.attempts.json"
        attempts = json.loads(attempts_file.read_text()) if attempts_file.is_file() else []
        for attempt in attempts:
            if attempt["seconds"] is None:  # killed without warning
                attempt["seconds"] = round(self._last_write_since(attempt["started"]) - attempt["started"], 1)
        logger.info(
            "%s %d/%d %s%s ...",
            self.noun,
            self.count,
            self.total,
            name,
            f" (resuming; attempt {len(attempts) + 1})" if attempts else "",
        )
        attempt = {"started": time.time(), "seconds": None}
        attempts.append(attempt)
        attempts_file.write_text(json.dumps(attempts))
        began = time.perf_counter()
        try:
            result = fn()
        finally:
            attempt["seconds"] = round(time.perf_counter() - began, 1)
            attempts_file.write_text(json.dumps(attempts))
        spent = [a["seconds"] for a in attempts]
        result["seconds"] = round(sum(spent), 1)
        result["attempt_seconds"] = spent
        marker.write_text(json.dumps(result, indent=2))
        logger.info("%s %d/%d %s: done in %.0f s", self.noun, self.count, self.total, name, result["seconds"])
        return result
