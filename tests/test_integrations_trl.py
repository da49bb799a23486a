"""fastpo.integrations.trl against TRL's own GRPOTrainer, on CPU.

Three layers:
* training: the stock trainer and FastPOGRPOTrainer side by side, same seed, same tiny model (its vocab larger than
  the tokenizer's), 3 optimiser steps: per-step losses, logged metrics (same keys, same values) and final weights
  agree within fp32 tolerance, for every loss type fastpo supports, beta 0 and > 0, num_iterations 1 and 2, and
  the loss options (GSPO, delta, entropy mask / bonus, off-policy mask, accumulation);
* one loss call: both trainers' ``_compute_loss`` on the same synthetic batch (ragged masks, an empty row, a
  one-token row, perturbed old / reference / sampler logprobs), every combination of loss type, beta, importance
  sampling level and bias-corrected KL, plus the options a CPU run cannot reach (vLLM IS correction, tool masks,
  eval mode): loss, every parameter's gradient and every logged metric;
* refusals: each option the integration cannot honour stops construction with one line naming it.
"""

from __future__ import annotations

import itertools
import math
import types
from collections import defaultdict

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import AutoTokenizer, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastpo.integrations import trl as fi  # noqa: E402
from fastpo.testing import build_tiny_model, build_tiny_tokenizer  # noqa: E402

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
PROMPTS = ["hello world", "grid # . @", "abc", "the box", "push it", "go left"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-trl")
    tok = build_tiny_tokenizer(path, vocab_size=400)
    build_tiny_model(path, tok, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                     vocab_size=len(tok) + 61, initializer_range=0.2)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir, padding_side="left")


def reward_len(completions, **_):
    return [float(len(c) % 5) for c in completions]


def config(out_dir, **overrides) -> GRPOConfig:
    kw = dict(output_dir=str(out_dir), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
              max_steps=3, learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
              logging_steps=1, disable_tqdm=True, seed=0, shuffle_dataset=False, dataloader_num_workers=0,
              model_init_kwargs={"dtype": "float32"}, log_completions=False)
    kw.update(overrides)
    return GRPOConfig(**kw)


def make(cls, model, tokenizer, out_dir, **overrides):
    data = datasets.Dataset.from_dict({"prompt": PROMPTS})
    return cls(model=model, reward_funcs=reward_len, args=config(out_dir, **overrides), train_dataset=data,
               processing_class=tokenizer)


# ------------------------------------------------------------------------------------------------ training
TRAIN_CASES = {  # every loss type with (beta 0, num_iterations 1) and (beta > 0, num_iterations 2) plus options
    "grpo-b0-it1": dict(loss_type="grpo", beta=0.0, num_iterations=1),
    "grpo-b.04-it2": dict(loss_type="grpo", beta=0.04, num_iterations=2),
    "bnpo-b0-it1": dict(loss_type="bnpo", beta=0.0, num_iterations=1),
    # entropy mask + entropy bonus + off-policy mask + KL without the ratio factor, clipping active
    "bnpo-b.04-it2-masks-bonus": dict(loss_type="bnpo", beta=0.04, num_iterations=2, top_entropy_quantile=0.5,
                                      entropy_coef=0.01, off_policy_mask_threshold=1e-6,
                                      use_bias_correction_kl=False, epsilon=1e-4, learning_rate=1e-2),
    "dr_grpo-b0-it1": dict(loss_type="dr_grpo", beta=0.0, num_iterations=1),
    # sequence-level ratio (GSPO), two-sided clip, clipping active (tiny epsilon), adaptive entropy bonus
    "dr_grpo-b.04-it2-gspo-delta-adaptive": dict(loss_type="dr_grpo", beta=0.04, num_iterations=2,
                                                 importance_sampling_level="sequence", epsilon=1e-4,
                                                 epsilon_high=2e-4, delta=1.0003, learning_rate=1e-2,
                                                 entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=10.0),
    "dapo-b0-it1": dict(loss_type="dapo", beta=0.0, num_iterations=1),
    # gradient accumulation, two optimiser steps per generation
    "dapo-b.04-it2-accum": dict(loss_type="dapo", beta=0.04, num_iterations=2, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, steps_per_generation=2),
    "luspo-b0-it1": dict(loss_type="luspo", beta=0.0, num_iterations=1),
    "luspo-b.04-it2-gspo": dict(loss_type="luspo", beta=0.04, num_iterations=2, importance_sampling_level="sequence"),
}


