"""What every tab's events share: readable errors instead of tracebacks, lenient number boxes, per-session stop
flags and random seeds.

Import this module only after :func:`mhla_diffusion.web.app.prepare_environment` (it imports Gradio).
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
from typing import Any, Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no telemetry threads

import gradio as gr

from ..utils.geometry import MAX_SEED
from .models import GenerationStopped
from .validation import DemoInputError

__all__ = ["StopFlags", "guarded", "lenient_number", "pick_seed", "session_of", "size_box"]

logger = logging.getLogger(__name__)


def session_of(request: gr.Request | None) -> str | None:
    """The browser session (or API client) a request comes from."""
    return getattr(request, "session_hash", None)


def guarded(work: Callable[[], Any]) -> Any:
    """Run ``work``; bad input and failures become a readable ``gr.Error`` (never a stack trace in the page)."""
    try:
        return work()
    except gr.Error:
        raise
    except DemoInputError as error:
        raise gr.Error(str(error), title="Invalid input", print_exception=False) from None
    except GenerationStopped as stopped:
        print(f"generation {stopped}", flush=True)
        raise gr.Error(f"Stopped: {stopped}", title="Stopped", print_exception=False) from None
    except Exception as error:  # the page gets one line, the console the traceback
        logger.exception("generation failed")
        message = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise gr.Error(f"Generation failed ({type(error).__name__}): {message}", title="Generation failed") from None


def _raw_unless_number(payload: Any) -> bool:
    """Whether Gradio's own number handling would fail on ``payload`` (text such as "abc", NaN, infinity)."""
    return isinstance(payload, bool) or not isinstance(payload, (int, float)) or not math.isfinite(payload)


def lenient_number(component: Any) -> Any:
    """``component`` (a Number or Slider) with its odd values (text from an API client such as "abc", NaN,
    infinity) passed on as they are to :mod:`.validation`, so the caller gets the page's readable message,
    not Gradio's conversion error and a traceback in the log. (An instance attribute: a subclass would
    make Gradio write a ``.pyi`` stub beside this module and need its own widget in the page.)"""
    preprocess = component.preprocess

    def lenient(payload: Any) -> Any:
        return payload if payload is not None and _raw_unless_number(payload) else preprocess(payload)

    component.preprocess = lenient
    return component


def size_box(tab: str, axis: str, value: int, minimum: int, maximum: int, multiple: int) -> Any:
    """A video form's ``axis`` ("height" or "width") box: multiples of ``multiple`` up to ``maximum`` pixels
    (``tab``: the elem_id prefix)."""
    return lenient_number(
        gr.Number(
            label=f"{axis.capitalize()} (x{multiple}, up to {maximum})",
            value=value,
            precision=0,
            minimum=minimum,
            maximum=maximum,
            step=multiple,
            elem_id=f"{tab}-{axis}",
        )
    )


class StopFlags:
    """One stop flag per browser session (or API client): the stop button sets it, the next generation clears it."""

    def __init__(self) -> None:
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def flag(self, session: str | None) -> threading.Event:
        with self._lock:
            return self._flags.setdefault(session or "anonymous", threading.Event())

    def start(self, session: str | None) -> threading.Event:
        """The session's flag, cleared: a generation starts."""
        event = self.flag(session)
        event.clear()
        return event

    def forget(self, session: str | None) -> None:
        with self._lock:
            self._flags.pop(session or "anonymous", None)


def pick_seed(samples: Any = 1) -> int:
    """A random seed that leaves room for ``samples`` consecutive seeds."""
    try:
        count = max(1, int(samples))
    except (TypeError, ValueError):
        count = 1
    return random.SystemRandom().randint(0, MAX_SEED - count + 1)
