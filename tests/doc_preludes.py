"""What the documented Python examples assume the reader already has (tests/test_docs_commands.py).

A doc block marked ``<!-- test: python NAME -->`` runs with ``NAME()``'s dict as its globals: tiny stand-ins for a
real model, dataset, config or batch, so the block runs as written on CPU in seconds. ``NAME.requires`` lists the
modules it needs; the test skips the block when one is not installed.
"""

from __future__ import annotations

import tempfile


def trl_example() -> dict:
    """README / KERNELS "Drop-in: TRL": ``model``, ``reward``, ``args`` (a GRPOConfig), ``dataset``."""
    from datasets import Dataset
    from trl import GRPOConfig

    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    work = tempfile.mkdtemp(prefix="doc-trl-")
    tok = build_tiny_tokenizer(work, vocab_size=400)
    build_tiny_model(work, tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab_size=len(tok) + 61)
    args = GRPOConfig(output_dir=f"{work}/out", beta=0.04, num_iterations=2, max_steps=2, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=8, use_cpu=True, bf16=False, report_to="none",
                      save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
    return dict(model=work, reward=lambda completions, **_: [float(len(c) % 3) for c in completions], args=args,
                dataset=Dataset.from_dict({"prompt": ["push the box", "go left", "which arm?", "2 + 2 ="]}))


trl_example.requires = ("trl", "datasets")


def verl_example() -> dict:
    """README / KERNELS "Drop-in: verl": verl's registry lookups and one micro-batch as its advantage step and actor
    see it (a DataProto's fields, the algorithm and actor configs)."""
    import numpy as np
    import torch
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
    from verl.workers.config import ActorConfig

    g = torch.Generator().manual_seed(0)
    batch, length = 8, 16
    mask = torch.arange(length)[None] < torch.randint(1, length + 1, (batch, 1), generator=g)
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), mask.sum(1) - 1] = torch.randint(0, 2, (batch,), generator=g).float()
    old_log_prob = -torch.rand(batch, length, generator=g)
    return dict(
        get_adv_estimator_fn=get_adv_estimator_fn, get_policy_loss_fn=get_policy_loss_fn,
        token_level_rewards=rewards, response_mask=mask, uid=np.array(list("aabbccdd"), dtype=object),
        algorithm=AlgoConfig(adv_estimator="fastpo_grpo"), old_log_prob=old_log_prob,
        log_prob=(old_log_prob + 0.1 * torch.randn(batch, length, generator=g)).requires_grad_(),
        actor=ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio_high=0.28,
                          loss_agg_mode="token-mean"))


verl_example.requires = ("verl",)
