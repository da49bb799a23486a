"""fastpo.kernels: per-token logprobs, PPO / value losses and advantage estimators for LLM RL.

Triton kernels on CUDA tensors, chunked plain torch (``reference.py``) on CPU ones; ``FASTPO_KERNELS=triton|torch``
forces a backend. Importing this package needs only torch: triton is imported on first use of the Triton path.
See docs/KERNELS.md for the API, drop-in use in TRL / a plain PyTorch loop, and benchmark figures.
"""

if __name__ != "fastpo.kernels":
    # Imported as a top-level ``kernels`` because a checkout's root is on sys.path (``python -m ...`` run from
    # the repository). That name belongs to Hugging Face's ``kernels`` package, which transformers probes by
    # importing it; this folder must then stay inert (no custom ops registered a second time) and report a
    # version no consumer accepts, so the probe concludes the package is absent.
    __version__ = "0"
    __all__: list[str] = []
else:
    from .functional import (
        bilevel_gae_advantages,
        fused_linear_logprob,
        gae_advantages,
        gigpo_advantages,
        grpo_advantages,
        ppo_loss,
        selective_logprob,
        value_loss,
    )
    from .modules import FastPOFusedLinearGRPOLoss, FastPOGRPOLoss

    __all__ = [
        "selective_logprob",
        "fused_linear_logprob",
        "ppo_loss",
        "value_loss",
        "gae_advantages",
        "bilevel_gae_advantages",
        "grpo_advantages",
        "gigpo_advantages",
        "FastPOFusedLinearGRPOLoss",
        "FastPOGRPOLoss",
    ]
