"""What several ``mhla`` commands parse alike: sizes, layers, counts, devices, the model options, and
subcommand parsers that add their arguments only when they are used.

Numbers and lists are read by the option layer (:mod:`mhla_diffusion.utils.options`, whose one list rule takes
``1,2,4``, ``3x5x10`` and ``[1, 2, 4]``), the choice lists are
:mod:`mhla_diffusion.utils.choices`. Standard library and torch-free modules only, so parsing never waits
for torch or Diffusers; only a given ``--device`` imports torch (:func:`parse_device` asks it what this
machine has).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from ..utils.choices import ATTENTIONS, WEIGHT_DTYPES
from ..utils.geometry import MAX_SEED, WAN_480P
from ..utils.options import ANY_NUMBER, above, at_least, between, number, parse_assignment, parse_text, state_ranges

__all__ = [
    "CommandParser",
    "WAN_480P",
    "add_command",
    "add_model_arguments",
    "add_settings_option",
    "check_settings",
    "dataclass_field_hints",
    "dataclass_field_names",
    "finite_float",
    "non_negative_float",
    "non_negative_int",
    "parse_device",
    "parse_layers",
    "parse_layout",
    "parse_names",
    "parse_sizes",
    "positive_float",
    "positive_int",
    "seed",
]

# ---------------------------------------------------------------------------------- value parsers


def _by_option_layer(text: str, hint: Any) -> Any:
    """``text`` read by the option layer as ``hint`` (its list rule: ``1,2,4``, ``3x5x10``, ``[1, 2, 4]``), an
    ``argparse`` type error otherwise."""
    try:
        return parse_text(None, text, hint, where=repr(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_sizes(text: str) -> tuple[int, ...]:
    """``3x5x10`` (or ``3,5,10``, ``[3, 5, 10]``: the option layer's list rule) -> ``(3, 5, 10)``; positive ints
    only (an ``argparse`` type)."""
    values = _by_option_layer(text, tuple[int, ...])
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return values


def parse_layers(text: str) -> str | list[int]:
    """``all``, ``hybrid`` or layer indices ``1,2,4`` (an ``argparse`` type)."""
    return _by_option_layer(text, Literal["all", "hybrid"] | list[int])


def parse_layout(text: str) -> str | tuple[int, ...]:
    """``auto`` or blocks per axis such as ``3x5x10`` (an ``argparse`` type)."""
    return "auto" if text.strip() == "auto" else parse_sizes(text)


def parse_names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An ``argparse`` type: names from ``choices`` by the list rule (``fvd,clip``), each once, in order."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(_by_option_layer(text, list[str])))
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), got {text!r}")
        return names

    return parse


def parse_device(text: str) -> str:
    """A device this machine has: ``cpu``, ``cuda``, ``cuda:N``, or another accelerator present here (an
    ``argparse`` type; it imports torch, so only a command given ``--device`` waits for it at parsing)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device: use cpu, cuda, cuda:N (N: the GPU's index) or another accelerator's name "
            "(mps, xpu, ...)"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                "no CUDA device is available on this machine (torch.cuda.is_available() is False): use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    elif device.type != "cpu":
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None or accelerator.type != device.type:
            raise argparse.ArgumentTypeError(f"no {device.type} device is available on this machine: use --device cpu")
    return text


#: ``argparse`` types of numbers with their range (:func:`~mhla_diffusion.utils.options.number`); a command's
#: option with another range makes its own with ``number(int, at_least(2))`` and the like.
positive_int = number(int, at_least(1))
non_negative_int = number(int, at_least(0))
finite_float = number(float, ANY_NUMBER)
non_negative_float = number(float, at_least(0))
positive_float = number(float, above(0))
#: A seed from 0 to :data:`mhla_diffusion.utils.geometry.MAX_SEED` (the web demo's rule too).
seed = number(int, between(0, MAX_SEED))


# ---------------------------------------------------------------------------------- shared options


#: ``--transformer`` of the generation commands, per model family: what it takes.
TRANSFORMER_HELP = {
    "wan": "a converted transformer folder (save_mhla include_base, `mhla import-wan`) or an original-format Wan "
    "checkpoint file",
    "dit": "a DiT transformer folder: converted (save_mhla include_base, `mhla import-dit --output`) or plain "
    "Diffusers; an original DiT checkpoint file is converted with `mhla import-dit` first",
}


def add_model_arguments(
    parser: argparse.ArgumentParser, hub_id: str, embedded: bool = True, family: str | None = "wan"
) -> None:
    """The model, attention, seed, output and device options of the generation commands.

    ``embedded``: without ``--model`` the command runs the embedded demonstration model; else ``--model`` is required.
    ``family`` (``wan`` or ``dit``) words the ``--transformer`` help (:data:`TRANSFORMER_HELP`); ``None``: no
    ``--transformer`` option (the other families load their transformer from the pipeline or ``--mhla-weights``).
    """
    if embedded:
        parser.add_argument(
            "--model",
            help=f"Diffusers pipeline folder or hub id (e.g. {hub_id}); default: the small "
            "embedded demonstration model (mhla_diffusion/embedded/models)",
        )
    else:
        parser.add_argument("--model", required=True, help=f"Diffusers pipeline folder or hub id (e.g. {hub_id})")
    parser.add_argument("--mhla-weights", type=Path, help="folder written by save_mhla / `mhla convert --output`")
    if family is not None:
        parser.add_argument("--transformer", type=Path, help=TRANSFORMER_HELP[family])
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="mhla",
        help="mhla (default) or softmax: the same weights with the original softmax attention",
    )
    parser.add_argument("--seed", type=seed, default=0, help="random seed, 0 to 2**32-1 (default 0)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"), help="where outputs go (default ./outputs)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--device", type=parse_device, help="cuda, cpu, ... (default: cuda when available)")
    parser.add_argument(
        "--dtype", choices=WEIGHT_DTYPES, help="weights dtype (default: bfloat16 on GPU, float32 on CPU)"
    )


