"""Gradio web demo: text-to-video and class-to-image with MHLA beside softmax (``python app.py``, ``mhla web``).

Gradio is an optional dependency (``pip install mhla-diffusion[demo]``); it is imported only when the
demo starts, so this package and its input checks load without it. Names are re-exported lazily
(PEP 562). The ``mhla web`` command line is :mod:`mhla_diffusion.cli.web`.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["build_parser", "main", "serve"], ".app"),
    **dict.fromkeys(["DemoConfig", "TaskModels", "config_from_args"], ".config"),
    **dict.fromkeys(["DemoInputError", "Limits", "image_request", "video_request"], ".validation"),
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
