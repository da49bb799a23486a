"""One command line for every entry point: nested dataclass configs parsed by tyro, the same flag for the same
setting everywhere (``--model.path``, ``--env.kwargs``, ``--rollout.enable_think`` ...).

    cfg = parse(Config, argv, prog="fastpo-train", presets=PRESETS)     # train: --preset < --config < flags
    args = parse(EvalArgs, argv, prog="fastpo-eval")                    # eval: --config < flags
    Section = subset(EnvConfig, "names", "kwargs", doc="...")           # a section with some of a class's fields

Precedence: the dataclass defaults < ``--preset NAME`` (where the entry point has presets) < ``--config FILE``
(YAML or JSON, nested ``section: {field: value}``; a run's ``config.json`` works for every entry point, whose
sections and fields it does not use are ignored) < ``--section.field VALUE`` flags. Values on the command line:
bools as ``true`` / ``false`` (or the bare flag for true), lists as ``a,b`` or ``a b`` or ``[a, b]``, mappings
and lists of mappings as YAML / JSON. A bad flag or value raises :class:`fastpo.config.ConfigError` with tyro's
message (unknown flags come with "Perhaps you meant" suggestions); ``--help`` prints every field with its
documentation and default. A ``--config`` file's ``env.plugins`` (modules to import, i.e. code to run) are refused
unless ``--env.plugins`` names them on the command line or ``--trust_plugins`` is given (:data:`TRUST_PLUGINS`).

Why tyro: it reads the attribute docstrings the config classes already have (one place documents a field), builds
nested ``--section.field`` flags, shows defaults and wraps the help to the terminal; the rules below only teach it
fastpo's spellings of bools, lists and mappings, which the project's commands and YAML files already use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

T = TypeVar("T")

_TRUE, _FALSE = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off"})


try:
    from tyro.conf import Positional
except ModuleNotFoundError:  # no tyro (a bare GPU image): the marker is a no-op and the plain parser reads flags

    class Positional:  # noqa: D101 - stands in for tyro.conf.Positional[T]
        def __class_getitem__(cls, tp: Any) -> Any:
            return tp


def _error(message: str) -> Exception:
    from .config import ConfigError

    return ConfigError(message)


def _shown(value: Any) -> str:
    from .config_io import shown  # a value in a message is cut to a bounded length, whatever its size

    return shown(value)


# --------------------------------------------------------------------------------- tyro's primitive rules
def _registry():
    """tyro rules for fastpo's command-line spellings (bool, lists, mappings)."""
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

    registry = ConstructorRegistry()

    @registry.primitive_rule
    def _bool(info: PrimitiveTypeInfo):
        if info.type is not bool:
            return None

        def parse(args: list[str]) -> bool:
            if not args:  # the bare flag
                return True
            if len(args) == 1 and args[0].lower() in _TRUE | _FALSE:
                return args[0].lower() in _TRUE
            raise ValueError(f"expected a bool (true/false, 1/0, yes/no, on/off), got {_shown(' '.join(args))}")

        return PrimitiveConstructorSpec(nargs="*", metavar="{true,false}", instance_from_str=parse,
                                        is_instance=lambda x: isinstance(x, bool),
                                        str_from_instance=lambda x: [str(x).lower()])

    def number(kind: type, article: str):
        def parse(args: list[str]):
            try:
                return kind(args[0])
            except ValueError:
                raise ValueError(f"expected {article} {kind.__name__}, got {_shown(args[0])}") from None

        return PrimitiveConstructorSpec(nargs=1, metavar=kind.__name__.upper(), instance_from_str=parse,
                                        is_instance=lambda x: isinstance(x, kind) and not isinstance(x, bool),
                                        str_from_instance=lambda x: [str(x)])

    @registry.primitive_rule
    def _number(info: PrimitiveTypeInfo):
        return number(info.type, "an" if info.type is int else "a") if info.type in (int, float) else None

    @registry.primitive_rule
    def _yaml_value(info: PrimitiveTypeInfo):  # a mapping, or a list of mappings (env.train): one YAML argument
        kind = dict if info.type is dict or info.type_origin is dict else list if info.type_origin is list else None
        if kind is None:
            return None
        return PrimitiveConstructorSpec(nargs=1, metavar="YAML", instance_from_str=lambda a: _yaml(a[0], kind),
                                        is_instance=lambda x: isinstance(x, kind),
                                        str_from_instance=lambda x: [json.dumps(x)])

    @registry.primitive_rule
    def _sequence(info: PrimitiveTypeInfo):
        if info.type_origin is not tuple:
            return None
        args = typing.get_args(info.type)
        if not args or not all(a in (str, int, float) for a in args if a is not Ellipsis):
            return None
        count = None if len(args) == 2 and args[1] is Ellipsis else len(args)

        def parse(values: list[str]) -> tuple:
            items = _split_list(values)
            if count is not None and len(items) != count:
                raise ValueError(f"expected {count} values, got {len(items)}: {items}")
            kinds = [args[0]] * len(items) if count is None else list(args)
            return tuple(kind(item) for kind, item in zip(kinds, items, strict=True))

        kind_name = "/".join(dict.fromkeys(a.__name__.upper() for a in args if a is not Ellipsis))
        return PrimitiveConstructorSpec(nargs="*", metavar=f"{kind_name},...", instance_from_str=parse,
                                        is_instance=lambda x: isinstance(x, tuple),
                                        str_from_instance=lambda x: [",".join(map(str, x))] if x else [])

    return registry


