"""Model options of fastpo.config.ModelConfig: attn_implementation, liger_kernel and meta_init.

CPU only: the GPU paths (flash_attention_2, Liger's Triton kernels) are checked through their error messages and, for
Liger, through the patch function picked for an architecture (the patch itself is mocked). Meta init runs under
torchrun with 2 ranks (gloo): every rank's full parameters and buffers equal a single-process load, and a short
deterministic training run gives the same metrics and weights with and without it.
"""

import inspect
import json
import os
import sys
import textwrap

import pytest
import torch
from test_trainer import GAE_DET, _metrics, _ok, _weights, gae_two_updates_two_ranks

import fastpo.model as fm
from fastpo.config import ConfigError
from fastpo.config_load import parse_args
from fastpo.fsdp import non_persistent_buffers
from fastpo.preflight import validate
from fastpo.testing import run_killable

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 (tied embeddings) saved to a folder; returns the folder."""
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path, build_tiny_tokenizer(path), hidden=32, layers=2, heads=2, kv_heads=1)
    return path


# ------------------------------------------------------------------------------------------- attn_implementation
@pytest.mark.parametrize("flash", [False, True], ids=["no-flash_attn", "flash_attn"])
def test_resolve_attn_implementation(monkeypatch, flash):
    monkeypatch.setattr(fm, "_flash_attn_imports", lambda: flash)
    assert fm.resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert fm.resolve_attn_implementation("auto", torch.device("cuda", 0)) == ("flash_attention_2" if flash else
                                                                               "sdpa")
    for choice in ("sdpa", "eager"):
        assert fm.resolve_attn_implementation(choice, "cpu") == choice
    with pytest.raises(ValueError, match=r"model.attn_implementation='flash_attention_2' needs a CUDA device.*cpu"):
        fm.resolve_attn_implementation("flash_attention_2", "cpu")
    if flash:
        assert fm.resolve_attn_implementation("flash_attention_2", "cuda") == "flash_attention_2"
    else:
        with pytest.raises(ValueError, match="flash_attn package does not import; pip install flash-attn"):
            fm.resolve_attn_implementation("flash_attention_2", "cuda")
    with pytest.raises(ValueError, match=r"must be one of \['auto', 'sdpa', 'eager', 'flash_attention_2'\]"):
        fm.resolve_attn_implementation("flash", "cpu")


def test_flash_attn_import_failure_counts_as_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    assert not fm._flash_attn_imports()


def test_load_policy_attn_implementation(tiny):
    auto = "sdpa" if not torch.cuda.is_available() else fm.resolve_attn_implementation("auto")
    assert fm.load_policy(tiny, attn_implementation="auto").config._attn_implementation == auto
    assert fm.load_critic(tiny, attn_implementation="eager").backbone.config._attn_implementation == "eager"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="model.attn_implementation='flash_attention_2' needs a CUDA device"):
            fm.load_policy(tiny, attn_implementation="flash_attention_2")


def _hide_package(monkeypatch, package: str) -> None:
    """importlib.util.find_spec(package) -> None (what config validation sees when it is not installed)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


def test_config_attn_implementation(monkeypatch):
    cfg = validate(parse_args(["--preset", "tiny"]), 1)
    assert cfg.model.attn_implementation == "auto"
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        validate(parse_args(["--preset", "tiny", "--model.attn_implementation", "flash"]), 1)
    _hide_package(monkeypatch, "flash_attn")
    with pytest.raises(ConfigError, match=r"flash_attention_2 needs the flash_attn package \(pip install flash-attn"):
        validate(parse_args(["--preset", "tiny", "--model.attn_implementation", "flash_attention_2"]), 1)


# ------------------------------------------------------------------------------------------------- liger_kernel
def test_liger_kernel_needs_a_gpu(tiny):
    with pytest.raises(ValueError, match=r"model.liger_kernel=true needs a CUDA GPU .* uses cpu"):
        fm.apply_liger_kernel(tiny, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="model.liger_kernel=true needs a CUDA GPU"):
            fm.load_policy(tiny, liger_kernel=True)


