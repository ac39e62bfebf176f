"""Command-line options made from a config dataclass: the one generator of every `bert` command
that has a config (`clean`, `vocab`, `instances`, `pretrain`, `finetune`).

Each field is the option `--field-name`, typed by its annotation, with its default and help in
the field, so the command line, the MLflow parameters (`asdict(cfg)`), metrics.json's `config`
and Python callers (tests, bench/) cannot drift apart. The rules, the same for every command:

- `X | None` takes an X, or `none` / empty text for None, whatever X is (int, float, str,
  a comma list): KFP and DVC pass an empty or `none` parameter for "not set";
- a `bool` that defaults to False is a `store_true` flag; one that defaults to True is switched
  off by its aliases only (`lowercase`: `--cased`);
- `tuple[X, ...]` is a comma list (`5e-5,4e-5`); `tuple[X, X]` takes that many values;
- a float is finite, and a float or an int within its field's `within` range when it has one
  (`RANGES`: a learning rate > 0, a share in [0, 1], a count of workers > 0, a seed >= 0); nan,
  inf, -0.05 or a seed of -1 is refused as the option is parsed;
- a field without a default is a required option;
- the help ends with " (default: ...)", unless it is a flag's or says its default itself.
"""

from __future__ import annotations

import argparse
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, field, fields

NONE_TEXTS = ("", "none")  # what a pipeline passes for a parameter left unset
# for the error messages, by the converter's name (`number` names its int converter "int")
WHAT = {"int": "an integer", "float": "a number", "number": "a number", "str": "text"}
# an option's range (`option(within=...)`), a float's or an int's: its test and how the error
# message says it
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "positive": (lambda x: x > 0, " > 0"),
    "non-negative": (lambda x: x >= 0, " >= 0"),
    "share": (lambda x: 0 <= x <= 1, " in [0, 1]"),
    "fraction": (lambda x: 0 < x <= 1, " in (0, 1]"),  # of something kept: none is no model
}


def option(
    default: typing.Any,
    help: str,
    *aliases: str,
    within: str | None = None,
    **argparse_kw: typing.Any,
) -> typing.Any:
    """A config field that is also the option `--field-name` (and `aliases`, e.g. "--lr").
    `within`: a float's range, a key of `RANGES`. `argparse_kw` (metavar, choices, type, ...) go
    to `add_argument` as they are; `help` may be `argparse.SUPPRESS`;
    `default=dataclasses.MISSING` makes a required option."""
    meta = {"help": help, "aliases": aliases, "kw": argparse_kw, "within": within}
    return field(default=default, metadata=meta)


def number(within: str | None = None, kind: type = float) -> Callable[[str], float]:
    """A float option's converter (`kind` int: an int's): a finite number, in the
    `RANGES[within]` range when given. A NaN learning rate or temperature would train to NaN
    weights and exit 0; a seed of -1 or a worker count of 0 fails deep in numpy or Ray."""
    test, says = RANGES[within] if within else (math.isfinite, "")

    def parse(text: str) -> float:
        x = kind(text)  # a ValueError: argparse's "invalid number value", or the list's
        if not math.isfinite(x) or not test(x):
            what = "a finite number" if kind is float else "an integer"
            raise argparse.ArgumentTypeError(f"expected {what}{says}: {text!r}")
        return x

    parse.__name__ = "number" if kind is float else "int"
    return parse


def optional(convert: Callable[[str], typing.Any]) -> Callable[[str], typing.Any]:
    """`convert`, with `none` or empty text (any case, spaces around) meaning None."""

    def parse(text: str) -> typing.Any:
        if text.strip().lower() in NONE_TEXTS:
            return None
        try:
            return convert(text)
        except ValueError:
            name = getattr(convert, "__name__", "value")
            what = WHAT.get(name, f"a {name}")
            raise argparse.ArgumentTypeError(f"expected {what} or 'none': {text!r}") from None

    parse.__name__ = f"optional_{getattr(convert, '__name__', 'value')}"
    return parse