def _split_list(values: Sequence[str]) -> list[str]:
    """``["a,b"]``, ``["a", "b"]`` and ``["[a, b]"]`` -> ``["a", "b"]``."""
    out = []
    for value in values:
        text = value.strip()
        if text[:1] in "([" and text[-1:] in ")]":
            text = text[1:-1]
        out += [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
    return out


def _yaml(text: str, kind: type) -> Any:
    from .config_io import load_yaml, shown

    try:
        value = load_yaml(text, f"the value {shown(text)}") if text.strip() else kind()
    except ValueError as e:
        raise ValueError(f"expected a YAML / JSON {kind.__name__}: {e}") from None
    if not isinstance(value, kind):
        raise ValueError(f"expected a YAML / JSON {'mapping' if kind is dict else 'list'}, got {shown(text)}")
    return value


# ---------------------------------------------------------------------------------------- config sections
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right below each field) of a dataclass, whitespace collapsed; fields of
    a class made by :func:`subset` carry theirs in the tyro annotation."""
    made = getattr(cls, "__fastpo_docs__", None)
    if made is not None:
        return dict(made)
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def subset(cls: type, *names: str, doc: str | None = None, defaults: dict[str, Any] | None = None,
           docs: dict[str, str] | None = None, name: str | None = None) -> type:
    """A dataclass with the fields ``names`` of dataclass ``cls``: the same names, types, defaults (``defaults``
    replaces some) and documentation (``docs`` replaces some, where the entry point uses a field differently), so
    an entry point that uses part of a config section offers exactly those flags, spelled as the trainer's."""
    import tyro

    docs, hints = {**field_docs(cls), **(docs or {})}, typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"subset({cls.__name__}): no field(s) {unknown}; fields: {list(by_name)}")
    defaults = dict(defaults or {})
    made = []
    for n in names:
        f = by_name[n]
        if n in defaults:
            value = defaults.pop(n)
            spec = dataclasses.field(default_factory=lambda v=value: _copy(v)) if isinstance(
                value, (list, dict)) else dataclasses.field(default=value)
        elif f.default_factory is not dataclasses.MISSING:
            spec = dataclasses.field(default_factory=f.default_factory)
        else:
            spec = dataclasses.field(default=f.default)
        made.append((n, Annotated[hints[n], tyro.conf.arg(help=clean_doc(docs.get(n, "")))], spec))
    if defaults:
        raise ValueError(f"subset({cls.__name__}): defaults for fields not in the subset: {sorted(defaults)}")
    out = dataclasses.make_dataclass(name or cls.__name__, made)
    out.__doc__ = doc if doc is not None else cls.__doc__
    out.__fastpo_docs__ = {n: docs.get(n, "") for n in names}
    return out


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def clean_doc(text: str) -> str:
    """A docstring as help text: whitespace collapsed, reST markup (````code````) dropped."""
    return " ".join(text.split()).replace("``", "")


_MIRRORS: dict[type, type] = {}


