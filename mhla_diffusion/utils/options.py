"""The option layer: settings are dataclass fields, defined once, and every value is checked by one function.

A field made with :func:`option` carries its default, its help text and (where fixed) its choices; its type
annotation is the type a value must have. From that one definition:

* :func:`coerce` checks a value that arrives typed (a YAML file, a dict) against the field's type;
* :func:`parse_text` reads a value that arrives as text (a command-line option, ``--set NAME=VALUE``, an
  environment variable) and hands it to :func:`coerce`;
* :func:`add_field_arguments` adds one ``--name`` option per field to an ``argparse`` parser, with the
  field's help, choices and default in ``--help``;
* :func:`check_choices` checks the fields that name their choices;
* :func:`check_ranges` checks the numbers of the fields that state their valid range (a :class:`Range`: every
  count, size, limit, interval and rate), and :func:`number` is the ``argparse`` type of a command-line number
  with its range. Where 0 turns something off, the range says what 0 means: the help states it and
  :func:`zero_notes` gives the line a run logs at start.

**The list rule** (every list value, wherever it is written: a command-line option, ``--set NAME=VALUE``, an
environment variable, a string in a YAML file): items separated by commas, ``1,6,6`` or ``to_q,to_k``, or a
YAML list, ``[1, 6, 6]``; one item alone is a one-item list. A list of whole numbers may also join its items with
``x``, the way sizes are written (``3x5x10`` is ``3,5,10``), so a list of sizes is ``480x832,720x1280``
(YAML ``[[480, 832], [720, 1280]]``). :func:`list_items` splits the text, :func:`coerce` applies the rule.

The help text sits in ``Field.metadata["help"]``, the key ``transformers.HfArgumentParser`` reads. The values
themselves are not parsed with ``HfArgumentParser``: the trainers take YAML-typed values on the command line
(``--resolution_buckets '[[480, 832]]'``), nested ``--mhla.KEY`` options, ``int | str`` unions and strict
booleans, which it cannot express; and the ``mhla`` command must parse without importing ``transformers``.

Standard library and PyYAML only: ``mhla --help`` imports this module.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Callable, Iterable, Sequence

import yaml

__all__ = [
    "ANY_NUMBER",
    "Range",
    "above",
    "add_field_arguments",
    "argparse_type",
    "at_least",
    "between",
    "check_choice",
    "check_choices",
    "check_ranges",
    "coerce",
    "describe",
    "field_choices",
    "field_help",
    "field_range",
    "list_items",
    "number",
    "option",
    "parse_assignment",
    "parse_text",
    "read_yaml",
    "settings_with",
    "state_ranges",
    "unknown_name",
    "zero_flags",
    "zero_notes",
]

_NONE_WORDS = ("none", "null", "~")


# ---------------------------------------------------------------------------------- valid ranges


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a number option: ``low`` and ``high`` (``None``: unbounded), each included unless
    ``low_open`` / ``high_open``; always finite. ``zero`` says what 0 means where 0 turns something off
    ("never", "off", "no clipping"), for the help and the run's start-up line (:func:`zero_notes`)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    zero: str | None = None

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range in words: ">= 1", "> 0", "in [0, 1)", "from 1 to 65535", "any finite number"; with
        ``zero``, "; 0: <what 0 means>"."""
        low, high = (_shown(v) for v in (self.low, self.high))
        if low is None and high is None:
            words = "any finite number"
        elif high is None:
            words = f"{'>' if self.low_open else '>='} {low}"
        elif low is None:
            words = f"{'<' if self.high_open else '<='} {high}"
        elif not self.low_open and not self.high_open and float(self.low).is_integer() and self.high > 1:
            words = f"from {low} to {high}"
        else:
            words = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        return f"{words}; 0: {self.zero}" if self.zero else words

    def check(self, name: str, value: Any) -> None:
        """``ValueError`` (:meth:`error`) when ``value``, or a number of its (nested) list, is outside the range."""
        for item in _numbers(value):
            if item not in self:
                raise ValueError(self.error(name, item if item == value else value))

    def error(self, name: str, value: Any) -> str:
        """The one-line error for ``value`` of option ``name`` outside the range."""
        return f"`{name}` must be {self.bounds()}, got {value!r}"

    def bounds(self) -> str:
        """The bounds alone, for errors: ">= 1", "in [0, 1)", "a finite number"."""
        words = self.describe().split("; ")[0]
        return "a finite number" if words == "any finite number" else words


