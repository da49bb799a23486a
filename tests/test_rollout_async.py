"""The barrier-free rollout (``rollout.mode=async``) against the lock-step one: the same trajectories for the same
seeds on the shipped tiny agent with the continuous-batching engine, and on the scripted engine through the
lock-step fallback of the engine interface; episode caps; env failures."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from test_trainer import train_iterations

import fastpo.envs as E
from fastpo import testing
from fastpo.config import ConfigError, RolloutConfig
from fastpo.engine import HFEngine, SamplingParams
from fastpo.model import load_policy, load_tokenizer, resolve_model_path
from fastpo.preflight import validate
from fastpo.presets import get_preset
from fastpo.prompts import prompt_spec
from fastpo.rollout import RolloutPart, run_rollouts

#: Largest |async - lock-step| sample logprob measured on the tiny agent (fp32 CPU: ~2e-6, batched matmuls of
#: other widths); the bound leaves a margin without letting a wrong context through (those differ by > 0.1).
LOGPROB_ATOL = 1e-4
TIMINGS = ("generate_s", "env_s", "prompt_s", "prefill_s", "decode_s", "_occupancy")


@pytest.fixture(scope="module")
def agent():
    torch.set_num_threads(1)
    path = resolve_model_path("tiny")
    return load_tokenizer(path), load_policy(path).eval()


def _parts(groups: int = 3, size: int = 3, seed: int = 7) -> list[RolloutPart]:
    """Non-slippery FrozenLake (the tiny agent's env: some episodes end early, others run every turn) next to
    Sokoban (the agent never learnt it: long, unparsed answers), each with its own request seeds."""
    parts = []
    for k, (name, kwargs) in enumerate((("frozenlake", {"is_slippery": False}), ("sokoban", {}))):
        n = groups * size
        env = E.make(name, n, **kwargs)
        seeds = np.repeat(np.arange(groups) + seed + 100 * k, size)
        parts.append(RolloutPart(env, prompt_spec(name, enable_think=False), seeds,
                                 np.repeat(np.arange(groups), size), [1000 * k + i for i in range(n)],
                                 max_turns=4, max_actions_per_turn=2))
    return parts


def _compare(got, want) -> float:
    """Every trajectory field equal (logprobs within LOGPROB_ATOL); returns the largest logprob difference."""
    worst = 0.0
    for a_batch, b_batch in zip(got, want, strict=True):
        for a, b in zip(a_batch.trajectories, b_batch.trajectories, strict=True):
            for f in dataclasses.fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if f.name == "sample_logprobs":
                    worst = max(worst, float(np.abs(x - y).max(initial=0.0)))
                    np.testing.assert_allclose(x, y, atol=LOGPROB_ATOL, rtol=0)
                elif isinstance(x, np.ndarray):
                    np.testing.assert_array_equal(x, y, err_msg=f.name)
                else:
                    assert x == y, f.name
        strip = lambda m: {k: v for k, v in m.items() if not k.endswith(TIMINGS)}  # noqa: E731
        assert strip(a_batch.metrics) == strip(b_batch.metrics)
    return worst


@pytest.mark.parametrize("options", [{}, {"max_num_seqs": 4}, {"canonical": True}, {"max_context_window": 1}],
                         ids=["kv", "four_in_flight", "canonical", "window"])
@pytest.mark.slow
def test_async_equals_lockstep_on_the_tiny_agent(agent, options):
    tok, model = agent
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop=("</answer>",))
    lock = run_rollouts(_parts(), HFEngine(model, tok), tok, params, RolloutConfig(**options))
    engine = HFEngine(model, tok)
    t0 = time.perf_counter()
    fast = run_rollouts(_parts(), engine, tok, params, RolloutConfig(mode="async", **options))
    wall = time.perf_counter() - t0
    _compare(fast, lock)
    turns = [t.num_turns for b in lock for t in b.trajectories]
    assert len(set(turns)) > 1  # episodes of different lengths: the async driver really interleaved them
    assert engine.num_unfinished() == 0 and not engine._running and not engine._waiting
    if "max_num_seqs" in options:
        assert engine._pool.slots <= options["max_num_seqs"]
    for batch in fast:
        assert 0 < batch.metrics["rollout/decode_occupancy"] <= 1
        # the engine's forward times: both phases ran, and together they fit in the rollout's wall time
        prefill, decode = batch.metrics["rollout/prefill_s"], batch.metrics["rollout/decode_s"]
        assert prefill == engine.stats.prefill_s and decode == engine.stats.decode_s
        assert prefill > 0 and decode > 0 and prefill + decode < wall


def test_async_equals_lockstep_through_the_engine_fallback(agent):
    """An engine without its own scheduler (the scripted test engine) runs the async driver through
    ``Engine.submit`` / ``step``'s lock-step fallback, with identical trajectories."""
    tok = load_tokenizer(resolve_model_path("tiny"))
    env_script = [["x</think><answer>Up</answer>", "y</think><answer>Down || Left</answer>", "z</think><answer>?"]]
    make = lambda: [RolloutPart(E.make("sokoban", 4), prompt_spec("sokoban"), np.arange(4), np.arange(4),  # noqa
                                list(range(4)), max_turns=3)]
    params = SamplingParams(max_new_tokens=24)
    lock = run_rollouts(make(), testing.ScriptedEngine(tok, env_script * 4), tok, params, RolloutConfig())
    fast = run_rollouts(make(), testing.ScriptedEngine(tok, env_script * 4), tok, params,
                        RolloutConfig(mode="async"))
    assert _compare(fast, lock) == 0.0


def test_env_failure_in_async_rollout_names_the_env_and_leaves_no_request(agent):
    tok, model = agent
    parts = _parts(groups=2, size=2)
    env = parts[1].env
    real_step, calls = env.step, []

    def step(actions, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("FrozenLake.step failed for seed 107")
        return real_step(actions, *args, **kwargs)

    env.step = step
    engine = HFEngine(model, tok)
    with pytest.raises(RuntimeError, match="FrozenLake.step failed for seed 107"):
        run_rollouts(parts, engine, tok, SamplingParams(max_new_tokens=48), RolloutConfig(mode="async"))
    assert engine.num_unfinished() == 0 and not engine._sessions  # aborted, every session closed
    again = run_rollouts(_parts(groups=1, size=2), engine, tok, SamplingParams(max_new_tokens=48),
                         RolloutConfig(mode="async"))
    assert all(t.num_turns >= 1 for b in again for t in b.trajectories)


def test_max_num_seqs_out_of_range_is_a_config_error():
    cfg = get_preset("tiny")
    cfg.rollout.max_num_seqs = -1
    with pytest.raises(ConfigError, match="rollout.max_num_seqs must be >= 0"):
        validate(cfg)
    cfg.rollout.max_num_seqs = 0
    cfg.rollout.mode = "sideways"
    with pytest.raises(ConfigError, match="rollout.mode"):
        validate(cfg)


@pytest.mark.slow
def test_trainer_with_async_rollout_trains_like_lockstep(tmp_path):
    """Two training iterations of the shrunk tiny preset with each driver: the same rollout trajectories (tokens,
    rewards) and weights equal up to the float differences of the sample logprobs (the preset takes PPO's old
    logprobs from the sampler)."""
    from fastpo.config_load import parse_args

    small = ["--preset", "tiny", "--env.max_turns", "2", "--env.val_groups", "4", "--env.env_groups", "4",
             "--env.group_size", "4", "--optim.mini_batch_size", "4", "--optim.micro_batch_tokens", "800",
             "--rollout.max_model_len", "800", "--trainer.iterations", "2", "--trainer.val_before_train", "false",
             "--trainer.val_every", "0", "--trainer.save_every", "0"]
    out = {}
    for mode in ("lockstep", "async"):
        cfg = validate(parse_args([*small, "--rollout.mode", mode, "--trainer.run_dir", str(tmp_path / mode)]), 1)
        out[mode] = train_iterations(cfg, 2)
    (lock_rows, lock_w), (fast_rows, fast_w) = out["lockstep"], out["async"]
    for a, b in zip(lock_rows, fast_rows, strict=True):
        for key in ("rollout/reward", "rollout/response_length", "rollout/num_turns", "rollout/trained_tokens"):
            assert a[key] == b[key], key
    for name, w in lock_w.items():
        torch.testing.assert_close(fast_w[name], w, atol=1e-5, rtol=1e-4)
