"""Settings declared once: a settings field carries its own flag, help and default.

A field made with `setting(...)` is the one declaration of a command-line setting: the
settings object's default, the flag's name, its help and how its text becomes the
field's value. From a settings object's defaults, `add_flags` adds every such field of it
(and of the settings objects nested in it) to an argparse parser, `from_flags` builds the
object back from the parsed flags, and `forward_flags` writes the flags again, so that
`specd serve` hands each of its processes exactly the flags it was given. A field that
`serve` decides itself (where a process listens, how the gateway reaches its workers) is
declared `serve=False`; every other one `serve` takes and passes on.

Pure standard library: importing this loads nothing else.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def setting(default: Any = None, *, flag: str, help: str, factory: Callable[[], Any] | None = None,
            parse: Callable[[Any], Any] | None = None, cli_default: Any = dataclasses.MISSING,
            serve: bool = True, **argparse_options: Any) -> Any:
    """A settings field with its flag.

    default (or factory, for a mutable one): the settings object's default. cli_default:
    the flag's default where it differs, for a setting the command line turns on while
    code that embeds a service opts in. parse: turns the flag's parsed value into the
    field's (a comma list into a tuple); without it the value is the field's as it is.
    serve: whether `specd serve` takes the flag and passes it on. The rest goes to
    `ArgumentParser.add_argument` (type, choices, metavar, action).
    """
    metadata = {"flag": flag, "help": help, "parse": parse, "cli_default": cli_default, "serve": serve,
                "argparse": argparse_options}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _flagged(defaults: Any, serve_only: bool = False, nested: bool = True) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, default value) of every flagged field of `defaults` and (nested) of the
    settings objects nested in it, in declaration order."""
    for field in dataclasses.fields(defaults):
        value = getattr(defaults, field.name)
        if "flag" in field.metadata:
            if field.metadata["serve"] or not serve_only:
                yield field, value
        elif nested and dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _flagged(value, serve_only)


def _dest(field: dataclasses.Field) -> str:
    return field.metadata["flag"].lstrip("-").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, defaults: Any, serve_only: bool = False, nested: bool = True) -> None:
    """Add a flag for each flagged field of the settings object `defaults` (and of those
    nested in it), its default taken from there; serve_only: only those `specd serve` takes."""
    for field, value in _flagged(defaults, serve_only, nested):
        meta = field.metadata
        options = dict(meta["argparse"])
        default = value if meta["cli_default"] is dataclasses.MISSING else meta["cli_default"]
        if isinstance(default, bool) and "action" not in options:
            options["action"] = "store_true"
        elif "type" not in options and "action" not in options and isinstance(default, (int, float, Path)):
            options["type"] = type(default)
        unset = default is None or default is False or default == "" or options.get("action") == "append"
        shown = "" if unset else " (default: %(default)s)"
        parser.add_argument(meta["flag"], dest=_dest(field), default=default, help=meta["help"] + shown, **options)


def from_flags(defaults: Any, args: argparse.Namespace, **given: Any) -> Any:
    """The settings object `defaults` with each flagged field (nested ones too) read from the
    parsed `args`; `given` sets fields the flags do not (a model directory, the server)."""
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(defaults):
        value = getattr(defaults, field.name)
        if field.name in given:
            changes[field.name] = given[field.name]
        elif "flag" in field.metadata and hasattr(args, _dest(field)):
            raw = getattr(args, _dest(field))
            parse = field.metadata["parse"]
            changes[field.name] = parse(raw) if parse is not None else raw
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes[field.name] = from_flags(value, args)
    return dataclasses.replace(defaults, **changes)


def forward_flags(defaults: Any, args: argparse.Namespace, nested: bool = True) -> list[str]:
    """The flags `specd serve` took for the settings object `defaults` (and those nested in
    it), written back as a command line for the process that owns them."""
    argv: list[str] = []
    for field, _ in _flagged(defaults, serve_only=True, nested=nested):
        flag, raw = field.metadata["flag"], getattr(args, _dest(field))
        if raw is None or raw is False:
            continue
        if raw is True:
            argv.append(flag)
        elif isinstance(raw, list):
            argv += [f"{flag}={item}" for item in raw]
        else:
            argv.append(f"{flag}={raw}")  # with "=": a value may be empty or start with "-"
    return argv


def optional_path(value: str | None) -> Path | None:
    """A file flag's path; unset or empty ("--api-keys=" from an empty variable) is None,
    not the current directory."""
    return Path(value) if value else None


def comma_list(value: str) -> tuple[str, ...]:
    """"a,b" → ("a", "b"); "" → () (a flag that lists names)."""
    return tuple(name for name in value.split(",") if name)


def name_pairs(values: list[str] | None) -> dict[str, str]:
    """["KEY=VALUE", ...] → {KEY: VALUE} (a repeatable flag that maps names)."""
    return dict(value.split("=", 1) for value in values or [])