def _shown(bound: float | None) -> str | None:
    """A bound as written in help: ``4294967295``, ``0.5``, ``1e-08``."""
    if bound is None:
        return None
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def at_least(low: float, zero: str | None = None) -> Range:
    """``value >= low`` (``zero``: what 0 means, when ``low`` is 0)."""
    return Range(low, zero=zero)


def above(low: float) -> Range:
    """``value > low``."""
    return Range(low, low_open=True)


def between(low: float, high: float, *, high_open: bool = False, zero: str | None = None) -> Range:
    """``low <= value <= high`` (``< high`` with ``high_open``)."""
    return Range(low, high, high_open=high_open, zero=zero)


#: Any finite number (an option with no bounds still states that it has none).
ANY_NUMBER = Range()


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: Sequence[Any] | None = None,
    valid: Range | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its help text and, where they are fixed, its choices (``None`` is always allowed
    for a field whose default is ``None``) or, for a number (or a list of numbers: each one), its valid range."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if valid is not None:
        metadata["valid"] = valid
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


def field_range(cls: type, name: str) -> Range | None:
    """The valid range of number field ``name`` of dataclass ``cls`` (``None``: it states none)."""
    return _definition(cls, name, "valid")


def _numbers(value: Any) -> list[Any]:
    """The numbers of a value: itself, or every number of a (nested) list; strings and ``None`` have none."""
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def check_ranges(options: Any) -> None:
    """``ValueError`` for the first field whose number (or a number of its list) is outside its range."""
    for f in dataclasses.fields(options):
        valid = field_range(type(options), f.name)
        if valid is not None:
            valid.check(f.name, getattr(options, f.name))


def zero_notes(options: Any) -> list[str]:
    """ "name 0: what 0 means" for every field at 0 whose range says 0 turns something off (a run logs them once
    at start, so a 0 that switches a feature off never goes unnoticed)."""
    notes = []
    for f in dataclasses.fields(options):
        valid = field_range(type(options), f.name)
        if valid is not None and valid.zero and getattr(options, f.name) == 0:
            notes.append(f"{f.name} 0: {valid.zero}")
    return notes


def zero_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """:func:`zero_notes` for a command line: "--warmup 0: no untimed runs" for every :func:`number` option of
    ``parser`` at 0 whose range says what 0 turns off (a command prints them once, before it starts)."""
    notes = []
    for action in parser._actions:
        valid = getattr(action.type, "valid", None)
        if valid is not None and valid.zero and getattr(args, action.dest, None) == 0:
            notes.append(f"{action.option_strings[0]} 0: {valid.zero}")
    return notes


def number(kind: type, valid: Range) -> Callable[[str], int | float]:
    """An ``argparse`` type: a number of ``kind`` (``int`` or ``float``, read by :func:`parse_text`) within
    ``valid``; ``nan`` and ``inf`` are refused. The type carries ``kind`` and ``valid`` (the help states the
    range; a test lists every number option by them)."""
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> int | float:
        try:
            value = parse_text(None, text, kind, where=repr(text))
        except ValueError:
            value = None
        if value is None or value not in valid:
            words = valid.bounds()
            raise argparse.ArgumentTypeError(
                f"expected {words if words.startswith('a ') else what + ' ' + words}, got {text!r}"
            )
        return value

    parse.__name__ = kind.__name__  # argparse's fallback message names the type
    parse.kind, parse.valid = kind, valid  # type: ignore[attr-defined]
    return parse


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


