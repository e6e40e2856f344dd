"""The option layer: settings are dataclass fields, defined once, and every value is checked by one function.

A field made with :func:`option` carries its default, its help text and (where fixed) its choices; its type
annotation is the type a value must have. From that one definition:

* :func:`coerce` checks a value that arrives typed (a YAML file, a dict) against the field's type;
* :func:`parse_text` reads a value that arrives as text (a command-line option, ``--set NAME=VALUE``, an
  environment variable) and hands it to :func:`coerce`;
* :func:`add_field_arguments` adds one ``--name`` option per field to an ``argparse`` parser, with the
  field's help, choices and default in ``--help``;
* :func:`check_choices` checks the fields that name their choices.

The help text sits in ``Field.metadata["help"]``, the key ``transformers.HfArgumentParser`` reads. The values
themselves are not parsed with ``HfArgumentParser``: the trainers take YAML-typed values on the command line
(``--resolution_buckets '[[480, 832]]'``), nested ``--mhla.KEY`` options, ``int | str`` unions and strict
booleans, which it cannot express; and the ``mhla`` command must parse without importing ``transformers``.

Standard library and PyYAML only: ``mhla --help`` imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from typing import Any, Callable, Iterable, Sequence

import yaml

__all__ = [
    "add_field_arguments",
    "argparse_type",
    "check_choice",
    "check_choices",
    "coerce",
    "field_choices",
    "field_help",
    "option",
    "parse_text",
    "read_yaml",
    "unknown_name",
]

_NONE_WORDS = ("none", "null", "~")


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: Sequence[Any] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its help text and, where they are fixed, its choices (``None`` is always allowed
    for a field whose default is ``None``)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def _definition(cls: type, name: str, key: str) -> Any:
    """``key`` of the metadata of field ``name`` in the nearest class of ``cls``'s MRO that gives it (a
    subclass may redefine a field only to change its default, keeping the help)."""
    for klass in cls.__mro__:
        found = getattr(klass, "__dataclass_fields__", {}).get(name)
        if found is not None and key in found.metadata:
            return found.metadata[key]
    return None


def field_help(cls: type, name: str) -> str:
    """The help text of field ``name`` of dataclass ``cls`` (empty when it has none)."""
    return _definition(cls, name, "help") or ""


def field_choices(cls: type, name: str) -> tuple[Any, ...] | None:
    """The choices of field ``name`` of dataclass ``cls``, or ``None`` when any value of its type is allowed."""
    return _definition(cls, name, "choices")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """``ValueError`` naming ``name`` and its choices unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_choices(options: Any) -> None:
    """Raise ``ValueError`` for the first field whose value is not among its choices."""
    for f in dataclasses.fields(options):
        choices, value = field_choices(type(options), f.name), getattr(options, f.name)
        if choices is not None and value is not None:
            check_choice(f.name, value, choices)


# ---------------------------------------------------------------------------------- values


def _subject(name: str | None) -> str:
    return f"`{name}` must be" if name else "expected"


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def coerce(name: str | None, value: Any, hint: Any) -> Any:
    """``value`` checked against the type annotation ``hint``; ``ValueError`` naming ``name`` otherwise.

    Ints are accepted for floats; a string that reads as a number for a float (YAML 1.1 reads ``1e-4``, with no
    dot, as a string); YAML's ``false`` for a string field is ``"no"`` (``mixed_precision: no``)."""
    if _is_union(hint):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(name, value, arg)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0])
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{_subject(name)} true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{_subject(name)} an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{_subject(name)} a number, got {value!r}")
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare `no` as false
            return "no" if value is False else "yes"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise ValueError(f"{_subject(name)} a string, got {value!r}")
    if origin is list or hint is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{_subject(name)} a list (YAML: [a, b]), got {value!r}")
        (item,) = typing.get_args(hint) or (Any,)
        return [coerce(name, v, item) for v in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{_subject(name)} a mapping (YAML: {{key: value}}), got {value!r}")
        return dict(value)
    return value


def _accepts(hint: Any, kind: type) -> bool:
    """Whether ``hint`` (or a member of its union) is ``kind`` or ``kind[...]``."""
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    return any(m is kind or typing.get_origin(m) is kind for m in members)


def _only_str(hint: Any) -> bool:
    """Whether ``hint`` is ``str`` or ``str | None``."""
    return {m for m in (typing.get_args(hint) if _is_union(hint) else (hint,)) if m is not type(None)} == {str}


def parse_text(name: str | None, text: str, hint: Any, where: str | None = None) -> Any:
    """A value written as text (command line, ``--set``, environment) read as YAML, then :func:`coerce`.

    Booleans are ``true`` or ``false`` only (YAML 1.1's ``yes``/``no``/``on``/``off`` stay words: a string
    field keeps them as written); a list field also takes comma-separated values (``0,1,2``); a field that
    may be ``None`` takes ``none`` or ``null``. ``where`` names the text in a YAML syntax error (default
    ``name``)."""
    stripped = text.strip()
    if type(None) in typing.get_args(hint) and stripped.lower() in _NONE_WORDS:
        return None
    value: Any = "" if stripped == "" else read_yaml(text, where or str(name))
    if isinstance(value, bool) and stripped.lower() not in ("true", "false"):
        value = text
    if _only_str(hint) and isinstance(value, (bool, int, float)):
        value = text  # a string field keeps `010`, `1e-4` or `no` as written
    if _accepts(hint, list) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [parse_text(name, part, Any, where) for part in text.split(",") if part.strip()]
    return coerce(name, value, hint)


def argparse_type(hint: Any) -> Callable[[str], Any]:
    """An ``argparse`` ``type=`` that reads its text with :func:`parse_text` (argparse names the option)."""

    def parse(text: str) -> Any:
        try:
            return parse_text(None, text, hint, where=repr(text))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = getattr(hint, "__name__", "value")  # argparse's fallback message names the type
    return parse


def read_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error is a one-line ``ValueError`` naming ``where`` (a file, an option),
    the line and the column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
        opened = f" ({context} opened at line {start.line + 1}, column {start.column + 1})" if context and start else ""
        raise ValueError(f"{where}{at}: not valid YAML: {problem}{opened}") from None


def unknown_name(kind: str, name: str, names: Iterable[str], lookup: str | None = None) -> ValueError:
    """The error for a name that is not among ``names``: "unknown option `learnin_rate` (did you mean
    `learning_rate`?); `--help` lists every option" (``kind``: option, setting, ...; ``lookup``: the spelling
    to match, default ``name``)."""
    close = difflib.get_close_matches(lookup or name, list(names), n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ValueError(f"unknown {kind} `{name}`{hint}; `--help` lists every {kind}")


# ---------------------------------------------------------------------------------- argparse


def _default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_field_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One ``--name`` option (also spelled ``--name-with-dashes``) per field of dataclass ``cls``, its help the
    field's help, choices and default. The value is kept as text (``dest`` the field's name, absent when not
    given): the caller reads it with :func:`parse_text` once it knows what else sets the field (a file)."""
    for f in dataclasses.fields(cls):
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        choices = field_choices(cls, f.name)
        one_of = f"one of {', '.join(map(str, choices))}; " if choices else ""
        default = _default_of(f)
        parser.add_argument(
            *names,
            dest=f.name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{field_help(cls, f.name)} ({one_of}default: {default!r})".replace("%", "%%"),
        )
