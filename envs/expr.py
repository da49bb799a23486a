"""A safe arithmetic evaluator for model-written equations (Countdown). Never ``eval``/``exec``.

Grammar (recursive descent; ASCII only, whitespace ignored)::

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | NUMBER | "(" expr ")"
    NUMBER := [0-9]+ ("." [0-9]+)?

Anything else (letters, ``**``, ``//``, ``=``, unicode digits or operators such as ``×`` ``÷`` ``−``)
is malformed. Input longer than ``max_len`` characters or nested (parentheses and unary signs)
deeper than ``max_depth`` is rejected before any work, so the cost is linear in the input and the
recursion is bounded. Values are exact ``Fraction``s.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_LEN = 512
MAX_DEPTH = 32

_TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]+)?)|([-+*/()]))", re.ASCII)

# A parsed expression: ("num", Fraction, literal text) | ("neg", node) | (op, left, right) with op in "+-*/".
Node = tuple


class ExprError(ValueError):
    """The text is not a well-formed arithmetic expression (or is too long / too deep)."""


def tokenize(text: str, max_len: int = MAX_LEN) -> list[str]:
    if not isinstance(text, str):
        raise ExprError(f"expected a str, got {type(text).__name__}")
    if len(text) > max_len:
        raise ExprError(f"expression longer than {max_len} characters ({len(text)})")
    tokens, pos, end = [], 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ExprError(f"unexpected character {text[pos:].lstrip()[:1]!r} at {pos}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        raise ExprError("empty expression")
    return tokens


def parse(text: str, max_len: int = MAX_LEN, max_depth: int = MAX_DEPTH) -> Node:
    """Parse ``text`` into a tree; raises ExprError when it is malformed, too long or too deep."""
    tokens = tokenize(text, max_len)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def expr(depth: int) -> Node:
        nonlocal pos
        node = term(depth)
        while peek() in ("+", "-"):
            op = tokens[pos]
            pos += 1
            node = (op, node, term(depth))
        return node

    def term(depth: int) -> Node:
        nonlocal pos
        node = factor(depth)
        while peek() in ("*", "/"):
            op = tokens[pos]
            pos += 1
            node = (op, node, factor(depth))
        return node

    def factor(depth: int) -> Node:
        nonlocal pos
        if depth > max_depth:
            raise ExprError(f"expression nested deeper than {max_depth}")
        tok = peek()
        if tok is None:
            raise ExprError("expression ends early")
        pos += 1
        if tok in ("+", "-"):
            inner = factor(depth + 1)
            return ("neg", inner) if tok == "-" else inner
        if tok == "(":
            node = expr(depth + 1)
            if peek() != ")":
                raise ExprError("missing ')'")
            pos += 1
            return node
        if tok[0].isdigit():
            try:
                value = Fraction(tok)
            except ValueError:  # longer than the interpreter's int <-> str digit limit (sys.set_int_max_str_digits)
                raise ExprError(f"number of {len(tok)} characters is too long to convert") from None
            return ("num", value, tok)
        raise ExprError(f"unexpected {tok!r}")

    tree = expr(0)
    if pos != len(tokens):
        raise ExprError(f"unexpected {tokens[pos]!r} after a complete expression")
    return tree


def literals(tree: Node) -> list[str]:
    """The number literals of ``tree`` as written, left to right."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if node[0] == "num":
            out.append(node[2])
        else:
            stack.extend(reversed(node[1:]))
    return out


def evaluate(tree: Node) -> Fraction:
    """Exact value of ``tree`` (iterative: no recursion limit); raises ZeroDivisionError on division by zero."""
    values: list[Fraction] = []
    stack: list[tuple[Node, bool]] = [(tree, False)]
    while stack:
        node, children_done = stack.pop()
        kind = node[0]
        if kind == "num":
            values.append(node[1])
        elif not children_done:
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(node[1:]))
        elif kind == "neg":
            values.append(-values.pop())
        else:
            b, a = values.pop(), values.pop()
            values.append(_BINARY[kind](a, b))
    return values[0]


_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,  # Fraction division raises ZeroDivisionError for b == 0
}
