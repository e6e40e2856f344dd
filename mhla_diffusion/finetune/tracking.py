"""Metric trackers for ``Accelerator(log_with=...)``: TensorBoard / W&B when installed, else JSON lines.

``report_to: auto`` picks TensorBoard if it is installed and otherwise :class:`JSONLTracker`, which
appends one ``{"step": N, ...}`` line per ``accelerator.log`` call to ``<logs>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker, on_main_process
from accelerate.utils import is_tensorboard_available, is_wandb_available

__all__ = ["JSONLTracker", "make_trackers", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


class JSONLTracker(GeneralTracker):
    """Accelerate tracker writing ``metrics.jsonl`` (and ``config.json``) in ``logging_dir``."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | Path) -> None:
        super().__init__()
        self.run_name = run_name
        self.folder = Path(logging_dir)

    @property
    def tracker(self) -> Path:
        return self.folder / METRICS_FILE

    @on_main_process
    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "config.json").write_text(json.dumps(values, indent=2, default=str) + "\n")

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        row = {"step": step, "time": round(time.time(), 3)}
        for key, value in values.items():
            value = value.item() if hasattr(value, "item") else value
            row[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        with self.tracker.open("a") as handle:
            handle.write(json.dumps(row, default=str) + "\n")


def make_trackers(report_to: str, logging_dir: str | Path, run_name: str) -> list:
    """``log_with`` list for the Accelerator (empty for ``none``)."""
    if report_to == "none":
        return []
    if report_to == "auto":
        report_to = "tensorboard" if is_tensorboard_available() else "jsonl"
    if report_to == "jsonl":
        return [JSONLTracker(run_name, logging_dir)]
    available = {"tensorboard": is_tensorboard_available(), "wandb": is_wandb_available()}[report_to]
    if not available:
        raise ImportError(
            f"report_to: {report_to}, but {report_to} is not installed (pip install {report_to}), "
            "or use report_to: jsonl"
        )
    return [report_to]


def read_metrics(logging_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (for tests and quick plots)."""
    path = Path(logging_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
