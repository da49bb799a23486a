"""fastpo.trainer / fastpo.train: the real entry point in subprocesses (1 process and torchrun with 2 ranks),
exact resume, non-finite skipping and abort, 1 rank vs 2 ranks; plus in-process checks of packing and logprobs.

Every run uses the tiny preset (model "tiny": the shipped tiny agent, fastpo.tiny_agent) shrunk by CLI overrides:
2 turns, 16-token responses, 4 x 4 groups. GAE (critic) runs make the advantages non-zero even when every
trajectory earns the same reward.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpo.tiny_agent import tiny_agent_path
from fastpo.trainer import Trainer

SMALL = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16", "--env.val_groups", "4",
         "--env.env_groups", "4", "--env.group_size", "4", "--optim.mini_batch_size", "8",
         "--optim.micro_batch_tokens", "800", "--rollout.max_model_len", "800", "--trainer.iterations", "3",
         "--trainer.val_every", "3"]
GAE = ["--algorithm.adv_estimator", "gae", "--trainer.val_before_train", "false", "--trainer.val_every", "0"]


def train_iterations(cfg, iterations: int = 1) -> tuple[list[dict[str, float]], dict]:
    """Run iterations 1..`iterations` of a ``Trainer`` built from the validated `cfg` in this process, without
    validation, checkpoints or an export; returns (each iteration's metrics, the actor's weights after the last:
    detached clones by state-dict name)."""
    trainer = Trainer(cfg)
    try:
        rows = []
        for step in range(1, iterations + 1):
            trainer.step = step
            rows.append(trainer.iteration())
        weights = {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}
    finally:
        trainer.close(export=False)
    return rows, weights


def _run(args: list[str], run_dir: Path, nproc: int = 1, timeout: float = 180, env: dict | None = None):
    """Run fastpo.train (python -m, or torchrun --standalone); kill the whole process group on timeout."""
    launcher = [sys.executable, "-m", "fastpo.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
        "fastpo.train"]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                **(env or {})}
    # cwd is NOT the repo root: there, transformers' probe for the HF `kernels` package imports ./kernels as a
    # top-level package, registering fastpo's custom ops twice (a segfault in deterministic mode)
    proc = subprocess.Popen([*launcher, *args, "--trainer.run_dir", str(run_dir)], cwd=run_dir.parent, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"training timed out after {timeout}s:\n{err.decode()[-3000:]}")
    return proc.returncode, out.decode(), err.decode()


def _main(args: list[str], run_dir: Path, capsys) -> tuple[int, str, str]:
    """fastpo.train's ``main`` in this process: the entry point's code path (config, run, close, export, the exit
    status and its one line) without a new interpreter's ~5 CPU-s of imports. For the checks that are not about
    the process boundary (the subprocess tests above and below cover that)."""
    from fastpo import distributed as du
    from fastpo.train import main

    capsys.readouterr()
    try:
        status = main([*args, "--trainer.run_dir", str(run_dir)])
    finally:
        du.set_deterministic(False)  # trainer.deterministic would outlive the run in this process
    out, err = capsys.readouterr()
    return status, out, err


def _main_ok(args: list[str], run_dir: Path, capsys) -> str:
    rc, out, err = _main(args, run_dir, capsys)
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return out


def _ok(args, run_dir, **kw) -> str:
    rc, out, err = _run(args, run_dir, **kw)
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ------------------------------------------------------------------------------------------ in-process units
@pytest.mark.parametrize("layout,attn", [("packed", "sdpa"), ("padded", "sdpa"), ("shared", "sdpa"),
                                         ("shared", "eager")])
def test_packed_logprobs_equal_full_logits(tmp_path, layout, attn):
    """pack + lm_head_inputs + fused_linear_logprob == log_softmax(HF logits / T) of each sequence alone, in every
    micro-batch layout (one packed row; one right-padded row per trajectory; one row per group with the prefix its
    trajectories share once, under a 4D mask: boolean for sdpa, additive for eager)."""
    from fastpo.microbatch import pack
    from fastpo.rollout import Trajectory
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer
    from fastpo.update import token_logp, token_values

    tok = build_tiny_tokenizer(tmp_path)
    model = build_tiny_model(tmp_path, tok)
    model.set_attn_implementation(attn)
    rng = np.random.default_rng(0)
    samples = []
    prompt = rng.integers(0, len(tok), 5)
    for n, group in ((7, 0), (12, 0), (5, 1)):  # the two trajectories of group 0 start with the same 5 tokens
        ids = rng.integers(0, len(tok), n)
        if group == 0:
            ids[:5] = prompt
        mask = np.arange(n) >= 2
        samples.append(Trajectory(ids, mask, group=group))
    micro = pack(samples, [0, 1, 2], 20, torch.device("cpu"), layout, token_cost=8.0)
    if layout == "shared":  # group 0 costs 7 + (12 - 5) tokens, so all three fit in 20: rows [prefix|2|7], [5]
        assert [m.indices for m in micro] == [[0, 1, 2]]
        mb = micro[0]
        assert mb.padded_ids.shape == (2, 14) and mb.row_mask.shape == (2, 1, 14, 14)
        assert mb.padded_index.tolist() == list(range(7)) + list(range(5)) + list(range(7, 14)) + list(range(14, 19))
        assert mb.row_pos[0].tolist() == list(range(7)) + list(range(5, 12))
        assert not mb.row_mask[0, 0, 8, 5] and mb.row_mask[0, 0, 8, 4] and mb.row_mask[0, 0, 8, 7]
    else:
        assert [m.indices for m in micro] == [[0, 1], [2]]
    if layout == "padded":
        assert micro[0].padded_ids.shape == (2, 12) and micro[0].padded_index.tolist() == list(range(7)) + list(
            range(12, 24))
    elif layout == "packed":
        assert micro[0].padded_ids is None
    assert micro[0].position_ids[0].tolist() == list(range(7)) + list(range(12)) + [0, 1, 2, 3, 4] * (
        layout == "shared")
    for mb in micro:
        mask = torch.from_numpy(np.concatenate([samples[i].loss_mask for i in mb.indices]))
        logp, ent = token_logp(model, mb, mask, 0.7, True)
        cu = mb.cu_seqlens.tolist()
        for j, i in enumerate(mb.indices):
            ids = torch.from_numpy(samples[i].input_ids)[None]
            ref = torch.log_softmax(model(ids).logits[0, :-1] / 0.7, -1)
            ref_lp = ref.gather(-1, ids[0, 1:, None])[:, 0]
            ref_ent = -(ref.exp() * ref).sum(-1)
            m = torch.from_numpy(samples[i].loss_mask[1:])
            got, got_ent = logp[cu[j] + 1:cu[j + 1]], ent[cu[j] + 1:cu[j + 1]]
            torch.testing.assert_close(got[m], ref_lp[m], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(got_ent[m], ref_ent[m], atol=2e-5, rtol=1e-5)
            assert (got[~m] == 0).all() and logp[cu[j]] == 0
    # the critic on the same packed rows: V_t = head(h_{t-1}) of each sequence alone
    from fastpo.model import load_critic

    critic = load_critic(tmp_path)
    critic.backbone.set_attn_implementation(attn)
    for mb in micro:
        mask = torch.from_numpy(np.concatenate([samples[i].loss_mask for i in mb.indices]))
        values = token_values(critic, mb, mask)
        cu = mb.cu_seqlens.tolist()
        for j, i in enumerate(mb.indices):
            ref = critic(torch.from_numpy(samples[i].input_ids)[None])[0, :-1]
            m = torch.from_numpy(samples[i].loss_mask[1:])
            torch.testing.assert_close(values[cu[j] + 1:cu[j + 1]][m], ref[m], atol=2e-5, rtol=1e-5)


def test_shared_layout_falls_back_within_the_token_budget():
    """A micro-batch packed by its shared size that the cost estimate runs as padded rows is re-packed by full
    lengths, so the forward never exceeds optim.micro_batch_tokens."""
    from fastpo.microbatch import pack
    from fastpo.rollout import Trajectory

    rng = np.random.default_rng(3)
    samples = []
    for _ in range(2):  # one group, only 2 of 10 tokens in common: sharing saves too little to pay for the mask
        ids = rng.integers(10, 100, 10)
        ids[:2] = [1, 2]
        samples.append(Trajectory(ids, np.ones(10, bool), group=7))
    micro = pack(samples, [0, 1], 18, torch.device("cpu"), "shared", token_cost=0.0)  # 10 + 8 fit, 20 do not
    assert [m.indices for m in micro] == [[0], [1]] and all(m.row_mask is None for m in micro)
    assert all(m.input_ids.shape[1] <= 18 for m in micro)
    micro = pack(samples, [0, 1], 20, torch.device("cpu"), "shared", token_cost=0.0)
    assert [m.indices for m in micro] == [[0, 1]] and micro[0].padded_ids.shape == (2, 10)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_gradients_add_up_to_one_mini_batch_loss(tmp_path, mode):
    """Accumulated over micro-batches (with their loss scales), the actor gradient equals the gradient of the same
    loss over the whole mini-batch in one micro-batch, for every aggregation mode."""
    from fastpo import algorithms
    from fastpo.microbatch import cat_tokens, pack, token_cost
    from fastpo.presets import get_preset
    from fastpo.rollout import Trajectory
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer
    from fastpo.update import loss_scales, norm_len, token_logp

    tok = build_tiny_tokenizer(tmp_path)
    model = build_tiny_model(tmp_path, tok)
    rng = np.random.default_rng(1)
    samples = []
    for n, group in ((9, 0), (14, 0), (6, 2), (11, 1), (8, 1)):
        ids = rng.integers(0, len(tok), n)
        if group < 2 and samples and samples[-1].group == group:  # the second of a group shares a prompt prefix
            ids[:4 + group] = samples[-1].input_ids[:4 + group]
        mask = (np.arange(n) >= 3) & (rng.random(n) < 0.8)
        s = Trajectory(ids, mask, group=group)
        s.old_logp = (-rng.random(n) * mask).astype(np.float32)
        s.advantages = (rng.standard_normal(n) * mask).astype(np.float32)
        samples.append(s)
    cfg = get_preset("tiny")
    cfg.algorithm.loss_agg_mode = mode
    kept = list(range(5))

    def grads(max_tokens, layout):
        cpu = torch.device("cpu")
        model.zero_grad()
        plan = pack(samples, kept, max_tokens, cpu, layout, token_cost(model))
        for mb, scale in zip(plan, loss_scales(samples, kept, plan, mode, world=1), strict=True):
            mask = cat_tokens(samples, mb.indices, "loss_mask", cpu)
            logp, ent = token_logp(model, mb, mask, cfg.rollout.temperature, True)
            old = cat_tokens(samples, mb.indices, "old_logp", cpu)
            adv = cat_tokens(samples, mb.indices, "advantages", cpu)
            loss, _ = algorithms.policy_loss(logp, old, adv, mask, ent, None, cfg.algorithm, cu_seqlens=mb.cu_seqlens,
                                             norm_len=norm_len(samples, kept))
            (loss * scale).backward()
        return plan, [p.grad.clone() for p in model.parameters()]

    plan, one = grads(10**6, "packed")
    assert len(plan) == 1
    for layout in ("packed", "padded", "shared"):
        plan, many = grads(16, layout)
        # shared: the second trajectory of group 1 costs only its 3 tokens past the prompt, so it joins the first
        assert [mb.indices for mb in plan] == ([[0], [1], [2], [3, 4]] if layout == "shared" else [[i] for i in kept])
        assert (plan[-1].row_mask is not None) == (layout == "shared")
        for a, b in zip(one, many, strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def test_mini_batches_shuffle_groups_deterministically():
    from fastpo.update import mini_batches

    kept = list(range(64))  # 8 groups of 8, group by group as the filter returns them
    a = mini_batches(kept, 16, True, seed=42, step=3, epoch=0)  # the tiny preset's mini-batches of 16
    assert sorted(i for mb in a for i in mb) == kept and [len(mb) for mb in a] == [16] * 4
    assert all(len({i // 8 for i in mb}) > 2 for mb in a)  # in order, each would hold exactly 2 groups
    assert a == mini_batches(kept, 16, True, 42, 3, 0)  # a function of (seed, step, epoch): same on every rank
    assert a != mini_batches(kept, 16, True, 42, 3, 1)
    assert a != mini_batches(kept, 16, True, 42, 4, 0)
    assert mini_batches(kept, 16, False, 42, 3, 0) == [kept[i:i + 16] for i in range(0, 64, 16)]


def test_request_seeds_and_nan_hook(monkeypatch):
    from fastpo.trainer import INJECT_NAN_ENV, injected_nan_steps, request_seed

    assert request_seed(1, 0, 3, 5) == request_seed(1, 0, 3, 5)
    assert len({request_seed(1, k, s, i) for k in (0, 1) for s in range(3) for i in range(20)}) == 120
    monkeypatch.setenv(INJECT_NAN_ENV, "2, 3")
    assert injected_nan_steps() == {2, 3}
    monkeypatch.setenv(INJECT_NAN_ENV, "x")
    with pytest.raises(ValueError, match=INJECT_NAN_ENV):
        injected_nan_steps()


@pytest.mark.slow
def test_bad_config_exits_2(tmp_path):
    rc, _, err = _run([*SMALL, "--optim.grad_clip", "0"], tmp_path / "run")
    assert rc == 2 and "optim.grad_clip must be > 0" in err
    assert not (tmp_path / "run").exists()  # validated before anything is loaded or written


# ------------------------------------------------------------------------------------ the real entry point
@pytest.mark.slow
def test_torchrun_two_ranks_smoke(tmp_path):
    """torchrun --nproc_per_node=2 -m fastpo.train: exit 0, finite metrics, parameters changed, HF export loads."""
    run = tmp_path / "run"
    _ok([*SMALL, "--trainer.iterations", "2", "--trainer.val_every", "2"], run, nproc=2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val-env/FrozenLake/success" in rows[0] and "val-env/FrozenLake/success" in rows[2]
    for r in rows[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/logprob_gap_mean"):
            assert r[key] is not None and np.isfinite(r[key]), (key, r)
        assert r["rollout/logprob_gap_mean"] < 1e-3 and r["actor/nonfinite_skips"] == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["trainer"]["iterations"] == 2 and cfg["model"]["path"] == "tiny"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    AutoTokenizer.from_pretrained(run / "hf")
    init = _weights(tiny_agent_path())
    trained = {k: v for k, v in model.state_dict().items()}
    assert set(init) <= set(trained)
    assert max((trained[k] - init[k]).abs().max().item() for k in init) > 1e-5
    assert (run / "checkpoints" / "step-000002" / "COMPLETE").is_file()
    launches = json.loads((run / "run_info.json").read_text())["launches"]  # written by rank 0 only
    assert [(r["world_size"], r["start_step"]) for r in launches] == [(2, 0)]


#: GAE runs in deterministic mode, one update each, on 1 rank and on 2 FSDP2 ranks: shared (conftest's shared_run)
#: by the 1-rank == 2-rank comparisons and, copied, as the first launch of the exact-resume checks.
GAE_DET = [*SMALL, *GAE, "--trainer.deterministic", "true"]


def _gae_first_update(shared_run, nproc: int) -> Path:
    return shared_run(f"trainer-gae-det-1-iteration-{nproc}-ranks",
                      lambda run: _ok([*GAE_DET, "--trainer.iterations", "1"], run, nproc=nproc))


def gae_two_updates_two_ranks(shared_run) -> Path:
    """2 iterations on 2 ranks (meta init by default): the straight run of the 2-rank exact resume, and the meta-init
    run of test_model_options' meta init == plain load."""
    return shared_run("trainer-gae-det-2-iterations-2-ranks",
                      lambda run: _ok([*GAE_DET, "--trainer.iterations", "2"], run, nproc=2))


