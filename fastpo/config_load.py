"""A trainer Config from its sources: the command line, a JSON text (a run's config.json), a nested mapping.

    cfg = parse_args(["--preset", "sokoban", "--config", "my.yaml", "--algorithm.eps_high", "0.3"])
    cfg = from_json(to_json(cfg))          # to_json: fastpo.config
    merge(cfg, {"algorithm": {"eps_high": 0.3}})

Precedence: dataclass defaults (RAGEN's StarPO-S Sokoban setting) < ``--preset NAME`` < ``--config file.yaml``
(nested ``section: {field: value}``) < ``--section.field value`` flags (``fastpo.cli``, shared by every entry
point). Values are converted to each field's type and refused with a ConfigError naming the field; the checks of
the values themselves are ``fastpo.preflight.validate``.
"""

from __future__ import annotations

from typing import Any

from . import cli
from .cli_schema import describe
from .config import Config
from .config_io import load_json
from .presets import PRESETS

#: The paragraphs of ``python -m fastpo.train --help`` above the presets and the fields.
DESCRIPTION = ("Train an LLM agent with StarPO / StarPO-S (multi-turn PPO, GRPO or GiGPO).",
               "Exit status: 0 = trained, 1 = the run stopped itself, 2 = bad input (refused before a model loads).",
               "Settings: --preset NAME < --config FILE.yaml < --section.field VALUE flags (later wins).")


def parse_args(argv: list[str] | None = None, prog: str = "python -m fastpo.train") -> Config:
    """A Config from command-line arguments (``sys.argv[1:]`` when None): defaults < ``--preset`` < ``--config``
    < ``--section.field`` flags (``fastpo.cli``). ``--help`` prints every field and exits 0; bad input raises
    ConfigError."""
    summaries = {n: (fn.__doc__ or "").split(". ")[0].split(":")[0] for n, fn in PRESETS.items()}
    description = describe(*DESCRIPTION, items=summaries, items_title="presets:")
    return cli.parse(Config, argv, prog=prog, description=description, presets=PRESETS)


def merge(cfg: Config, data: dict[str, Any], source: str = "config") -> Config:
    """Apply a nested ``{section: {field: value}}`` mapping (YAML / JSON) onto cfg in place; returns cfg."""
    return cli.merge(cfg, data, source)


def from_json(text: str) -> Config:
    """Inverse of ``fastpo.config.to_json``; missing fields keep their defaults, unknown fields raise ConfigError
    (bad, too deep or too big JSON: ValueError, ``config_io.load_json``)."""
    return merge(Config(), load_json(text, "json"), source="json")