def _mirror(cls: type) -> type:
    """``cls`` rebuilt for tyro with every field's help given explicitly (its docstring on one line, without
    markup; tyro would otherwise keep the source's line breaks) and nested sections mirrored the same way."""
    if cls in _MIRRORS:
        return _MIRRORS[cls]
    import tyro

    docs, hints = field_docs(cls), typing.get_type_hints(cls, include_extras=True)
    made = []
    for f in dataclasses.fields(cls):
        tp, extras = hints[f.name], ()
        if typing.get_origin(tp) is Annotated:  # keep markers such as tyro.conf.Positional
            tp, extras = typing.get_args(tp)[0], tuple(tp.__metadata__)
        if dataclasses.is_dataclass(tp):
            tp = _mirror(tp)
        spec = (dataclasses.field(default_factory=f.default_factory) if f.default_factory is not dataclasses.MISSING
                else dataclasses.field(default=f.default))
        help_arg = tyro.conf.arg(help=clean_doc(docs.get(f.name, "")))
        made.append((f.name, Annotated.__class_getitem__((tp, *extras, help_arg)), spec))
    out = dataclasses.make_dataclass(cls.__name__, made)
    out.__doc__ = clean_doc(cls.__doc__ or "") if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") \
        else None
    _MIRRORS[cls] = out
    return out


def _to_mirror(obj: Any) -> Any:
    mirror = _mirror(type(obj))
    return mirror(**{f.name: _to_mirror(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
                     for f in dataclasses.fields(obj)})


def _from_mirror(obj: Any, cls: type) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _from_mirror(getattr(obj, f.name), hints[f.name]) if dataclasses.is_dataclass(
        hints[f.name]) else getattr(obj, f.name) for f in dataclasses.fields(cls)})


