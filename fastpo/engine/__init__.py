"""Generation engines: ``HFEngine`` (built in, transformers) and ``VLLMEngine`` (in-process vLLM); both
implement ``Engine``.

``fastpo.engine.base`` imports neither torch nor transformers; the engines are imported on first use (vLLM is
optional: ``VLLMEngine`` fails with a clear ImportError when it is not installed).
"""

from __future__ import annotations

from typing import Any

from .base import Engine, GenerationResult, SamplingParams

__all__ = ["Engine", "GenerationResult", "HFEngine", "SamplingParams", "VLLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "HFEngine":
        from .hf import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from .vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
