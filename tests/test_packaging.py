"""Packaging rules that a checkout can break: the folders kernels/ and envs/ are only fastpo.kernels and
fastpo.envs, even when the repository root is on sys.path (``python -m`` run from the checkout)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_import_fastpo_kernels_needs_no_transformers():
    out = _run("import sys, fastpo.kernels; print('transformers' in sys.modules, 'vllm' in sys.modules)")
    assert out.split() == ["False", "False"]


@pytest.mark.slow
def test_top_level_kernels_from_the_checkout_is_inert():
    # transformers probes Hugging Face's `kernels` package by importing it; from the repository root that
    # import finds our folder, which must neither register the custom ops twice nor look like a usable install.
    code = (
        "import torch, kernels, fastpo.kernels as fk\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert kernels.__all__ == [] and not is_kernels_available()\n"
        "torch.use_deterministic_algorithms(True)\n"
        "h = torch.randn(5, 8, requires_grad=True); w = torch.randn(11, 8, requires_grad=True)\n"
        "ids = torch.randint(0, 11, (5,))\n"
        "logp = fk.fused_linear_logprob(h, w, ids); logp.sum().backward()\n"
        "ref = torch.log_softmax(h @ w.T, -1).gather(-1, ids[:, None]).squeeze(-1)\n"
        "assert torch.allclose(logp, ref, atol=1e-5); print('ok')\n"
    )
    assert _run(code).strip() == "ok"