def run_training(cls, model_dir, tokenizer, out_dir, **opts):
    trainer = make(cls, model_dir, tokenizer, out_dir, **opts)
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return trainer.state.log_history, weights


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_training_matches_stock_trainer(case, model_dir, tokenizer, tmp_path):
    opts = TRAIN_CASES[case]
    stock_log, stock_w = run_training(GRPOTrainer, model_dir, tokenizer, tmp_path / "stock", **opts)
    fast_log, fast_w = run_training(fi.FastPOGRPOTrainer, model_dir, tokenizer, tmp_path / "fastpo", **opts)
    assert len(stock_log) == len(fast_log) == 4  # 3 steps + the run summary
    for step, (a, b) in enumerate(zip(stock_log, fast_log, strict=True)):
        assert set(a) == set(b), f"step {step}: logged keys differ: {set(a) ^ set(b)}"
        for key in set(a) - TIMING_KEYS:
            tol = 1e-6 + 1e-4 * abs(a[key])
            assert abs(a[key] - b[key]) <= tol, f"step {step} {key}: stock {a[key]} vs fastpo {b[key]}"
    assert all("loss" in h for h in stock_log[:3])
    for name, w in stock_w.items():
        torch.testing.assert_close(fast_w[name], w, atol=1e-5, rtol=1e-5, msg=f"final weight {name}")
    if "masks" in case or "delta" in case:  # the clip branches were taken: the metrics compared real values
        assert max(h.get("clip_ratio/region_mean", 0.0) for h in stock_log) > 0
    if "bonus" in case or "adaptive" in case:
        assert {"policy_loss", "entropy_coef"} <= set(stock_log[0])
    if "adaptive" in case:  # the coefficient moved each step (entropy ~6 < target 10: up by entropy_coef_delta)
        assert [h["entropy_coef"] for h in stock_log[:3]] == pytest.approx([0.015, 0.02, 0.025])


