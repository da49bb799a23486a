"""Generation engines: ``HFEngine`` (built in, transformers) and, later, the vLLM engine; both implement ``Engine``.

``fastpo.engine.base`` imports neither torch nor transformers; ``HFEngine`` is imported on first use.
"""

from __future__ import annotations

from typing import Any

from .base import Engine, GenerationResult, SamplingParams

__all__ = ["Engine", "GenerationResult", "HFEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "HFEngine":
        from .hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
