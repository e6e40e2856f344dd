"""Starting and stopping the web demo: ``python app.py`` and ``mhla web`` (:mod:`mhla_diffusion.cli.web`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from .config import DemoConfig, add_arguments, config_from_args
from .outputs import SessionOutputs

__all__ = ["DESCRIPTION", "build_parser", "main", "prepare_environment", "require_gradio", "run", "serve"]

DESCRIPTION = (
    "Gradio web demo: text-to-video and class-to-image with MHLA, side by side with softmax attention, and long "
    "videos streamed chunk by chunk from a block-causal MHLA model. "
    "Serves on 127.0.0.1; offline (no analytics, no share link)."
)


def prepare_environment(outputs: SessionOutputs) -> None:
    """Environment for an offline Gradio: no analytics or telemetry, its cache inside the demo's temp folder."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("GRADIO_TEMP_DIR", str(outputs.root / "gradio"))
    os.environ.pop("GRADIO_SHARE", None)


def serve(config: DemoConfig, block: bool = True):
    """Load the models, build the page and launch it. Returns ``(demo, outputs)``.

    With ``block`` (the command line) this returns after Ctrl+C or SIGTERM, with the server closed and the
    temporary outputs deleted; without it the caller closes ``demo`` and calls ``outputs.remove_all()``.
    """
    outputs = SessionOutputs()
    prepare_environment(outputs)
    print(f"outputs: {outputs.root}", flush=True)
    stop = threading.Event()
    if block and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    demo = None
    finished = False
    try:
        from .models import ModelStore
        from .ui import PAGE_CSS, build_demo

        store = ModelStore(config)
        if config.preload:
            print("loading models ...", flush=True)
            store.preload()
        demo = build_demo(config, store, outputs)
        demo.launch(
            server_name=config.host,
            server_port=config.port,
            share=False,
            inbrowser=False,
            ssr_mode=False,
            allowed_paths=[str(outputs.root)],
            prevent_thread_lock=True,
            quiet=True,  # Gradio's own lines would offer a public link, which this demo never makes
            css=PAGE_CSS,
        )
        print(f"running on {demo.local_url} (Ctrl-C stops the server)", flush=True)
        if not block:
            finished = True
            return demo, outputs
        while demo.is_running and not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass  # Ctrl+C: close down below
    finally:
        if not finished:
            if demo is not None:
                demo.close()
            outputs.remove_all()
            print("server closed, temporary outputs deleted", flush=True)
    return demo, outputs


#: What to run when Gradio (the ``demo`` extra) is missing.
INSTALL_DEMO = 'pip install -e ".[demo]"'


def require_gradio() -> None:
    """``ValueError`` saying how to install Gradio when it is not installed (before anything starts)."""
    if importlib.util.find_spec("gradio") is None:
        raise ValueError(
            f"the web demo needs Gradio, which is not installed: {INSTALL_DEMO} in a checkout "
            '(pip install "mhla-diffusion[demo]" otherwise)'
        )


def run(args: argparse.Namespace) -> int:
    """Entry of ``mhla web`` and ``python app.py``: check Gradio and the flags, then serve until stopped."""
    from ..loaders.loading import device_and_dtype
    from ..ops.cpu_memory import retain_freed_memory

    require_gradio()
    config = config_from_args(args)
    if device_and_dtype(config.device, config.dtype)[0] == "cpu":
        # from the start rather than at the library's first MHLA call (cpu_memory): loading, the text encoder
        # and the VAE reuse freed memory too; MHLA_KEEP_MALLOC=1 opts out
        retain_freed_memory()
    serve(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=Path(sys.argv[0]).name or "app.py", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python app.py [flags]``: bad flags or missing model folders give one readable line and exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..loaders.loading import hub_errors, model_names

    try:
        with hub_errors(model_names(vars(args))):  # the models are checked (and loaded) inside run
            return run(args)
    except (ValueError, TypeError, OSError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