# ----------------------------------------------------------------------------------------------- loss call
@pytest.fixture(scope="module")
def trainer_pair(model_dir, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    stock = make(GRPOTrainer, model_dir, tokenizer, out / "stock")
    fast = make(fi.FastPOGRPOTrainer, model_dir, tokenizer, out / "fastpo")
    return stock, fast


def set_options(trainer, loss_type="grpo", beta=0.0, level="token", bias_kl=True, delta=None, eps=(0.2, 0.28),
                off_policy=None, entropy_q=1.0, entropy_coef=0.0, vllm_is=False, train=True, accum=1,
                adaptive_target=None):
    """The loss options as the trainer stores them (both trainers read the same attributes)."""
    trainer.use_adaptive_entropy = adaptive_target is not None
    trainer.args.entropy_target = adaptive_target if adaptive_target is not None else 0.2
    trainer._last_world_entropy, trainer._entropy_window_stats = float("inf"), None
    trainer.loss_type, trainer.beta, trainer.importance_sampling_level = loss_type, beta, level
    trainer.args.use_bias_correction_kl, trainer.args.delta = bias_kl, delta
    trainer.epsilon_low, trainer.epsilon_high = eps
    trainer.off_policy_mask_threshold, trainer.top_entropy_quantile = off_policy, entropy_q
    trainer.entropy_coef = entropy_coef
    trainer._entropy_bonus_enabled = entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm_is
    trainer.current_gradient_accumulation_steps = accum
    trainer.model.train(train)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def synthetic_batch(trainer, seed=0, tool_mask=False, seq_ratio=False):
    """Left-padded prompts, ragged completions (an empty row, a one-token row), old / ref / sampler logprobs the
    current policy's plus noise, so ratios spread over both clip bounds."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    b, p, c = 6, 5, 7
    prompt_ids = torch.randint(0, vocab, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completion_ids = torch.randint(0, vocab, (b, c), generator=g)
    lengths = torch.tensor([7, 0, 1, 4, 7, 3])
    completion_mask = (torch.arange(c)[None] < lengths[:, None]).long()
    with torch.no_grad():
        ids = torch.cat([prompt_ids, completion_ids], 1)
        attn = torch.cat([prompt_mask, completion_mask], 1)
        logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, attn, c)
    # per-token noise plus a per-row offset: token and sequence (GSPO) ratios both cross the clip bounds
    noise = lambda scale: scale * torch.randn(b, c, generator=g) + 0.4 * torch.randn(b, 1, generator=g)  # noqa: E731
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, advantages=torch.randn(b, generator=g),
                 old_per_token_logps=logp + noise(0.3), ref_per_token_logps=logp + noise(0.3),
                 sampling_per_token_logps=logp + noise(0.3), num_items_in_batch=completion_mask.sum() * 2,
                 importance_sampling_ratio=(torch.rand(b, 1 if seq_ratio else c, generator=g) + 0.5))
    if tool_mask:
        batch["tool_mask"] = (torch.rand(b, c, generator=g) > 0.3).long()
    return batch


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    mode = "train" if trainer.model.training else "eval"
    return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics[mode].items()}


def assert_same_step(trainer_pair, batch, **opts):
    stock, fast = trainer_pair
    results = []
    for tr in (stock, fast):
        set_options(tr, **opts)
        results.append(loss_and_grads(tr, batch))
    (l0, g0, m0), (l1, g1, m1) = results
    torch.testing.assert_close(l1, l0, atol=1e-6, rtol=1e-5)
    assert set(g0) == set(g1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-4, msg=f"grad {name}")
    assert set(m0) == set(m1), set(m0) ^ set(m1)
    for key in m0:
        same = (math.isnan(m0[key]) and math.isnan(m1[key])) or abs(m0[key] - m1[key]) <= 1e-6 + 1e-5 * abs(m0[key])
        assert same, f"metric {key}: stock {m0[key]} vs fastpo {m1[key]}"
    return m0


LOSS_GRID = list(itertools.product(fi.LOSS_TYPES, (0.0, 0.04), ("token", "sequence"), (True, False)))


@pytest.mark.parametrize("loss_type,beta,level,bias_kl", LOSS_GRID)
def test_loss_step_matches_stock(trainer_pair, loss_type, beta, level, bias_kl):
    batch = synthetic_batch(trainer_pair[0])
    metrics = assert_same_step(trainer_pair, batch, loss_type=loss_type, beta=beta, level=level, bias_kl=bias_kl)
    assert metrics["clip_ratio/region_mean"] > 0  # noisy old logprobs: both clip branches are exercised


@pytest.mark.parametrize("name,opts,batch_opts", [
    ("delta", dict(loss_type="grpo", delta=1.5, beta=0.04), {}),
    ("delta-gspo", dict(loss_type="dapo", delta=1.28, level="sequence"), {}),
    ("off-policy-mask", dict(loss_type="bnpo", off_policy=0.05, beta=0.04), {}),
    ("entropy-mask-bonus", dict(loss_type="grpo", entropy_q=0.4, entropy_coef=0.05), {}),
    ("entropy-bonus-accum", dict(loss_type="dr_grpo", entropy_coef=0.05, accum=3), {}),
    ("vllm-is-token", dict(loss_type="dapo", vllm_is=True, beta=0.04), {}),
    ("vllm-is-sequence", dict(loss_type="grpo", vllm_is=True, level="sequence"), dict(seq_ratio=True)),
    ("tool-mask", dict(loss_type="bnpo", beta=0.04), dict(tool_mask=True)),
    ("everything", dict(loss_type="dapo", beta=0.04, delta=1.3, off_policy=0.05, entropy_q=0.5, entropy_coef=0.01,
                        vllm_is=True, accum=2, bias_kl=False), dict(tool_mask=True)),
    ("eval-mode", dict(loss_type="grpo", beta=0.04, train=False, accum=4), {}),
])
def test_loss_options_match_stock(trainer_pair, name, opts, batch_opts):
    assert_same_step(trainer_pair, synthetic_batch(trainer_pair[0], seed=1, **batch_opts), **opts)


@pytest.mark.parametrize("target", [10.0, 1.0])  # entropy ~6: the coefficient goes up / down
def test_adaptive_entropy_matches_stock(trainer_pair, target):
    """Three accumulation windows of one micro-batch each: loss, gradients, metrics and the controller state
    (coefficient, last window entropy) agree after every call."""
    batch = synthetic_batch(trainer_pair[0], seed=4)
    for tr in trainer_pair:
        set_options(tr, loss_type="bnpo", entropy_coef=0.05, adaptive_target=target, entropy_q=0.5)
    for _ in range(3):
        results = [loss_and_grads(tr, batch) for tr in trainer_pair]
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-5)
        for name in results[0][1]:
            torch.testing.assert_close(results[1][1][name], results[0][1][name], atol=1e-6, rtol=1e-4)
        assert results[0][2] == pytest.approx(results[1][2], rel=1e-5, abs=1e-6, nan_ok=True)
        stock, fast = trainer_pair
        assert fast.entropy_coef == pytest.approx(stock.entropy_coef)
        assert fast._last_world_entropy == pytest.approx(stock._last_world_entropy, rel=1e-6)
    assert stock.entropy_coef != 0.05
    for tr in trainer_pair:
        set_options(tr)


def test_all_masked_batch_is_a_differentiable_zero(trainer_pair):
    stock, fast = trainer_pair
    batch = synthetic_batch(stock, seed=2)
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])
    set_options(fast, loss_type="bnpo", beta=0.04)
    loss = fast._compute_loss(fast.model, batch)
    loss.backward()
    assert loss.item() == 0.0


def test_no_full_logits(trainer_pair, monkeypatch):
    """The fastpo trainer never calls the lm head module (TRL's generate does; the loss step must not)."""
    _, fast = trainer_pair
    set_options(fast, loss_type="grpo", beta=0.04)
    batch = synthetic_batch(fast, seed=3)
    calls = []
    head = fast.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda *a: calls.append(1))
    try:
        fast._compute_loss(fast.model, batch).backward()
    finally:
        handle.remove()
    assert not calls


# ------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("option,value,extra", [
    ("loss_type", "cispo", {}),
    ("loss_type", "sapo", {}),
    ("loss_type", "vespo", {}),
    ("delta", 1.1, dict(epsilon_high=0.28)),
])
def test_refuses_option(model_dir, tokenizer, tmp_path, option, value, extra):
    with pytest.raises(fi.UnsupportedOption) as err:
        make(fi.FastPOGRPOTrainer, model_dir, tokenizer, tmp_path, **{option: value}, **extra)
    msg = str(err.value)
    assert "\n" not in msg and f"{option}={value!r}" in msg


