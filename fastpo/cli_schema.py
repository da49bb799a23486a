"""What the entry points' flags are and how --help shows them: field docstrings read from the source, a section
made of some of a class's fields (``subset``: eval and sft offer the trainer's flags they use, spelled the same),
and help descriptions. ``fastpo.cli`` parses with them.

    Section = subset(EnvConfig, "names", "kwargs", doc="...")           # a section with some of a class's fields
    description = describe("First paragraph.", items=PRESET_SUMMARIES, items_title="presets:")
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any

try:
    import tyro
except ModuleNotFoundError:  # no tyro (a bare GPU image): made sections carry no tyro markers
    tyro = None


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right below each field) of a dataclass, whitespace collapsed; fields of
    a class made by :func:`subset` carry theirs in ``__fastpo_docs__``."""
    made = getattr(cls, "__fastpo_docs__", None)
    if made is not None:
        return dict(made)
    import ast
    import inspect

    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {node.target.id: " ".join(nxt.value.value.split()) for node, nxt in zip(body, body[1:], strict=False)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}


def subset(cls: type, *names: str, doc: str | None = None, defaults: dict[str, Any] | None = None,
           docs: dict[str, str] | None = None, name: str | None = None) -> type:
    """A dataclass with the fields ``names`` of dataclass ``cls``: the same names, types, defaults (``defaults``
    replaces some) and documentation (``docs`` replaces some, where the entry point uses a field differently), so
    an entry point that uses part of a config section offers exactly those flags, spelled as the trainer's."""
    docs, hints = {**field_docs(cls), **(docs or {})}, typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    defaults = dict(defaults or {})
    if [n for n in names if n not in by_name] or set(defaults) - set(names):
        raise ValueError(f"subset({cls.__name__}): fields {list(names)} and defaults {sorted(defaults)} must be "
                         f"among its fields {list(by_name)}")
    made = []
    for n in names:
        f = by_name[n]
        if n in defaults:  # a mutable default is copied for every instance
            spec = dataclasses.field(default_factory=lambda v=defaults[n]: json.loads(json.dumps(v)))
        elif f.default_factory is not dataclasses.MISSING:
            spec = dataclasses.field(default_factory=f.default_factory)
        else:
            spec = dataclasses.field(default=f.default)
        helped = Annotated[hints[n], tyro.conf.arg(help=clean_doc(docs.get(n, "")))] if tyro else hints[n]
        made.append((n, helped, spec))  # a made class has no source: tyro gets the help explicitly
    out = dataclasses.make_dataclass(name or cls.__name__, made)
    out.__doc__ = doc if doc is not None else cls.__doc__
    out.__fastpo_docs__ = {n: docs.get(n, "") for n in names}
    return out


def clean_doc(text: str) -> str:
    """A docstring as help text: whitespace collapsed, reST markup (````code````) dropped."""
    return " ".join(text.split()).replace("``", "")


def describe(*paragraphs: str, items: dict[str, str] | None = None, items_title: str = "") -> str:
    """A --help description: short paragraphs (tyro joins the lines of a paragraph and does not wrap it, so keep
    each under ~100 characters), then ``items`` (e.g. the presets), one indented line each."""
    text = "\n\n".join(clean_doc(p) for p in paragraphs if p)
    if items:
        pad = max(len(k) for k in items) + 2
        text += f"\n\n{items_title}\n" + "\n".join(f"  {k:<{pad}}{clean_doc(v)}" for k, v in items.items())
    return text
