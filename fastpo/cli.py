"""One command line for every entry point: nested dataclass configs parsed by tyro, the same flag for the same
setting everywhere (``--model.path``, ``--env.kwargs``, ``--rollout.enable_think`` ...).

    cfg = parse(Config, argv, prog="fastpo-train", presets=PRESETS)     # train: --preset < --config < flags
    args = parse(EvalArgs, argv, prog="fastpo-eval")                    # eval: --config < flags

Precedence: the dataclass defaults < ``--preset NAME`` < ``--config FILE`` (YAML / JSON ``section: {field: value}``;
a run's ``config.json`` works for every entry point) < ``--section.field VALUE`` flags. tyro builds the flags, the
``--help`` (from the attribute docstrings) and the choices of ``Literal`` fields; its parse-error hook hands each
failure over as data, which becomes one ConfigError line with close matches. Every other value goes through
:func:`fastpo.config_values.coerce`, the converter ``--config`` files use, so both take the same spellings. Without
tyro (a bare GPU image) :func:`_parse_plain` reads the same flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from . import config_values as values  # fastpo.config reads coerce, merge, type_name, did_you_mean through this module
from .cli_schema import clean_doc, field_docs
from .config_values import coerce, did_you_mean, error, field_names, load_file, merge, ragen_hint, type_name

try:
    import tyro
    from tyro.conf import Positional
except ModuleNotFoundError:  # no tyro (a bare GPU image): the plain parser reads the flags, the marker is a no-op
    tyro = None

    class Positional:  # noqa: D101 - stands in for tyro.conf.Positional[T]
        def __class_getitem__(cls, tp: Any) -> Any:
            return tp

T = TypeVar("T")

#: The top-level flag (beside --preset and --config) that lets a --config file's ``env.plugins`` be imported. A config
#: file is data that may come from someone else (a run folder's config.json is written by whoever ran it), and importing
#: a module runs its code; so modules it names are imported only when the user says so on the command line: with this
#: flag, or by naming them with ``--env.plugins``. It is not a config field: a file could otherwise set it itself.
TRUST_PLUGINS = "--trust_plugins"
TRUST_HELP = ("Env plug-ins (env.plugins) that a --config file names are imported only with --trust_plugins, or when "
              "--env.plugins names them on the command line: importing runs their code.")


# ------------------------------------------------------------------------------- --preset, --config, trust
def _take(argv: list[str], flag: str, switch: bool = False) -> tuple[Any, list[str]]:
    """Remove ``--flag VALUE`` / ``--flag=VALUE`` (the last one wins) from argv: (the value or None, the rest). A
    ``switch`` is a bool, given as the bare flag or followed by ``true`` / ``false``: (its value, the rest)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        arg, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if arg == flag and switch:  # the bare switch, or the switch and a bool word
            taken = nxt is not None and nxt.lower() in values.TRUE | values.FALSE
            value, i = nxt if taken else "true", i + taken
        elif arg == flag:
            if nxt is None or nxt.startswith("--"):
                raise error(f"{flag} needs a value")
            value, i = nxt, i + 1
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
        else:
            rest.append(arg)
        i += 1
    return coerce("false" if value is None else value, bool, flag) if switch else value, rest


def _takes_plugins(cls: type) -> bool:
    """Whether ``cls`` has an ``env`` section with a ``plugins`` field (the entry points that import plug-ins)."""
    return dataclasses.is_dataclass(cls) and "env.plugins" in field_names(cls)


def _refuse_config_plugins(path: str, data: Any, argv: list[str]) -> None:
    """ConfigError (one line) when the file at ``path`` names plug-ins in ``env.plugins`` (a list or a comma-separated
    str) and no command-line --env.plugins (which replaces the file's list) was given."""
    env = data.get("env") if isinstance(data, dict) else None
    value = env.get("plugins") if isinstance(env, dict) else None
    modules = [str(m).strip() for m in (value.split(",") if isinstance(value, str) else value)
               if str(m).strip()] if isinstance(value, (str, list, tuple)) else []
    if not modules or any(a == "--env.plugins" or a.startswith("--env.plugins=") for a in argv):
        return
    names, them = ", ".join(repr(m) for m in modules), "them" if len(modules) > 1 else "it"
    raise error(f"config file {path!r} names the env plug-in module{'s' if len(modules) > 1 else ''} {names} "
                f"(env.plugins): not imported, since importing runs its code and a config file may come from anyone; "
                f"name {them} on the command line (--env.plugins {','.join(modules)}) or pass {TRUST_PLUGINS} to "
                f"import {them}")