def test_refuses_deepspeed_zero3():
    args = types.SimpleNamespace(loss_type="grpo", use_adaptive_entropy=False, epsilon=0.2, epsilon_high=None,
                                 delta=None, deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    with pytest.raises(fi.UnsupportedOption, match="zero_stage=3"):
        fi.check_config(args)


def test_refuses_logit_softcapping(model_dir, tokenizer, tmp_path):
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(fi.UnsupportedOption, match="final_logit_softcapping=30.0"):
        make(fi.FastPOGRPOTrainer, model, tokenizer, tmp_path)


def test_refuses_moe_aux_loss(tokenizer, tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
                        router_aux_loss_coef=0.01, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                        eos_token_id=tokenizer.eos_token_id)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    with pytest.raises(fi.UnsupportedOption, match="router_aux_loss_coef=0.01"):
        make(fi.FastPOGRPOTrainer, str(tmp_path / "moe"), tokenizer, tmp_path / "out")


def test_refuses_other_trl_releases(model_dir, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(fi.UnsupportedOption, match="supports trl 1.16.x, found trl 1.17.0"):
        make(fi.FastPOGRPOTrainer, model_dir, tokenizer, tmp_path)
    monkeypatch.setenv("FASTPO_TRL_UNTESTED", "1")
    with pytest.warns(UserWarning, match="found trl 1.17.0"):
        make(fi.FastPOGRPOTrainer, model_dir, tokenizer, tmp_path)


def test_import_error_without_trl(monkeypatch):
    """Without trl, importing the integration fails with one ImportError line naming what to install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "fastpo.integrations.trl", raising=False)
    with pytest.raises(ImportError, match="needs trl 1.16") as err:
        importlib.import_module("fastpo.integrations.trl")
    assert "\n" not in str(err.value)
