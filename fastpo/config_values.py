"""Typed values onto config dataclasses: one converter (:func:`coerce`) for a ``--config`` file's YAML / JSON values,
a run's ``config.json``, a value typed on the command line (``fastpo.cli`` hands every non-string flag to it) and the
checks of a config built in code.

    coerce("0.8,0.95", tuple[float, float], "optim.betas")      # -> (0.8, 0.95)
    merge(Config(), {"algorithm": {"eps_high": 0.3}}, "run.yaml")  # in place; unknown keys get close matches
    data = load_file("run.yaml")                                 # bounded YAML / JSON (fastpo.config_io)

Spellings: bools as ``true`` / ``false`` (also 1/0, yes/no, on/off), lists as ``a,b`` or ``[a, b]``, mappings and
lists of mappings as YAML / JSON. Every error is a ``fastpo.config.ConfigError`` of one line naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

TRUE, FALSE = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off"})


def error(message: str) -> Exception:
    """A ``fastpo.config.ConfigError`` (imported when raised: the config module imports this one)."""
    from .config import ConfigError

    return ConfigError(message)


def _shown(value: Any) -> str:
    from .config import shown  # a value in a message is cut to a bounded length, whatever its size

    return shown(value)


def split_list(values: Sequence[str]) -> list[str]:
    """``["a,b"]``, ``["a", "b"]`` and ``["[a, b]"]`` -> ``["a", "b"]``."""
    out = []
    for value in values:
        text = value.strip()
        if text[:1] in "([" and text[-1:] in ")]":
            text = text[1:-1]
        out += [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
    return out


def coerce(value: Any, tp: Any, name: str) -> Any:
    """``value`` (a YAML / JSON value, or command-line text) as the field type ``tp``; a ConfigError starting with
    ``name`` (the dotted field; none when empty) otherwise."""
    def bad(expected: str) -> Exception:
        return error(f"{_named(name)}expected {expected}, got {_shown(value)}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return coerce(value, args[0], name)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        return coerce(value, next(a for a in args if a is not type(None)), name)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise error(f"{_named(name)}expected one of {list(args)}, got {_shown(value)}{did_you_mean(str(value), args)}")
    if origin is tuple:
        items = split_list([value]) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise bad(type_name(tp))
        kinds = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(items) != len(kinds):
            raise bad(f"{len(kinds)} values ({type_name(tp)})")
        return tuple(coerce(v, k, f"{name}[{i}]") for i, (v, k) in enumerate(zip(items, kinds, strict=True)))
    if origin in (list, dict) or tp is dict:
        kind = list if origin is list else dict
        if isinstance(value, str):
            value = _yaml(value, kind, name)
        if not isinstance(value, (list, tuple) if kind is list else dict):
            raise bad("a list such as [{\"name\": \"sokoban\"}]" if kind is list else "a mapping such as {\"key\": 1}")
        if kind is dict:
            return dict(value)
        return [coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if tp is bool:
        if isinstance(value, str) and value.lower() in TRUE | FALSE:
            return value.lower() in TRUE
        if not isinstance(value, bool):
            raise bad("a bool (true/false)")
        return value
    if tp in (int, float):
        if isinstance(value, (int, float if tp is float else int)) and not isinstance(value, bool):
            return tp(value)
        try:
            if isinstance(value, str):
                return tp(value)
        except ValueError:
            pass
        raise bad(tp.__name__)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise bad("str")
        return str(value)
    if tp is Any:
        return value
    raise error(f"{_named(name)}unsupported field type {tp!r}")


def _named(name: str) -> str:
    """The start of a message about field ``name`` ('' for a value without one: the caller names it)."""
    return f"{name}: " if name else ""


def _yaml(text: str, kind: type, name: str) -> Any:
    """``text`` read as one YAML / JSON value of type ``kind`` (an empty text is an empty one)."""
    from .config_io import load_yaml

    try:
        value = load_yaml(text, f"the value {_shown(text)}") if text.strip() else kind()
    except ValueError as e:
        raise error(f"{_named(name)}expected a YAML / JSON {kind.__name__}: {e}") from None
    if not isinstance(value, kind):
        raise error(f"{_named(name)}expected a YAML / JSON {'mapping' if kind is dict else 'list'}, "
                    f"got {_shown(text)}")
    return value


def type_name(tp: Any) -> str:
    """A short name of a field type for messages: ``{a,b}`` for a Literal, ``tuple[str, ...]``, ``int | None``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin is tuple:
        return "tuple[" + ", ".join("..." if a is Ellipsis else type_name(a) for a in args) + "]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    return origin.__name__ if origin in (dict, list) else getattr(tp, "__name__", str(tp))