def _resumed_copy(shared_run, nproc: int, tmp_path: Path) -> Path:
    """A copy of the shared 1-update run (its step-1 checkpoint included), to resume into."""
    split = tmp_path / "split"
    shutil.copytree(_gae_first_update(shared_run, nproc), split)
    return split


@pytest.mark.slow
def test_exact_resume_single_process(tmp_path, shared_run):
    """3 iterations straight == 1 iteration + checkpoint + resume to 3 in a new process, bit for bit."""
    straight = tmp_path / "straight"
    _ok([*GAE_DET, "--trainer.iterations", "3"], straight)
    split = _resumed_copy(shared_run, 1, tmp_path)
    out = _ok([*GAE_DET, "--trainer.iterations", "3"], split)
    assert "resumed from step 1" in out
    launches = json.loads((split / "run_info.json").read_text())["launches"]  # one record per launch
    assert [(r["world_size"], r["start_step"]) for r in launches] == [(1, 0), (1, 1)]
    source = launches[0]["source"]  # None only when fastpo is imported from outside a git checkout
    assert source is None or (len(source["commit"]) == 40 and isinstance(source["dirty"], bool))
    a, b = _metrics(straight), _metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3]
    keys = [k for k in a[0] if k.startswith(("actor/", "critic/", "rollout/reward", "rollout/logprob_gap"))]
    assert "critic/vf_loss" in keys and "actor/pg_loss" in keys
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    wa, wb = _weights(straight / "hf"), _weights(split / "hf")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_validation_schedule_leaves_training_unchanged(tmp_path, capsys):
    """Validating before and after every iteration vs never gives the same weights bit for bit: validation draws
    its own sampling seeds and never touches the training RNG (the preset's val_every relies on it)."""
    args = [*SMALL, "--trainer.iterations", "2", "--trainer.deterministic", "true"]
    often, never = tmp_path / "often", tmp_path / "never"
    _main_ok([*args, "--trainer.val_every", "1", "--trainer.val_before_train", "true"], often, capsys)
    _main_ok([*args, "--trainer.val_every", "0", "--trainer.val_before_train", "false"], never, capsys)
    assert any("val-env/FrozenLake/success" in r for r in _metrics(often))
    assert not any("val-env/FrozenLake/success" in r for r in _metrics(never))
    wa, wb = _weights(often / "hf"), _weights(never / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_nonfinite_loss_is_skipped_and_counted(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("FASTPO_INJECT_NAN_AT", "1")
    _main_ok([*SMALL, *GAE, "--trainer.iterations", "2"], run, capsys)
    rows = _metrics(run)
    assert [r["actor/nonfinite_skips"] for r in rows] == [1, 1]
    assert rows[0]["actor/grad_norm"] is None  # nan, logged as null
    assert np.isfinite(rows[1]["actor/grad_norm"])


@pytest.mark.slow
def test_nonfinite_in_a_row_aborts_with_intact_checkpoint(tmp_path, capsys, monkeypatch):
    from fastpo import checkpoint
    from fastpo.model import load_policy

    run = tmp_path / "run"
    monkeypatch.setenv("FASTPO_INJECT_NAN_AT", "2,3")
    rc, out, err = _main([*SMALL, *GAE, "--trainer.iterations", "5", "--trainer.save_every", "1",
                          "--trainer.keep_checkpoints", "3", "--optim.max_nonfinite_in_a_row", "2"], run, capsys)
    assert rc == 1, err[-3000:]
    assert "training stopped: 2 consecutive optimiser steps with a non-finite" in err
    assert "step-000002" in err  # the message names the last checkpoint
    assert not (run / "hf").exists()
    last = checkpoint.latest(run)
    assert last is not None and last.name == "step-000002"
    meta = checkpoint.read_meta(last)
    assert meta["trainer_state"]["nonfinite_total"] == 1 and meta["trainer_state"]["nonfinite_in_a_row"] == 1
    params = {}
    for step in (1, 2):
        model = load_policy(tiny_agent_path())
        checkpoint.load(run / "checkpoints" / f"step-{step:06d}", {"actor": model}, restore_rng=False)
        params[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in params[2].values())
    # step 2 was skipped: its checkpoint holds step 1's weights
    assert all(torch.equal(params[1][k], params[2][k]) for k in params[1])


@pytest.mark.slow
def test_logprob_gap_after_weight_sync_aborts(tmp_path, capsys):
    """A threshold below the fp32 engine/trainer gap (~1e-7) trips the weight-sync check at the first rollout."""
    rc, _, err = _main([*SMALL, *GAE, "--trainer.iterations", "2", "--trainer.logprob_gap_max", "1e-12"],
                       tmp_path / "run", capsys)
    assert rc == 1, err[-3000:]
    assert "training stopped: step 1: mean |engine logp - trainer logp|" in err
    assert "exceeds trainer.logprob_gap_max=1e-12" in err


@pytest.mark.slow
def test_exact_resume_two_ranks(tmp_path, shared_run):
    """torchrun, 2 ranks (FSDP2-sharded actor, critic and optimisers): 2 straight == 1 + resume to 2, bit for bit."""
    straight = gae_two_updates_two_ranks(shared_run)
    split = _resumed_copy(shared_run, 2, tmp_path)
    assert "resumed from step 1" in _ok([*GAE_DET, "--trainer.iterations", "2"], split, nproc=2)
    a, b = _metrics(straight), _metrics(split)
    assert [r["step"] for r in b] == [1, 2]
    keys = [k for k in a[0] if k.startswith(("actor/", "critic/", "rollout/reward"))]
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    wa, wb = _weights(straight / "hf"), _weights(split / "hf")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_one_rank_equals_two_ranks_first_update(shared_run):
    """The first update (GAE + critic, several micro-batches) on 1 rank and on 2 FSDP2 ranks agree."""
    one, two = _gae_first_update(shared_run, 1), _gae_first_update(shared_run, 2)
    a, b = _metrics(one)[0], _metrics(two)[0]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm",
                "rollout/reward"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    wa, wb, w0 = _weights(one / "hf"), _weights(two / "hf"), _weights(tiny_agent_path())
    assert max((wa[k] - w0[k]).abs().max().item() for k in wa) > 1e-4  # the update moved the weights
    # Adam's first step is ~lr * sign(grad) (lr 3e-4): where a grad is ~0, float noise between the 1- and 2-rank
    # reductions can move its size; allow a third of lr per element, and require almost all elements far closer.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=0)
        assert ((wa[k] - wb[k]).abs() > 3e-5).float().mean() < 1e-3, k


@pytest.mark.slow
def test_deferred_grad_sync_equals_one_rank(tmp_path, shared_run):
    """optim.defer_grad_sync on 2 ranks (micro-batch gradients summed unsharded, reduced once per mini-batch, for
    actor and critic) gives the 1-rank update within the same float noise as the per-micro-batch reduction."""
    one = _gae_first_update(shared_run, 1)
    _ok([*GAE_DET, "--trainer.iterations", "1", "--optim.defer_grad_sync", "true"], tmp_path / "deferred", nproc=2)
    a, b = _metrics(one)[0], _metrics(tmp_path / "deferred")[0]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "rollout/reward"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    wa, wb = _weights(one / "hf"), _weights(tmp_path / "deferred" / "hf")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=0)
        assert ((wa[k] - wb[k]).abs() > 3e-5).float().mean() < 1e-3, k


def test_on_policy_update_equals_the_scored_path(tmp_path, monkeypatch):
    """One epoch over one mini-batch skips the separate old-logprob pass (the update's detached logp is the old
    logp); the first update must equal the path that scores first, and the parity guard still measures the gap."""
    from fastpo import update
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate
    from fastpo.trainer import Trainer

    def first_update(run: str, on_policy: bool):
        monkeypatch.setattr(update, "is_on_policy", lambda kept, size, epochs: on_policy)
        cfg = validate(parse_args([*SMALL, "--trainer.run_dir", str(tmp_path / run), "--trainer.iterations", "1",
                                   "--optim.mini_batch_size", "8", "--trainer.val_before_train", "false",
                                   "--algorithm.old_logprobs", "trainer"]), 1)  # the scoring pass under test
        trainer = Trainer(cfg)
        trainer.step = 1
        metrics = trainer.iteration()
        weights = {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}
        trainer.close(export=False)
        return metrics, weights

    (m_fast, w_fast), (m_ref, w_ref) = first_update("fast", True), first_update("ref", False)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/logprob_gap_mean"):
        assert m_fast[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), key
    assert m_fast["rollout/logprob_gap_mean"] < 1e-4 and m_fast["actor/pg_clipfrac"] == 0.0
    for k in w_ref:
        torch.testing.assert_close(w_fast[k], w_ref[k], atol=1e-6, rtol=0)


def test_first_mini_batch_from_the_update_equals_scoring_every_row(tmp_path, monkeypatch):
    """One epoch over several mini-batches: the scoring pass skips the first mini-batch (its old logprobs are the
    update's first forward, at the sampling weights). The iteration must equal the one that scores every row,
    and the parity guard must judge every row (the scored ones and the first step's)."""
    from fastpo import update
    from fastpo.config_load import parse_args
    from fastpo.preflight import validate
    from fastpo.trainer import Trainer

    def one_iteration(run: str, source: str | None):
        if source is not None:
            monkeypatch.setattr(update, "old_logprob_source", lambda *a, **k: source)
        actor_rows: list[int] = []
        score = Trainer._score

        def spy(self, trajs, kept, actor=True, **kw):
            if actor:
                actor_rows.extend(kept)
            return score(self, trajs, kept, actor=actor, **kw)

        monkeypatch.setattr(Trainer, "_score", spy)
        cfg = validate(parse_args([*SMALL, "--trainer.run_dir", str(tmp_path / run), "--trainer.iterations", "1",
                                   "--optim.mini_batch_size", "4", "--trainer.val_before_train", "false",
                                   "--algorithm.old_logprobs", "trainer"]), 1)
        trainer = Trainer(cfg)
        trainer.step = 1
        metrics = trainer.iteration()
        weights = {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}
        trainer.close(export=False)
        monkeypatch.undo()
        return metrics, weights, actor_rows

    (m_new, w_new, rows_new), (m_ref, w_ref, rows_ref) = one_iteration("new", None), one_iteration("ref", "trainer")
    kept = int(m_ref["rollout/kept_trajectories"])
    assert kept > 4 and len(rows_ref) == kept and len(rows_new) == kept - 4  # one mini-batch of 4 not scored
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/logprob_gap_mean",
                "rollout/logprob_gap_max"):
        assert m_new[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), key
    assert m_new["actor/pg_clipfrac"] == pytest.approx(m_ref["actor/pg_clipfrac"], abs=1e-9)
    # the first mini-batch's ratios are exactly 1 on one side and 1 +- 1e-7 on the other; over 4 AdamW steps a
    # few elements with near-zero second moments carry that float noise further (2 of 16,384 by 6e-5 here)
    for k in w_ref:
        torch.testing.assert_close(w_new[k], w_ref[k], atol=1e-4, rtol=0)
        assert ((w_new[k] - w_ref[k]).abs() > 3e-5).float().mean() < 1e-3, k