# ----------------------------------------------------------------------------------------------- parsing
def parse(cls: type[T], argv: Sequence[str] | None = None, *, prog: str, description: str = "",
          presets: dict[str, Callable[[], T]] | None = None, default: T | None = None,
          known: Callable[[str], bool] | None = None) -> T:
    """Parse ``argv`` (``sys.argv[1:]`` when None) into ``cls``: ``default`` (or ``cls()``) < ``--preset NAME``
    (when ``presets`` is given) < ``--config FILE`` (``known``: the file's keys of other entry points, skipped) <
    flags. ``--help`` prints the help and exits 0; any bad input raises ConfigError with a one-line message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    base = default if default is not None else cls()
    if presets is not None:
        name, argv = _take(argv, "--preset")
        if name is not None and name not in presets:
            raise error(f"--preset: unknown preset {name!r}; choose from {sorted(presets)}"
                        f"{did_you_mean(name, presets)}")
        base = presets[name]() if name is not None else base
    guarded, trusted = _takes_plugins(cls), False
    if guarded:  # other entry points leave the flag to the parser, which calls it unknown
        trusted, argv = _take(argv, TRUST_PLUGINS, switch=True)
        description = f"{description}\n\n{TRUST_HELP}" if description else TRUST_HELP
    path, argv = _take(argv, "--config")
    if path is not None:
        data = load_file(path)
        if guarded and not trusted:
            _refuse_config_plugins(path, data, argv)
        base = merge(base, data, source=path, known=known)
    if tyro is None:
        return _parse_plain(cls, argv, base, prog, description)
    options = {"args": argv, "default": base, "prog": prog, "description": description, "registry": _registry(),
               "config": (tyro.conf.FlagConversionOff,), "use_underscores": True}
    if "-h" in argv or "--help" in argv:  # to the terminal, wrapped to its width; exits 0
        return tyro.cli(cls, **options)
    captured = io.StringIO()  # tyro's own text, for a failure the hook does not know
    errors = getattr(tyro, "_errors", None)  # the hook is private in tyro 1.0 (requirements pin the version)
    try:
        with errors.on_parse_error(_one_line(base)) if errors else contextlib.nullcontext(), \
                contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            return tyro.cli(cls, **options)
    except SystemExit:
        text = " ".join(re.sub(r"-{4,}|[│╭╮╰╯─]", " ", captured.getvalue()).split())  # its frame and rules dropped
        raise error(text or f"bad arguments: {argv}") from None


def _registry() -> Any:
    """tyro's constructor registry with one rule: a bool, number, tuple, list or mapping field is read by
    :func:`coerce` (so a flag takes exactly the spellings a ``--config`` file does); str and Literal stay tyro's."""
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec

    registry = ConstructorRegistry()

    @registry.primitive_rule
    def _coerced(info: Any) -> Any:
        tp, origin = info.type, info.type_origin
        if tp not in (bool, int, float, dict) and origin not in (tuple, list, dict):
            return None
        kinds = [type_name(a).upper() for a in typing.get_args(tp) if a is not Ellipsis]
        metavar = {bool: "{true,false}", int: "INT", float: "FLOAT"}.get(tp) or (
            "/".join(dict.fromkeys(kinds)) + ",..." if origin is tuple else "YAML")
        return PrimitiveConstructorSpec(  # the bare bool flag is true; a tuple may come as several words
            nargs="*" if tp is bool or origin is tuple else 1, metavar=metavar,
            instance_from_str=lambda a: coerce(",".join(a) if origin is tuple else " ".join(a) or "true", tp, ""),
            is_instance=lambda x: _is(x, tp), str_from_instance=lambda x: _words(x, tp))

    return registry


def _is(value: Any, tp: Any) -> bool:
    """Whether `value` already is a `tp` (coerce gives it back unchanged)."""
    with contextlib.suppress(ValueError):
        return not isinstance(value, str) and coerce(value, tp, "") == value
    return False


