"""The config's error type and the bounded text of values quoted in error messages (a value echoed in an error is
cut to a bounded length, whatever its size). A leaf: standard library only."""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A bad config value, unknown field or failed cross-field check; the message names the field(s)."""


# ------------------------------------------------------------------------------------ values in messages
#: Characters of a value echoed in an error message, at most (about: reprlib's "..." markers included).
SHOWN_LIMIT = 200


class _BoundedRepr(reprlib.Repr):
    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 8, 8, 8
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 8
        self.maxstring = self.maxother = self.maxlong = limit

    def repr_dict(self, x: dict, level: int) -> str:
        # in insertion order, as repr() (reprlib sorts the keys)
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past 4300 digits raises ValueError (sys.set_int_max_str_digits): say its size instead
        if x.bit_length() > 4000:
            return f"<an int of about {int(x.bit_length() * 0.30103)} digits>"
        return super().repr_int(x, level)


def shown(value: Any, limit: int = SHOWN_LIMIT) -> str:
    """``repr(value)`` for an error message, at most about `limit` characters whatever `value` is (a huge string,
    a deep or aliased structure, a 10^5-digit int): long strings keep their start and end, long lists / mappings
    their first items, deep ones their first levels (``...`` marks what was left out). Short values read exactly as
    ``repr``. Costs O(limit), never a walk of the whole value. It lives beside :class:`ConfigError` because every
    message of one quotes values this way."""
    text = _BoundedRepr(limit).repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_text(text: str, limit: int = SHOWN_LIMIT) -> str:
    """`text` itself (no quotes) cut to about `limit` characters, for messages that quote a parser's own text."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failed(checks: Iterable[tuple[bool, str]]) -> list[str]:
    """The messages of the ``(ok, message)`` pairs that are not ok, in order: the form of every ``check()`` here
    (and of fastpo.sft's and fastpo.tiny_agent's argument checks)."""
    return [message for ok, message in checks if not ok]