def _list_item(hint: Any) -> Any | None:
    """The item type of a list-like ``hint`` (``list[int]``, ``tuple[int, ...]``, ``Sequence[int]``: ``int``;
    bare ``list``: ``Any``), or ``None`` when ``hint`` is not a list."""
    if hint in (list, tuple):
        return Any
    if typing.get_origin(hint) in (list, tuple, collections.abc.Sequence):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return args[0] if args else Any
    return None


def describe(hint: Any) -> str:
    """What a value of type ``hint`` looks like, for error messages: "an integer", "a list of integers such as
    1,2,3", "'auto'", "true or false"."""
    if _is_union(hint):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        words = " or ".join(describe(m) for m in members)
        return f"{words} or none" if type(None) in typing.get_args(hint) else words
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(repr(v) for v in typing.get_args(hint))
    item = _list_item(hint)
    if item is not None:
        if item is int:
            return "a list of integers such as 3,5,10 (or 3x5x10)"
        if _list_item(item) is not None:
            return "a list of sizes such as 480x832,720x1280 (YAML: [[480, 832], [720, 1280]])"
        return "a list such as a,b (or YAML [a, b])"
    if origin_is_dict(hint):
        return "a mapping (YAML: {key: value})"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, "a value")


def origin_is_dict(hint: Any) -> bool:
    return hint is dict or typing.get_origin(hint) is dict


def list_items(text: str, numbers: bool = False) -> list[str]:
    """The items of a list written as text, by the list rule (module docstring): ``"a, b,c"`` ->
    ``["a", "b", "c"]``; with ``numbers``, ``x`` separates items too (``"3x5x10"`` -> ``["3", "5", "10"]``).
    Empty comma-separated items are dropped (``"1,2,"``); an ``x`` with nothing on one side keeps an empty item
    (``"x"`` -> ``["", ""]``), which no number reads."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    if numbers:
        items = [piece.strip() for item in items for piece in item.split("x")]
    return items


def coerce(name: str | None, value: Any, hint: Any) -> Any:
    """``value`` checked against the type annotation ``hint``; ``ValueError`` naming ``name`` otherwise.

    Ints are accepted for floats; a string that reads as a number for a float (YAML 1.1 reads ``1e-4``, with no
    dot, as a string); YAML's ``false`` for a string field is ``"no"`` (``mixed_precision: no``); a list field
    takes a list, or text by the list rule (module docstring); a ``Literal`` field one of its values. The error
    says what the field takes (:func:`describe`) and what it got."""
    if _is_union(hint):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(name, value, arg)
            except ValueError:
                pass
        raise ValueError(f"{_subject(name)} {describe(hint)}, got {value!r}")
    if hint is Any:
        return value
    if typing.get_origin(hint) is typing.Literal:
        if value in typing.get_args(hint) and not isinstance(value, bool):
            return value
        raise ValueError(f"{_subject(name)} {describe(hint)}, got {value!r}")
    item = _list_item(hint)
    if item is not None:
        return _coerce_list(name, value, hint, item)
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
    if origin_is_dict(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{_subject(name)} {describe(hint)}, got {value!r}")
        return dict(value)
    return value


def _coerce_list(name: str | None, value: Any, hint: Any, item: Any) -> list | tuple:
    """A list field's value: a list or tuple as it is, text (or one number) split by the list rule; each item
    checked against ``item``. A ``tuple[...]`` hint gives a tuple."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, list, tuple)):
        raise ValueError(f"{_subject(name)} {describe(hint)}, got {value!r}")
    try:
        if not isinstance(value, (list, tuple)):
            texts = list_items(str(value), numbers=item is int)
            if _list_item(item) is not None and not all("x" in t for t in texts):  # sizes: 480x832,720x1280
                raise ValueError("each item of a list of lists is written with x")
            value = texts if item is str or _list_item(item) is not None else [_item(t, item) for t in texts]
        items = [coerce(None, v, item) for v in value]
    except ValueError:
        raise ValueError(f"{_subject(name)} {describe(hint)}, got {value!r}") from None
    return tuple(items) if typing.get_origin(hint) is tuple or hint is tuple else items