def test_liger_kernel_missing_package(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    with pytest.raises(ImportError, match="liger-kernel is not installed; pip install liger-kernel"):
        fm.apply_liger_kernel(tiny, "cuda")  # the device is only a name here: nothing runs on it


def test_config_liger_kernel_missing_package(monkeypatch):
    _hide_package(monkeypatch, "liger_kernel")
    with pytest.raises(ConfigError, match=r"model.liger_kernel=true needs the liger-kernel package \(pip install"):
        validate(parse_args(["--preset", "tiny", "--model.liger_kernel", "true"]), 1)


def test_liger_patch_looked_up_for_the_model_type(tiny, monkeypatch):
    """qwen2 -> apply_liger_kernel_to_qwen2 called with RoPE / RMSNorm / SwiGLU on and both cross-entropies off (the
    real patch is replaced by a recorder with its signature); an unknown architecture lists the supported ones."""
    pytest.importorskip("liger_kernel", reason="liger-kernel not installed")
    from liger_kernel.transformers import monkey_patch

    assert fm.liger_patch_function("qwen2") is monkey_patch.apply_liger_kernel_to_qwen2
    assert fm.liger_patch_function("llama") is monkey_patch.apply_liger_kernel_to_llama
    calls = []

    def record(**kwargs):
        calls.append(kwargs)

    record.__signature__ = inspect.signature(monkey_patch.apply_liger_kernel_to_qwen2)
    monkeypatch.setitem(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, "qwen2", record)
    assert fm.apply_liger_kernel(tiny, "cuda") == "qwen2"
    assert calls == [{"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                      "fused_linear_cross_entropy": False}]  # no `geglu`: not a parameter of the qwen2 patch
    with pytest.raises(ValueError, match=r"no patches for model_type 'gpt2'; supported: \[.*'qwen2'"):
        fm.liger_patch_function("gpt2")


# ---------------------------------------------------------------------------------------------------- meta init
def test_meta_build_matches_the_loaded_architecture(tiny):
    for load in (fm.load_policy, fm.load_critic):
        real, meta = load(tiny), load(tiny, meta=True)
        assert all(p.is_meta for p in meta.parameters()) and all(b.is_meta for b in meta.buffers())
        shapes = {k: (v.shape, v.dtype) for k, v in real.state_dict().items()}
        assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == shapes
        assert non_persistent_buffers(real).keys() == non_persistent_buffers(meta).keys()
        assert len(non_persistent_buffers(real)) > 0  # rotary inv_freq: not in the state dict
    meta = fm.load_policy(tiny, meta=True)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight  # tied like the loaded model
    with pytest.raises(ValueError, match="meta=True does not support LoRA"):
        fm.load_policy(tiny, meta=True, lora_rank=4)


WORKER = textwrap.dedent('''
    import sys

    import torch

    import fastpo.model as fm
    from fastpo import distributed as du
    from fastpo.fsdp import full_state_dict, load_sharded

    torch.set_num_threads(1)
    path, out, meta_init = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    info = du.init()
    reads, build = [], fm._build
    fm._build = lambda cls, name, kwargs, meta: reads.append(not meta) or build(cls, name, kwargs, meta)
    policy = load_sharded(lambda meta: fm.load_policy(path, meta=meta), info.device, meta_init)
    critic = load_sharded(lambda meta: fm.load_critic(path, head_seed=3, meta=meta), info.device, meta_init,
                          activation_checkpointing=True)
    result = {"reads": sum(reads), "tied": policy.lm_head.weight is policy.model.embed_tokens.weight}
    for name, model in (("policy", policy), ("critic", critic)):
        result[name] = {
            "params": {k: v.clone() for k, v in full_state_dict(model).items()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "sharded": all(hasattr(p, "full_tensor") for p in model.parameters()),
        }
    # one forward + backward through the sharded critic: the broadcast weights are usable
    ids = torch.arange(12).reshape(2, 6) % 50
    critic(ids).sum().backward()
    result["grad_finite"] = all(torch.isfinite(p.grad.full_tensor()).all().item() for p in critic.parameters())
    torch.save(result, f"{out}.{info.rank}.pt")
    du.shutdown()
''')


def _torchrun_script(script, *args: str, cwd, timeout: float = 240) -> None:
    """torchrun --standalone with 2 ranks; cwd outside the repo (see tests/test_trainer.py::_run); kills the whole
    process group on timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    rc, out, err = run_killable(cmd, cwd, env, timeout)
    assert rc == 0, (out + err)[-5000:]


@pytest.mark.slow
def test_meta_init_two_ranks_equals_a_single_process_load(tiny, tmp_path):
    """2 ranks, meta init: rank 0 alone reads the checkpoint; afterwards every rank's full parameters and buffers
    (rotary inv_freq included) equal a single-process load, the embeddings stay tied, and the critic trains."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    _torchrun_script(script, str(tiny), str(tmp_path / "out"), "1", cwd=tmp_path)
    expected = {"policy": fm.load_policy(tiny), "critic": fm.load_critic(tiny, head_seed=3)}
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.{rank}.pt")
        assert got["reads"] == (2 if rank == 0 else 0), rank
        assert got["tied"] and got["grad_finite"]
        for name, model in expected.items():
            assert got[name]["sharded"]
            params = dict(model.state_dict())
            assert got[name]["params"].keys() == params.keys(), (rank, name)
            for k, v in params.items():
                assert torch.equal(got[name]["params"][k], v), (rank, name, k)
            buffers = dict(model.named_buffers())
            assert got[name]["buffers"].keys() == buffers.keys() and len(buffers) > 0
            for k, v in buffers.items():
                assert torch.equal(got[name]["buffers"][k], v), (rank, name, k)


@pytest.mark.slow
def test_meta_init_training_equals_the_normal_load(tmp_path, shared_run):
    """torchrun, 2 ranks, deterministic, GAE (actor + critic), 2 iterations: meta init on and off give the same
    metrics and final weights, bit for bit. The meta-init run is test_trainer's (shared): meta init is the default."""
    meta = gae_two_updates_two_ranks(shared_run)
    assert json.loads((meta / "config.json").read_text())["model"]["meta_init"] is True
    _ok([*GAE_DET, "--trainer.iterations", "2", "--model.meta_init", "false"], tmp_path / "plain", nproc=2)
    a, b = _metrics(meta), _metrics(tmp_path / "plain")
    keys = [k for k in a[-1] if k.startswith(("actor/", "critic/", "rollout/reward", "rollout/logprob_gap"))]
    assert "critic/vf_loss" in keys and "actor/pg_loss" in keys
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra.get(k) for k in keys} == {k: rb.get(k) for k in keys}
    wa, wb = _weights(meta / "hf"), _weights(tmp_path / "plain" / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