# ------------------------------------------------------------------------- YAML / JSON onto dataclasses
def coerce(value: Any, tp: Any, name: str) -> Any:
    """A YAML / JSON value (or a command-line string) converted to the field type ``tp``; ConfigError naming the
    field otherwise."""
    def bad(expected: str) -> Exception:
        return _error(f"{name}: expected {expected}, got {_shown(value)}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return coerce(value, args[0], name)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        return coerce(value, next(a for a in args if a is not type(None)), name)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise _error(f"{name}: expected one of {list(args)}, got {_shown(value)}{did_you_mean(str(value), args)}")
    if origin is tuple:
        if isinstance(value, str):
            value = _split_list([value])
        if not isinstance(value, (list, tuple)):
            raise bad(type_name(tp))
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _error(f"{name}: expected {len(args)} values ({type_name(tp)}), got {_shown(value)}")
        return tuple(coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is list or origin is dict or tp is dict:
        kind = list if origin is list else dict
        if isinstance(value, str):
            try:
                value = _yaml(value, kind)
            except ValueError as e:
                raise _error(f"{name}: {e}") from None
        if not isinstance(value, (list, tuple) if kind is list else dict):
            raise bad("a list such as [{\"name\": \"sokoban\"}]" if kind is list else "a mapping such as {\"key\": 1}")
        if kind is dict:
            return dict(value)
        return [coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        with contextlib.suppress(ValueError, TypeError):
            if isinstance(value, str):
                return int(value)
        raise bad("int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        with contextlib.suppress(ValueError, TypeError):
            if isinstance(value, str):
                return float(value)
        raise bad("float")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("str")
    if tp is Any:
        return value
    raise _error(f"{name}: unsupported field type {tp!r}")


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
    if origin in (dict, list):
        return origin.__name__
    return getattr(tp, "__name__", str(tp))


def did_you_mean(name: str, choices: Any) -> str:
    """``"; did you mean a, b?"`` for the close matches of ``name`` among ``choices`` ('' when none)."""
    if len(name) > 200:  # no field or choice is this long; difflib would take quadratic time over it
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def ragen_hint(name: str, valid: Any, flag: bool) -> str:
    """``"; RAGEN's clip_ratio_low is --algorithm.eps_low"`` when `name` (an unknown setting) is RAGEN's spelling of
    fields among `valid` (the entry point's dotted field names; the port's table ``ragen_config.KEY_MAP``), or
    ``"; ... a RAGEN config"`` for a RAGEN top-level section; '' otherwise."""
    from .ragen_config import RAGEN_SECTIONS, ragen_equivalents

    key = name.lstrip("-")
    if "." not in key and key in RAGEN_SECTIONS:
        return (f"; {key!r} is a section of a RAGEN config: port it with python -m fastpo.ragen_config FILE "
                f"(it writes the fastpo config)")
    short, fields = ragen_equivalents(key)
    fields = [f for f in fields if f in valid]
    if not fields:
        return ""
    return f"; RAGEN's {short} is " + " or ".join(f"--{f}" if flag else f for f in fields)


def _ragen_hints(message: str, base: Any) -> str:
    """:func:`ragen_hint` for every flag of tyro's "Unrecognized options" line, among the fields of `base`."""
    m = re.search(r"Unrecognized options: ([^;]*)", message)
    if not m or not dataclasses.is_dataclass(base):
        return ""
    valid = {f"{s}.{f}" for s in _names(base) if dataclasses.is_dataclass(getattr(base, s))
             for f in _names(getattr(base, s))} | set(_names(base))
    return "".join(ragen_hint(flag, valid, flag=True) for flag in re.findall(r"--([\w.]+)", m.group(1)))


def merge(obj: Any, data: Any, source: str = "config", known: Callable[[str], bool] | None = None,
          prefix: str = "") -> Any:
    """Apply a nested ``{section: {field: value}}`` mapping (YAML / JSON) onto the dataclass ``obj`` in place and
    return it. A key ``obj`` lacks is an error (with close matches), unless ``known(dotted_name)`` says it is a
    setting of another entry point (then it is skipped: a run's config.json holds every trainer setting)."""
    if not isinstance(data, dict):
        if prefix:
            raise _error(f"{source}: section {prefix[:-1]!r} must be a mapping of fields, got {_shown(data)}")
        raise _error(f"{source}: expected a mapping of sections {_names(obj)}, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj), include_extras=True)
    fields = set(_names(obj))
    for key, value in data.items():
        key = getattr(obj, "_renamed", {}).get(key, key)  # a field's old name in an older run's config file
        dotted = f"{prefix}{key}"
        if key not in fields:
            if known is not None and known(dotted):
                continue
            raise _error(f"{source}: unknown {'field' if prefix else 'section'} {_shown(dotted)}"
                         f"{did_you_mean(dotted, [prefix + f for f in fields])}"
                         f"{ragen_hint(dotted, {prefix + f for f in fields}, flag=False)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            merge(current, value, source, known, f"{dotted}.")
        else:
            setattr(obj, key, coerce(value, hints[key], dotted))
    return obj


def _names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def load_file(path: str) -> dict[str, Any]:
    """A YAML (or JSON) config file as a mapping, read with ``fastpo.config_io.load_yaml`` (bounded depth and size);
    ConfigError naming the file when it cannot be read."""
    from .config_io import load_yaml

    try:
        with open(path) as f:
            data = load_yaml(f, f"--config: {path!r}")
    except OSError as e:
        raise _error(f"--config: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise _error(f"--config: {path!r} is not a text file (a YAML / JSON mapping of sections is "
                     f"expected)") from None
    except ValueError as e:
        raise _error(str(e)) from None
    return data or {}


# ----------------------------------------------------------------------------------------------- parsing
#: The top-level flag (beside --preset and --config) that lets a --config file's ``env.plugins`` be imported. A config
#: file is data that may come from someone else (a run folder's config.json is written by whoever ran it), and importing
#: a module runs its code; so modules it names are imported only when the user says so on the command line: with this
#: flag, or by naming them with ``--env.plugins``. It is not a config field: a file could otherwise set it itself.
TRUST_PLUGINS = "--trust_plugins"
TRUST_HELP = ("Env plug-ins (env.plugins) that a --config file names are imported only with --trust_plugins, or when "
              "--env.plugins names them on the command line: importing runs their code.")


def _takes_plugins(cls: type) -> bool:
    """Whether ``cls`` has an ``env`` section with a ``plugins`` field (the entry points that import plug-ins)."""
    env = next((f for f in dataclasses.fields(cls) if f.name == "env"), None) if dataclasses.is_dataclass(cls) else None
    if env is None:
        return False
    tp = typing.get_type_hints(cls).get("env")
    return dataclasses.is_dataclass(tp) and any(f.name == "plugins" for f in dataclasses.fields(tp))


def _take_switch(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    """Remove a bool switch (``--flag``, ``--flag true|false``, ``--flag=VALUE``; the last one wins) from argv."""
    value, rest, i = False, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag or arg.startswith(flag + "="):
            word = arg[len(flag) + 1:] if "=" in arg else None
            if word is None and i + 1 < len(argv) and argv[i + 1].lower() in _TRUE | _FALSE:
                word, i = argv[i + 1], i + 1
            if word is not None and word.lower() not in _TRUE | _FALSE:
                raise _error(f"{flag}: expected a bool (true/false) or nothing, got {word!r}")
            value = word is None or word.lower() in _TRUE
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _config_plugins(data: Any) -> list[str]:
    """The plug-in modules a loaded config file names in ``env.plugins`` (a list or a comma-separated str)."""
    env = data.get("env") if isinstance(data, dict) else None
    value = env.get("plugins") if isinstance(env, dict) else None
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)):
        return []
    return [str(m).strip() for m in value if str(m).strip()]


def _refuse_config_plugins(path: str, data: Any, argv: list[str]) -> None:
    """ConfigError (one line) when the file at ``path`` names plug-ins and neither --trust_plugins nor a command-line
    --env.plugins (which replaces the file's list) was given."""
    modules = _config_plugins(data)
    if not modules or any(a == "--env.plugins" or a.startswith("--env.plugins=") for a in argv):
        return
    names, them = ", ".join(repr(m) for m in modules), "them" if len(modules) > 1 else "it"
    raise _error(f"config file {path!r} names the env plug-in module{'s' if len(modules) > 1 else ''} {names} "
                 f"(env.plugins): not imported, since importing runs its code and a config file may come from anyone; "
                 f"name {them} on the command line (--env.plugins {','.join(modules)}) or pass {TRUST_PLUGINS} to "
                 f"import {them}")


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove ``--flag VALUE`` / ``--flag=VALUE`` (the last one wins) from argv; (value or None, the rest)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise _error(f"{flag} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
        else:
            rest.append(arg)
        i += 1
    return value, rest


_BOX = re.compile(r"^[\s│╭╮╰╯─|+\-]*$")


def _plain(text: str) -> str:
    """tyro's framed error message as plain text: its title, frames, rules, the argument's help and the pointer to
    --help dropped, the suggested flags kept on one line."""
    lines, skipping = [], False
    for raw in text.splitlines():
        line = raw.strip().strip("│|").strip()
        if not line or _BOX.match(line):
            skipping = False  # a rule ends the argument's help block
            continue
        if line.startswith("Argument helptext"):
            skipping = True
        if skipping or line.startswith("For full helptext"):
            continue
        lines.append(line)
    lines = list(dict.fromkeys(lines))
    if len(lines) > 1 and lines[0] in _TITLES:
        lines = lines[1:]
    lines = [_LONG_WORD.sub(_cut, _ERROR_PARSING.sub(r"\1: ", x)) for x in lines]
    for i, line in enumerate(lines):  # an invalid choice gets its close matches
        m = _INVALID_CHOICE.match(line)
        if m:
            lines[i] = line + did_you_mean(m["value"], re.findall(r"'([^']*)'", m["choices"]))
    if "Perhaps you meant:" in lines:  # the suggested flags only, not their help text
        at = lines.index("Perhaps you meant:")
        flags = [x.split()[0] for x in lines[at + 1:] if x.startswith("--")]
        lines = lines[:at] + ([f"did you mean {', '.join(dict.fromkeys(flags))}?"] if flags else [])
    return "; ".join(lines)


_ERROR_PARSING = re.compile(r"^Error parsing (--\S+): ")
#: A run of characters in tyro's message longer than any flag or choice: a value given on the command line.
_LONG_WORD = re.compile(r"\S{200,}")


def _cut(m: re.Match) -> str:
    """A long value in tyro's message cut to its start and end (the message stays one readable line)."""
    return f"{m.group(0)[:120]}...{m.group(0)[-20:]}"
_INVALID_CHOICE = re.compile(r"^invalid choice '(?P<value>[^']*)' for argument '(?P<flag>[^']*)'\. Expected one of "
                             r"(?P<choices>\(.*\))\.$")
#: The titles of tyro's error frames (the line under them says the same, more precisely).
_TITLES = frozenset({"Value error", "Invalid choice", "Unrecognized options", "Parsing error", "Required options",
                     "Missing required argument", "Unrecognized arguments"})


def parse(cls: type[T], argv: Sequence[str] | None = None, *, prog: str, description: str = "",
          presets: dict[str, Callable[[], T]] | None = None, default: T | None = None,
          known: Callable[[str], bool] | None = None) -> T:
    """Parse ``argv`` (``sys.argv[1:]`` when None) into ``cls``: ``default`` (or ``cls()``) < ``--preset NAME``
    (when ``presets`` is given) < ``--config FILE`` < flags. ``--help`` prints the help and exits 0; any bad input
    raises ConfigError with the message. Without tyro installed (a bare GPU image), :func:`_parse_plain` reads the
    same flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    base = default if default is not None else cls()
    if presets is not None:
        name, argv = _take(argv, "--preset")
        if name is not None:
            if name not in presets:
                raise _error(f"--preset: unknown preset {name!r}; choose from {sorted(presets)}"
                             f"{did_you_mean(name, presets)}")
            base = presets[name]()
    guarded = _takes_plugins(cls)
    trusted = False
    if guarded:  # other entry points leave the flag to the parser, which calls it unknown
        trusted, argv = _take_switch(argv, TRUST_PLUGINS)
        description = f"{description}\n\n{TRUST_HELP}" if description else TRUST_HELP
    path, argv = _take(argv, "--config")
    if path is not None:
        data = load_file(path)
        if guarded and not trusted:
            _refuse_config_plugins(path, data, argv)
        base = merge(base, data, source=path, known=known)
    try:
        import tyro
    except ModuleNotFoundError:
        return _parse_plain(cls, argv, base, prog, description)
    options = {"args": argv, "default": _to_mirror(base), "prog": prog, "description": description,
               "registry": _registry(), "config": (tyro.conf.FlagConversionOff,), "use_underscores": True}
    if "-h" in argv or "--help" in argv:  # to the terminal, wrapped to its width; exits 0
        tyro.cli(_mirror(cls), **options)
    out = io.StringIO()
    try:  # an error comes back unwrapped (a very wide "terminal") and without its frame, as ConfigError
        with _env("COLUMNS", "100000"), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            parsed = tyro.cli(_mirror(cls), **options)
    except SystemExit:
        message = _plain(out.getvalue()) or f"bad arguments: {argv}"
        raise _error(message + _ragen_hints(message, base)) from None
    return _from_mirror(parsed, cls)


def _parse_plain(cls: type[T], argv: list[str], base: T, prog: str, description: str) -> T:
    """The command line without tyro: ``--section.field VALUE`` or ``--section.field=VALUE`` (one value per flag;
    a list as ``a,b`` or ``[a, b]``; a bool flag alone means true), applied with :func:`merge`, so values are
    coerced and refused exactly as in a ``--config`` file. ``--help`` lists every field with its type and doc."""
    if "-h" in argv or "--help" in argv:
        print(f"usage: {prog} [--preset NAME] [--config FILE] [--section.field VALUE ...]\n\n{description}\n")
        for section in _names(base):
            obj, docs = getattr(base, section), field_docs(type(getattr(base, section)))
            hints = typing.get_type_hints(type(obj), include_extras=True)
            for name in _names(obj):
                print(f"  --{section}.{name} {type_name(hints[name])} (default {getattr(obj, name)!r}): "
                      f"{clean_doc(docs.get(name, ''))}")
        raise SystemExit(0)
    data: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise _error(f"unexpected argument {_shown(arg)}; flags are --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = "true"  # a bool flag given alone
        *sections, name = key.replace("-", "_").split(".")
        if not sections:
            raise _error(f"--{key}: flags are --section.field VALUE; sections: {_names(base)}"
                         f"{did_you_mean(key, _names(base))}")
        node = data
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = value
        i += 1
    return merge(base, data, source="command line")


def describe(*paragraphs: str, items: dict[str, str] | None = None, items_title: str = "") -> str:
    """A --help description: short paragraphs (tyro joins the lines of a paragraph and does not wrap it, so keep
    each under ~100 characters), then ``items`` (e.g. the presets), one indented line each."""
    text = "\n\n".join(clean_doc(p) for p in paragraphs if p)
    if items:
        pad = max(len(k) for k in items) + 2
        text += f"\n\n{items_title}\n" + "\n".join(f"  {k:<{pad}}{clean_doc(v)}" for k, v in items.items())
    return text


@contextlib.contextmanager
def _env(name: str, value: str):
    import os

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
