"""The `bouquet` command's options, derived from the config dataclasses, and the JSON a parent hands its child.

A config field declared with `config.flag(...)` is an option of every command that takes its config: `--field-name`
(or the name it gives), typed as the field is (a bool is a `--x/--no-x` switch, a tuple a repeated option), with
the field's help and default. An option not given parses to None, so the dataclass's own default applies and only
what was given is passed on. A child process (serve's replicas and gateways, a gateway's workers) gets its config
whole as JSON in `--config FILE`, field by field in the same names; options given beside it override the file."""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Option:
    """One command-line option, setting the config field at `path` (nested configs: "cuda_graphs.enabled")."""

    path: str
    flag: str
    kwargs: Mapping[str, Any]  # argparse's add_argument keywords

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")


def options_of(config: type, skip: Iterable[str] = (), prefix: str = "") -> list[Option]:
    """Every option `config`'s fields declare, nested configs' included, but the field paths in `skip`."""
    skipped = set(skip)
    hints = typing.get_type_hints(config)
    found: list[Option] = []
    for item in fields(config):
        path = prefix + item.name
        if path in skipped:
            continue
        if is_dataclass(hints[item.name]):
            found += options_of(hints[item.name], skipped, prefix=f"{path}.")
        elif "help" in item.metadata:
            found.append(_option(path, item, hints[item.name]))
    return found


def _option(path: str, item: Field[Any], hint: Any) -> Option:
    meta = item.metadata
    kind = _without_none(hint)
    flag = meta["flag"] or "--" + item.name.replace("_", "-")
    kwargs: dict[str, Any] = {
        "dest": path.replace(".", "__"),
        "help": _with_default(meta["help"], item),
        "metavar": _METAVARS.get(typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else kind)
        or flag.removeprefix("--").replace("-", "_").upper(),
    }
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        del kwargs["metavar"]
    elif typing.get_origin(kind) is tuple:
        kwargs.update(action="append", type=typing.get_args(kind)[0])
    else:
        kwargs["type"] = kind
    if meta["choices"]:
        kwargs["choices"] = list(meta["choices"])
        del kwargs["metavar"]  # the choices show instead
    return Option(path, flag, kwargs)


_METAVARS: dict[Any, str] = {int: "N", float: "X", Path: "PATH"}


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (kind,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return kind
    return hint


_SAYS_DEFAULT = re.compile(r"^default|\(default|default:")


def _with_default(help: str, item: Field[Any]) -> str:
    """The help with the default, where it does not already say it (inside its closing parenthesis, if any)."""
    default = item.default
    if default is MISSING or default is None or default == () or _SAYS_DEFAULT.search(help):
        return help
    shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
    shown = shown.replace("%", "%%")  # argparse %-formats help
    return f"{help[:-1]}; default {shown})" if help.endswith(")") else f"{help} (default {shown})"


def add_options(parser: argparse._ActionsContainer, options: Iterable[Option]) -> None:
    for option in options:
        parser.add_argument(option.flag, **option.kwargs)


def given(args: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """The options given on the command line, as nested field values: {"cuda_graphs": {"enabled": False}}."""
    values: dict[str, Any] = {}
    for option in options:
        value = getattr(args, option.dest, None)
        if value is not None:
            *outer, name = option.path.split(".")
            inner = values
            for part in outer:
                inner = inner.setdefault(part, {})
            inner[name] = value
    return values


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over`'s values in place of `base`'s, nested sections merged rather than replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
        )
    return out


def build(config: type, values: Mapping[str, Any]) -> Any:
    """`config` from field values as `given` or a JSON file holds them: paths from strings, tuples from lists,
    nested configs from their sections. Unknown fields are refused by name."""
    hints = typing.get_type_hints(config)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"{config.__name__} has no field {', '.join(unknown)}")
    return config(**{name: _coerce(hints[name], value) for name, value in values.items()})


def _coerce(hint: Any, value: Any) -> Any:
    kind = _without_none(hint)
    if value is None:
        return None
    if is_dataclass(kind) and isinstance(value, Mapping):
        return build(kind, value)  # type: ignore[arg-type]
    if typing.get_origin(kind) is tuple:
        (item, *_) = typing.get_args(kind)
        return tuple(_coerce(item, element) for element in value)
    if kind is Path:
        return Path(value)
    return value


def write_config_file(path: Path, sections: Mapping[str, Any]) -> Path:
    """Config sections of field values (Paths, tuples, nested sections) as `read_config_file` and `build` read
    them back; readable by this user only (a private directory holds it too)."""
    path.touch(mode=0o600)
    path.write_text(json.dumps(sections, default=str, indent=1), encoding="utf-8")
    return path


def read_config_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: a JSON object of config sections is needed")
    return values