def did_you_mean(name: str, choices: Any, cutoff: float = 0.5) -> str:
    """``"; did you mean a, b?"`` for the close matches of ``name`` among ``choices`` ('' when none); ``cutoff``:
    difflib's similarity floor (flags sharing a long ``--section.`` prefix need a higher one)."""
    if len(name) > 200:  # no field or choice is this long; difflib would take quadratic time over it
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=3, cutoff=cutoff)
    return f"; did you mean {', '.join(close)}?" if close else ""


def ragen_hint(name: str, valid: Any, flag: bool) -> str:
    """``"; RAGEN's clip_ratio_low is --algorithm.eps_low"`` when `name` (an unknown setting) is RAGEN's spelling of
    fields among `valid` (the entry point's dotted field names; the port's table ``ragen_keys.KEY_MAP``), or
    ``"; ... a RAGEN config"`` for a RAGEN top-level section; '' otherwise."""
    from .ragen_keys import RAGEN_SECTIONS, ragen_equivalents

    key = name.lstrip("-")
    if "." not in key and key in RAGEN_SECTIONS:
        return (f"; {key!r} is a section of a RAGEN config: port it with python -m fastpo.ragen_config FILE "
                f"(it writes the fastpo config)")
    short, fields = ragen_equivalents(key)
    fields = [f for f in fields if f in valid]
    return f"; RAGEN's {short} is " + " or ".join(f"--{f}" if flag else f for f in fields) if fields else ""


def renamed_hint(name: str, root: Any, flag: bool) -> str:
    """``"; did you mean --trainer.keep_checkpoints? (the new name of trainer.keep_last)"`` when `name` (an unknown
    dotted setting, ``--`` or not) is a field's old name in the ``_renamed`` map of its section of the dataclass
    `root` (instance or class); '' otherwise. Config files still read old names (a run's config.json from before
    the rename); on the command line an old name is refused with this hint."""
    *path, last = name.lstrip("-").split(".")
    cls = root if isinstance(root, type) else type(root)
    for part in path:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return ""
        cls = hints[part]
    new = getattr(cls, "_renamed", {}).get(last) if dataclasses.is_dataclass(cls) else None
    if new is None:
        return ""
    return f"; did you mean {'--' if flag else ''}{'.'.join([*path, new])}? (the new name of {'.'.join([*path, last])})"


def field_names(obj: Any, prefix: str = "") -> list[str]:
    """The dotted names of every field of the dataclass (instance or class) ``obj``, nested sections walked."""
    hints = typing.get_type_hints(obj if isinstance(obj, type) else type(obj))
    out = []
    for f in dataclasses.fields(obj):
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out += field_names(hints[f.name], f"{prefix}{f.name}.")
    return out


def merge(obj: Any, data: Any, source: str = "config", known: Callable[[str], bool] | None = None,
          prefix: str = "") -> Any:
    """Apply a nested ``{section: {field: value}}`` mapping (YAML / JSON) onto the dataclass ``obj`` in place and
    return it. A key ``obj`` lacks is an error (with close matches), unless ``known(dotted_name)`` says it is a
    setting of another entry point (then it is skipped: a run's config.json holds every trainer setting)."""
    fields = [f.name for f in dataclasses.fields(obj)]
    if not isinstance(data, dict):
        if prefix:
            raise error(f"{source}: section {prefix[:-1]!r} must be a mapping of fields, got {_shown(data)}")
        raise error(f"{source}: expected a mapping of sections {fields}, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for key, value in data.items():
        key = getattr(obj, "_renamed", {}).get(key, key)  # a field's old name in an older run's config file
        dotted = f"{prefix}{key}"
        if key not in fields:
            if known is not None and known(dotted):
                continue
            valid = [prefix + f for f in fields]
            raise error(f"{source}: unknown {'field' if prefix else 'section'} {_shown(dotted)}"
                        f"{did_you_mean(dotted, valid)}{ragen_hint(dotted, set(valid), flag=False)}")
        if dataclasses.is_dataclass(getattr(obj, key)):
            merge(getattr(obj, key), value, source, known, f"{dotted}.")
        else:
            setattr(obj, key, coerce(value, hints[key], dotted))
    return obj


def load_file(path: str) -> dict[str, Any]:
    """A YAML (or JSON) config file as a mapping, read with ``fastpo.config_io.load_yaml`` (bounded depth and size);
    ConfigError naming the file when it cannot be read."""
    from .config_io import load_yaml_file

    try:
        data = load_yaml_file(path, f"--config file {path!r}", "a YAML / JSON mapping of sections")
    except ValueError as e:
        raise error(str(e)) from None
    return data or {}
