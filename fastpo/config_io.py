"""Config text (YAML / JSON) read with bounds: the one place every entry point (train, eval, sft, ragen_config,
tiny_agent, report) reads a ``--config`` file, a mapping given on the command line or a run's ``config.json``.
Values quoted in error messages are cut to a bounded length by ``fastpo.config.shown``.

    data = load_yaml(text_or_file, "--config 'my.yaml'")   # ValueError (one line) for bad, too deep or too big input
    data = load_json(text, "'runs/x/config.json'")
    data = load_yaml_file(path, f"--config file {path!r}", "a YAML / JSON mapping of sections")

Why: YAML aliases let a 1 KB file stand for a structure of 10^9 nodes ("billion laughs"): loading it is cheap (the
aliases are shared references), but every later walk of it (a type check, a deep copy, the ``repr`` in an error
message) expands it, which took minutes and printed hundreds of MB. Very deep nesting (``[[[[...]]]]``) exhausts
Python's recursion limit in the YAML composer, the JSON decoder and every recursive walk after them. Both are
refused while the text is read: at most :data:`MAX_DEPTH` levels and :data:`MAX_NODES` nodes, counted with every
alias expanded. A real config is a few levels deep and has hundreds of nodes.
"""

from __future__ import annotations

import functools
import json
import os
from typing import IO, Any

from .config import shown_text

#: Deepest nesting of mappings / lists accepted (a fastpo config is at most ~5 deep: section, field, env.train
#: entry, its kwargs, a value list).
MAX_DEPTH = 32
#: Most nodes (scalars, lists, mappings; each alias counted as the nodes it stands for) in one document.
MAX_NODES = 100_000


@functools.cache
def _loader_class():
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        """yaml.SafeLoader that counts nesting depth and the expanded size of every node while it composes them
        (before any Python object is built), so a bomb or a deep document stops at the first node past a bound."""

        def __init__(self, stream: Any):
            super().__init__(stream)
            self._depth = 0
            self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to; set once the node is complete

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):  # a node composed before (its size known) or one still open
                event = self.peek_event()
                target = self.anchors.get(event.anchor)
                if target is not None and id(target) not in self._sizes:
                    raise _Refused(f"has a recursive alias (a list or mapping that contains itself){_where(event)}")
                return super().compose_node(parent, index)
            self._depth += 1
            try:
                if self._depth > MAX_DEPTH:
                    raise _Refused(f"nests deeper than {MAX_DEPTH} levels{_where(self.peek_event())}{_TYPICAL}")
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            self._sizes[id(node)] = size = self._expanded(node)
            if size > MAX_NODES:
                raise _Refused(f"expands to more than {MAX_NODES} values (YAML aliases repeat what they point to)"
                               f"{_where(node)}{_TYPICAL}")
            return node

        def _expanded(self, node: Any) -> int:
            if isinstance(node, yaml.ScalarNode):
                return 1
            children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                        else list(node.value))
            return 1 + sum(self._sizes[id(child)] for child in children)  # each composed (and sized) already

    return BoundedSafeLoader


_TYPICAL = f"; a config is a few levels deep and at most {MAX_NODES} values"


class _Refused(Exception):
    """Raised inside the loader; :func:`load_yaml` turns it into a ValueError naming the source."""


def _where(mark_holder: Any) -> str:
    mark = getattr(mark_holder, "start_mark", None)
    return f" (line {mark.line + 1})" if mark is not None else ""


def load_yaml(source: str | IO[str], what: str) -> Any:
    """The YAML (or JSON) document in `source` (text or a text stream) as Python data, read with yaml's safe loader.

    Raises:
        ValueError: one line starting with `what`: not valid YAML, nested deeper than :data:`MAX_DEPTH`, more than
            :data:`MAX_NODES` nodes with aliases expanded, or an alias to itself. UnicodeDecodeError from a binary
            stream passes through (the caller names the file).
    """
    import yaml

    loader = None
    try:
        loader = _loader_class()(source)  # reads the first chunk already (a control character fails here)
        return loader.get_single_data()
    except _Refused as err:
        raise ValueError(f"{what} {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{what} is not valid YAML: {shown_text(' '.join(str(err).split()))}") from None
    except RecursionError:  # a bound above not reached first: never a traceback
        raise ValueError(f"{what} nests too deeply to read") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml_file(path: str | os.PathLike, what: str, expected: str) -> Any:
    """The YAML (or JSON) document in the file at `path`, read as a stream with :func:`load_yaml`.

    Args:
        what: how messages name the file (``"--config file 'my.yaml'"``, ``"RAGEN config 'x.yaml'"``).
        expected: what the file should hold, for a binary file's message (``"a RAGEN YAML"``).
    Raises:
        ValueError: one line naming the file: it cannot be read (the OS's reason), it is not text, or
            :func:`load_yaml`'s refusals.
    """
    try:
        with open(path) as f:
            return load_yaml(f, what)
    except OSError as e:
        raise ValueError(f"cannot read {what}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not a text file ({expected} is expected)") from None


def load_json(text: str | bytes, what: str) -> Any:
    """``json.loads(text)`` with the same bounds as :func:`load_yaml` (JSON has no aliases: depth and size only).
    Non-finite floats (``Infinity``, ``NaN``, written by ``fastpo.config.to_json``) are accepted.

    Raises:
        ValueError: one line starting with `what`: not valid JSON, too deep or too big.
    """
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, and bytes that are not UTF-8
        raise ValueError(f"{what} is not valid JSON: {shown_text(str(err))}") from None
    problem = shape_problem(data)
    if problem:
        raise ValueError(f"{what} {problem}")
    return data


def shape_problem(data: Any) -> str | None:
    """Why `data` (plain lists / dicts / scalars) is past :data:`MAX_DEPTH` or :data:`MAX_NODES` ('nests deeper
    than ...'), or None. Walks at most MAX_NODES + 1 nodes, without recursion."""
    stack, count = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            return f"holds more than {MAX_NODES} values"
        if isinstance(value, (dict, list, tuple)):
            if depth > MAX_DEPTH:
                return f"nests deeper than {MAX_DEPTH} levels"
            items = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
            stack.extend((x, depth + 1) for x in items)
    return None