def comma_list(item: Callable[[str], typing.Any]) -> Callable[[str], tuple]:
    """'5e-5,4e-5' -> (5e-05, 4e-05): a `tuple[X, ...]` field's option."""

    def parse(text: str) -> tuple:
        try:
            return tuple(item(x) for x in text.split(",") if x.strip())
        except ValueError:
            kind = "numbers" if item in (int, float) or item.__name__ == "number" else "values"
            message = f"expected {kind} separated by commas: {text!r}"
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = "comma list"
    return parse


def add_options(
    parser: argparse.ArgumentParser, config_class: type, skip: Iterable[str] = ()
) -> None:
    """One option per field of `config_class` (but those in `skip`), by the module's rules."""
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        if f.name in skip:
            continue
        meta = _metadata(config_class, f.name)
        names, kw = _argument(f, hints[f.name], meta)
        parser.add_argument(*names, dest=f.name, **kw)


def config_from_args(args: argparse.Namespace, config_class: type) -> typing.Any:
    """The config the parsed options give; a field without an option (`skip`) keeps its
    default."""
    given = vars(args)
    return config_class(**{f.name: given[f.name] for f in fields(config_class) if f.name in given})


def _metadata(config_class: type, name: str) -> Mapping[str, typing.Any]:
    """The field's help/aliases: a subclass that only changes a default keeps its parent's."""
    for k in config_class.__mro__:
        f = getattr(k, "__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata:
            return f.metadata
    raise TypeError(f"{config_class.__name__}.{name}: no help (declare it with option())")


def _argument(
    f: Field, hint: typing.Any, meta: Mapping[str, typing.Any]
) -> tuple[list[str], dict[str, typing.Any]]:
    """The option's names and `add_argument` keywords for one field."""
    names = [f"--{f.name.replace('_', '-')}", *meta.get("aliases", ())]
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    kind, can_be_none = hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        (kind,) = [a for a in typing.get_args(hint) if a is not type(None)]
        can_be_none = True
    kw: dict[str, typing.Any] = {"help": _help(meta["help"], default, flag=kind is bool)}
    within = meta.get("within")
    if kind is float or (kind is int and within):
        kind = number(within, kind)
    if default is MISSING:
        kw.update(required=True, type=kind)
    elif kind is bool:
        if default and not meta.get("aliases"):
            raise TypeError(f"{f.name}: a flag defaulting to True needs an alias to unset it")
        names = names[1:] if default else names  # `--lowercase` would do nothing
        kw.update(action="store_false" if default else "store_true", default=bool(default))
    elif typing.get_origin(kind) is tuple:
        items = typing.get_args(kind)
        finite = number(within)  # one converter: `tuple[float, float]` needs equal items
        items = tuple(
            finite if x is float else number(within, int) if x is int and within else x
            for x in items
        )
        if len(items) == 2 and items[1] is Ellipsis:  # tuple[X, ...]: a comma list
            convert = comma_list(items[0])
            kw.update(type=optional(convert) if can_be_none else convert, default=default)
        elif len(set(items)) == 1 and not can_be_none:  # tuple[X, X]: that many values
            kw.update(type=items[0], nargs=len(items), default=default)
        else:
            raise TypeError(f"{f.name}: {kind} is neither tuple[X, ...] nor tuple[X, X]")
    else:
        kw.update(type=optional(kind) if can_be_none else kind, default=default)
    kw.update(meta.get("kw", {}))  # the field's own: metavar, choices, a type of its own, ...
    return names, kw


def _help(text: str, default: typing.Any, flag: bool) -> str:
    """argparse formats help with %: a literal % is doubled, %(default)s is left for it."""
    if text is argparse.SUPPRESS:
        return text
    text = re.sub(r"%(?!\(default\)s)", "%%", text)
    if flag or default is MISSING or "(default" in text:
        return text
    return f"{text} (default: %(default)s)"
