"""Shared fixtures for the kernel tests: the device under test and a backend switch (FASTPO_KERNELS).

CPU by default (Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set by tests/conftest.py).
With FASTPO_TEST_GPU=1 and a CUDA device the same tests run on CUDA tensors with compiled Triton kernels; fp32
dots then run exact (FASTPO_KERNELS_FP32=ieee, unless set otherwise), since the tests compare fp32 inputs with
fp64 truth at fp32 tolerances, which the default TF32 tensor-core path does not meet (it has its own test)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

ON_GPU = os.environ.get("FASTPO_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if ON_GPU:
    os.environ.setdefault("FASTPO_KERNELS_FP32", "ieee")
BACKENDS = ["torch", "triton"]


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Runs the test once per backend, with FASTPO_KERNELS forcing it."""
    monkeypatch.setenv("FASTPO_KERNELS", request.param)
    return request.param


#: fused_linear_logprob's backends: torch, then the Triton path with each of its kernels (FASTPO_FLP_KERNEL):
#: the tiled ones, the persistent ones with pointer loads, the persistent ones with TMA descriptors.
FUSED_BACKENDS = ["torch", "triton", "triton-persistent-ptr", "triton-persistent-tma"]


@pytest.fixture(params=FUSED_BACKENDS)
def fused_backend(request, monkeypatch):
    """The ``backend`` fixture for tests of fused_linear_logprob, once per Triton kernel variant. The interpreter
    emulates TMA descriptors, so on CPU tensors the TMA variant forces them on by patching the capability check
    (on a GPU run it is the real check: TMA on sm_90+, pointers on sm_80)."""
    kind = request.param
    monkeypatch.setenv("FASTPO_KERNELS", "torch" if kind == "torch" else "triton")
    if kind.startswith("triton-persistent"):
        monkeypatch.setenv("FASTPO_FLP_KERNEL", kind.removeprefix("triton-").replace("-tma", ""))
        if kind.endswith("-tma") and not ON_GPU:
            from fastpo.kernels.ops import flp_persistent

            monkeypatch.setattr(flp_persistent, "tma_supported", lambda *tensors: True)
    else:
        monkeypatch.delenv("FASTPO_FLP_KERNEL", raising=False)
    return kind


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
