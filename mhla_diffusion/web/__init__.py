"""Gradio web demo: text-to-video and class-to-image with MHLA beside softmax (``python app.py``, ``mhla web``).

Gradio is an optional dependency (``pip install mhla-diffusion[demo]``); it is imported only when the
demo starts, so this package and its input checks load without it.
"""

from .app import main, register, serve
from .config import DemoConfig, TaskModels, config_from_args
from .validation import DemoInputError, Limits, image_request, video_request

__all__ = [
    "DemoConfig", "DemoInputError", "Limits", "TaskModels", "config_from_args", "image_request", "main", "register",
    "serve", "video_request",
]