def _words(value: Any, tp: Any) -> list[str]:
    """A value as the command-line words that give it back (the defaults in --help)."""
    if tp is bool:
        return [str(value).lower()]
    if isinstance(value, tuple):
        return [",".join(map(str, value))] if value else []
    return [json.dumps(value) if isinstance(value, (list, dict)) else str(value)]


def _one_line(base: Any) -> Callable[[Any], None]:
    """tyro's parse-error hook for ``base``'s flags: the failures a user makes become one ConfigError line (the flag,
    the value, what is accepted, close matches; an unknown flag spelled RAGEN's way names ours, a field's old name
    its new one)."""
    names = field_names(base)
    flags = ["--" + n for n in names if not any(m.startswith(n + ".") for m in names)]  # fields, not sections

    def hook(event: Any) -> None:
        errors, flag = tyro._errors, lambda arg: "/".join(arg.lowered.name_or_flags)
        if isinstance(event, errors.UnrecognizedArgs):
            given = [t.split("=")[0] for t in event.tokens if t.startswith("--")]
            hints = [did_you_mean(f, flags, cutoff=0.8) for f in given]
            hints += [ragen_hint(f, {f[2:] for f in flags}, flag=True) for f in given]
            hints += [values.renamed_hint(f, base, flag=True) for f in given]  # a field's old name: its new one
            raise error(f"Unrecognized options: {', '.join(map(_cut, event.tokens))}{''.join(hints)}")
        if isinstance(event, errors.InvalidChoice):
            raise error(f"invalid choice {_cut(event.value)!r} for argument {flag(event.argument)!r}. Expected one of "
                        f"{event.choices}{did_you_mean(event.value, event.choices)}")
        if isinstance(event, errors.BadValue) and event.reason == "too_few_values":
            raise error(f"Missing value for argument {flag(event.argument)!r}. Expected {event.argument.lowered.nargs} "
                        f"value(s).")
        if isinstance(event, errors.InstantiationFailure):
            where = "" if event.argument is None else flag(event.argument) + ("" if event.message[:1] == "[" else ": ")
            raise error(where + event.message)  # coerce's message; "[i]" starts one about an item of a tuple

    return hook


def _cut(text: str) -> str:
    """A long word in a message cut to its start and end (the message stays one readable line)."""
    return text if len(text) < 200 else f"{text[:120]}...{text[-20:]}"


def _parse_plain(cls: type[T], argv: list[str], base: T, prog: str, description: str) -> T:
    """The command line without tyro: ``--section.field VALUE`` or ``--section.field=VALUE`` (one value per flag;
    a list as ``a,b`` or ``[a, b]``; a bool flag alone means true), applied with :func:`merge`, so values are
    coerced and refused exactly as in a ``--config`` file. ``--help`` lists every field with its type and doc."""
    sections = [f.name for f in dataclasses.fields(base)]
    if "-h" in argv or "--help" in argv:
        print(f"usage: {prog} [--preset NAME] [--config FILE] [--section.field VALUE ...]\n\n{description}\n")
        for section in sections:
            obj = getattr(base, section)
            docs, hints = field_docs(type(obj)), typing.get_type_hints(type(obj))
            for f in dataclasses.fields(obj):
                print(f"  --{section}.{f.name} {type_name(hints[f.name])} (default {getattr(obj, f.name)!r}): "
                      f"{clean_doc(docs.get(f.name, ''))}")
        raise SystemExit(0)
    data: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise error(f"unexpected argument {_cut(arg)!r}; flags are --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            value, i = (argv[i + 1], i + 1) if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ("true", i)
        *path, name = key.replace("-", "_").split(".")
        if not path:
            raise error(f"--{key}: flags are --section.field VALUE; sections: {sections}{did_you_mean(key, sections)}")
        old = values.renamed_hint(key.replace("-", "_"), base, flag=True)
        if old:  # merge reads a field's old name (older config files); on the command line it is refused, as tyro does
            raise error(f"Unrecognized options: --{key}{old}")
        node = data
        for part in path:
            node = node.setdefault(part, {})
        node[name] = value
        i += 1
    return merge(base, data, source="command line")