def dataclass_field_names(module: str, class_name: str) -> list[str]:
    """The fields of the dataclass ``class_name`` in ``module``, read from its source without importing it
    (``--help`` lists the settings of ``--set``; the module that holds them imports torch)."""
    return list(dataclass_field_hints(module, class_name))


#: Names a settings dataclass's annotations use, for reading them without importing its module.
_ANNOTATION_NAMES = {t.__name__: t for t in (list, tuple, dict, int, float, str, bool)} | {
    "None": None,
    "Any": Any,
    "Literal": Literal,
    "Sequence": Sequence,
}


def dataclass_field_hints(module: str, class_name: str) -> dict[str, Any]:
    """The field types of the dataclass ``class_name`` in ``module``, read from its source without importing it
    (an annotation that names anything but builtins, ``Literal`` or ``Sequence`` reads as ``Any``)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    body = next(node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    hints: dict[str, Any] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            try:
                hints[node.target.id] = eval(ast.unparse(node.annotation), {"__builtins__": {}}, _ANNOTATION_NAMES)
            except Exception:  # a name from the module itself: the module's own parsing checks it
                hints[node.target.id] = Any
    return hints


def check_settings(overrides: list[str], module: str, class_name: str) -> None:
    """``ValueError`` for the first bad ``--set NAME=VALUE`` of ``add_settings_option``, before the command
    imports ``module`` (and torch): the same reading as the module's (:func:`~mhla_diffusion.utils.options.
    parse_assignment`), with the field types read from the source."""
    if overrides:
        hints = dataclass_field_hints(module, class_name)
        for item in overrides:
            parse_assignment(item, hints)


def add_settings_option(p: argparse.ArgumentParser, module: str, class_name: str, what: str, example: str) -> None:
    """``--set NAME=VALUE`` (repeatable, into ``overrides``) for the fields of the settings dataclass
    ``class_name`` in ``module``, which the help lists."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"change one {what}, e.g. {example} (repeatable). The settings (the fields of {module}.{class_name}): "
        + ", ".join(dataclass_field_names(module, class_name)),
    )


# ---------------------------------------------------------------------------------- subcommands


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that adds its arguments when it is first used (parsed, or asked for help).

    ``mhla --help`` and ``mhla <command> ...`` then build only the command at hand: a command whose
    options need a library module (e.g. defaults read from it) does not slow the others down.
    """

    _configure: Callable[[argparse.ArgumentParser], None] | None = None

    def configure_later(self, configure: Callable[[argparse.ArgumentParser], None]) -> None:
        self._configure = configure

    def _configured(self) -> None:
        if self._configure is not None:
            configure, self._configure = self._configure, None
            configure(self)
            state_ranges(self)

    def parse_known_args(self, args=None, namespace=None):
        self._configured()
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        """One line naming the problem and where the options are listed, instead of argparse's usage block."""
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

    def format_usage(self) -> str:
        self._configured()
        return super().format_usage()

    def format_help(self) -> str:
        self._configured()
        return super().format_help()


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    configure: Callable[[argparse.ArgumentParser], None],
    *,
    help: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Add command ``name`` whose arguments (and ``func`` default) ``configure`` adds when it is used."""
    parser = subparsers.add_parser(name, help=help, description=description or help)
    _configure(parser, configure)
    return parser


def _configure(parser: argparse.ArgumentParser, configure: Callable[[argparse.ArgumentParser], None]) -> None:
    if isinstance(parser, CommandParser):
        parser.configure_later(configure)
    else:  # a plain argparse parser (e.g. a test's): configure now
        configure(parser)