def _item(text: str, hint: Any) -> Any:
    return parse_text(None, text, hint, where=repr(text))


def _accepts_list(hint: Any) -> bool:
    """Whether ``hint`` (or a member of its union) is a list type."""
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    return any(_list_item(m) is not None for m in members)


def _only_str(hint: Any) -> bool:
    """Whether ``hint`` is ``str`` or ``str | None``."""
    return {m for m in (typing.get_args(hint) if _is_union(hint) else (hint,)) if m is not type(None)} == {str}


def parse_text(name: str | None, text: str, hint: Any, where: str | None = None) -> Any:
    """A value written as text (command line, ``--set``, environment) read as YAML, then :func:`coerce`.

    Booleans are ``true`` or ``false`` only (YAML 1.1's ``yes``/``no``/``on``/``off`` stay words: a string
    field keeps them as written); a list field takes the list rule (module docstring: ``0,1,2``, ``3x5x10``,
    ``[0, 1, 2]``); a field that may be ``None`` takes ``none`` or ``null``. ``where`` names the text in a YAML
    syntax error (default ``name``)."""
    stripped = text.strip()
    if type(None) in typing.get_args(hint) and stripped.lower() in _NONE_WORDS:
        return None
    if _accepts_list(hint) and not stripped.startswith("["):
        value: Any = text  # the list rule splits it (coerce); YAML would read 3x5x10 or 0x10 as one scalar
        if _is_union(hint):  # another member (`auto`, `hybrid`) may take the text as it reads
            value = read_yaml(text, where or str(name)) if stripped else ""
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = text
    else:
        value = "" if stripped == "" else read_yaml(text, where or str(name))
    if isinstance(value, bool) and stripped.lower() not in ("true", "false"):
        value = text
    if _only_str(hint) and isinstance(value, (bool, int, float)):
        value = text  # a string field keeps `010`, `1e-4` or `no` as written
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


def parse_assignment(item: str, hints: dict[str, Any], kind: str = "setting") -> tuple[str, Any]:
    """``--set NAME=VALUE``: ``(NAME, VALUE read as hints[NAME] by parse_text)``; ``ValueError`` naming the item
    (an unknown name with the closest one)."""
    name, eq, value = item.partition("=")
    if name not in hints:
        raise unknown_name(kind, name, hints)
    if not eq:
        raise ValueError(f"--set {item!r}: expected NAME=VALUE ({name}=...)")
    try:
        return name, parse_text(name, value, hints[name], where="the value")
    except ValueError as error:
        raise ValueError(f"--set {item!r}: {error}") from None


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
        choices, valid = field_choices(cls, f.name), field_range(cls, f.name)
        one_of = f"one of {', '.join(map(str, choices))}; " if choices else f"{valid.describe()}; " if valid else ""
        default = _default_of(f)
        parser.add_argument(
            *names,
            dest=f.name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{field_help(cls, f.name)} ({one_of}default: {default!r})".replace("%", "%%"),
        )


def state_ranges(parser: argparse.ArgumentParser) -> None:
    """Append its valid range to the help of every option of ``parser`` whose type is a :func:`number` (once):
    ``--max-frames`` "largest frame count (default 81) (>= 1)"."""
    for action in parser._actions:
        valid = getattr(action.type, "valid", None)
        if valid is not None and action.help is not argparse.SUPPRESS:
            words = valid.describe()
            if words not in (action.help or ""):
                action.help = f"{action.help} ({words})" if action.help else words.capitalize()


def settings_with(settings: Any, overrides: list[str]) -> Any:
    """``settings`` (a settings dataclass: the embedded build's ``BuildSettings``, the reproduction's
    ``ExperimentSettings``)
    with ``NAME=VALUE`` overrides, each read against the field's type by the option layer's
    :func:`parse_text` (a list field takes comma-separated values, ``seeds=0,1,2``;
    an optional count takes ``none``)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(type(settings))
    hints = {f.name: hints[f.name] for f in dataclasses.fields(settings)}
    return dataclasses.replace(settings, **dict(parse_assignment(item, hints) for item in overrides))
