"""The CUDA training path's defects, checked on CPU: what a GPU run would hit first.

- the critic's value head under FSDP2 with a bf16 ``MixedPrecisionPolicy`` (FSDP2 on a world-1 gloo process group
  in this process: the same ``fully_shard`` units and policy as torchrun on CUDA, on CPU tensors);
- fp32 master weights and AdamW states whenever ``model.dtype`` is lower than fp32, without torchrun;
- ``attn_implementation="auto"`` resolved by the compute dtype (flash-attn availability faked);
- packed rows under flash_attention_2 carrying ``cu_seq_lens_q/k`` and ``max_length_q/k`` down to every layer;
- the vLLM weight sync: the ``load_weights`` fallback for releases without in-place reload, buckets cast to the
  engine dtype with tied weights gathered once, the probed reload being the one called, ``empty_cache`` before
  each wake (vLLM faked: no vLLM needed; tests/test_vllm_gpu_path.py has the rest of vLLM's GPU path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fastpo.model as fm
from fastpo import distributed as du
from fastpo import fsdp


@pytest.fixture
def world1():
    """A world-1 gloo process group for this test only (FSDP2 needs one); destroyed afterwards."""
    assert not du.is_distributed(), "a process group leaked from another test"
    assert fsdp.init_single_rank_group("cpu")
    assert not fsdp.init_single_rank_group("cpu")  # idempotent: an existing group is kept
    try:
        yield
    finally:
        du.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path, build_tiny_tokenizer(path), hidden=32, layers=2, heads=2, kv_heads=1)
    return path


# ------------------------------------------------------------------------------------- device and mesh choice
@pytest.mark.parametrize("backend", [None, "gloo", "nccl"])
def test_mesh_and_device_follow_the_backend_on_a_cuda_machine(backend, monkeypatch):
    """On a machine where CUDA is available (stood in), rank 1 of 2 on a 1-GPU box: gloo (pinned, as the CPU-rank
    tests do) gets a cpu device, never set_device(1), and a CPU mesh; nccl (the default there) gets cuda:1 and a
    CUDA mesh. Only a CUDA machine would show a regression otherwise."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(du, "is_distributed", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(("group", backend)))
    for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(key, value)
    info = du.init(backend=backend)
    chosen = backend or "nccl"
    assert ("group", chosen) in calls
    assert (("set_device", 1) in calls) == (chosen == "nccl")
    assert info.device == (torch.device("cuda", 1) if chosen == "nccl" else torch.device("cpu"))

    import torch.distributed.device_mesh as device_mesh

    monkeypatch.setattr(dist, "get_backend", lambda: chosen)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda device_type, shape: (device_type, shape))
    assert fsdp._mesh() == ("cuda" if chosen == "nccl" else "cpu", (2,))


# ------------------------------------------------------------------------------------------------- T1: critic
@pytest.mark.parametrize("cuda_visible", [False, True], ids=["cpu_machine", "cuda_machine"])
def test_critic_value_head_runs_in_fp32_under_bf16_mixed_precision(world1, tiny, cuda_visible, monkeypatch):
    """Before the fix the root unit's bf16 policy cast the head's weight to bf16 while CriticModel fed it fp32
    hidden states: "mat1 and mat2 must have the same dtype" at the first forward. cuda_machine: CUDA reported
    available (a stand-in for a GPU machine); the gloo ranks' mesh must stay on CPU (FSDP2's default mesh would be
    on CUDA and move the critic there)."""
    if cuda_visible:  # what torch reports on a GPU machine (FSDP2's default mesh asks for the accelerator)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = fm.load_critic(tiny, dtype="float32", head_seed=1)
    with torch.no_grad():
        expected = reference(ids)
    critic = fsdp.shard_model(fm.load_critic(tiny, dtype="float32", head_seed=1), mixed_precision=torch.bfloat16)
    seen = {}
    critic.value_head.register_forward_hook(lambda m, args, out: seen.update(x=args[0].dtype, w=m.weight.dtype))
    critic.backbone.register_forward_hook(lambda m, args, out: seen.update(h=out.last_hidden_state.dtype))
    values = critic(ids)
    assert seen == {"h": torch.bfloat16, "x": torch.float32, "w": torch.float32}
    assert values.dtype == torch.float32 and values.shape == (2, 12)
    # bf16 backbone, fp32 head: close to the fp32 critic, not equal to it
    assert torch.allclose(values, expected, atol=2e-2, rtol=0.0) and not torch.equal(values, expected)
    values.square().mean().backward()
    head_grad = critic.value_head.weight.grad
    assert head_grad is not None and head_grad.dtype == torch.float32 and torch.isfinite(head_grad.full_tensor()).all()
    assert all(p.dtype == torch.float32 for p in critic.parameters())  # master weights stay fp32


def test_world_one_keeps_gathered_layers_and_cuda_adam_is_fused(world1, tiny):
    policy = fsdp.shard_model(fm.load_policy(tiny, dtype="float32"), mixed_precision=torch.bfloat16)
    layer = fsdp.decoder_layers(policy)[0]
    group = layer._get_fsdp_state()._fsdp_param_group
    assert group.post_forward_mesh_info is None  # reshard_after_forward=False at world 1
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert fsdp.make_adamw(params, "cuda", lr=1e-3).defaults["fused"] is True
    assert not fsdp.make_adamw(params, "cpu", lr=1e-3).defaults["fused"]


# ----------------------------------------------------------------------------------- T2: fp32 master weights
def test_bf16_compute_keeps_fp32_master_weights_and_adam_states(tmp_path):
    """One process without torchrun, model.dtype bfloat16, GAE (actor + critic), lr 1e-6: the models hold fp32
    parameters, AdamW fp32 states, the forward computes in bf16, and the update moves nearly every weight. Before the
    fix the parameters were bf16 and ~99% of the updates rounded away (bf16's ulp at 0.02 is 1.2e-4)."""
    from fastpo.presets import get_preset
    from fastpo.trainer import Trainer

    cfg = get_preset("tiny")
    cfg.model.dtype = "bfloat16"
    cfg.env.names, cfg.env.kwargs = ("bandit",), {}  # pure Python: also runs from a bare copy (bench/gpu_suite.sh)
    cfg.algorithm.adv_estimator, cfg.algorithm.rollout_filter_ratio = "gae", 1.0
    cfg.env.env_groups, cfg.env.group_size, cfg.env.val_groups, cfg.env.max_turns = 2, 2, 2, 1
    cfg.optim.actor_lr = cfg.optim.critic_lr = 1e-6
    cfg.optim.mini_batch_size, cfg.optim.warmup_steps = 4, 0
    cfg.trainer.iterations, cfg.trainer.val_every, cfg.trainer.val_before_train = 1, 0, False
    cfg.trainer.run_dir = str(tmp_path / "run")
    assert not du.is_distributed()
    trainer = Trainer(cfg)
    try:
        assert du.is_distributed() and dist.get_world_size() == 1  # the world-1 group FSDP2 needs
        for model in (trainer.actor, trainer.critic):
            assert {p.dtype for p in model.parameters()} == {torch.float32}
        before = {n: p.full_tensor().detach().clone() for n, p in trainer.actor.named_parameters()}
        trainer.step = 1
        trainer.iteration()
        for optim in (trainer.models.actor_optim, trainer.models.critic_optim):
            states = [s for st in optim.state.values() for s in (st["exp_avg"], st["exp_avg_sq"])]
            assert states and {s.dtype for s in states} == {torch.float32}
        changed = total = 0
        for n, p in trainer.actor.named_parameters():
            diff = p.full_tensor().detach() != before[n]
            changed, total = changed + int(diff.sum()), total + diff.numel()
        assert changed > 0.9 * total, f"only {changed} of {total} weights moved at lr 1e-6"
    finally:
        trainer.close(export=False)
        du.shutdown()


# --------------------------------------------------------------------------------------- T3: auto attention
@pytest.mark.parametrize("dtype,expected", [("float32", "sdpa"), ("bfloat16", "flash_attention_2"),
                                            ("float16", "flash_attention_2")])
def test_auto_attention_is_resolved_by_compute_dtype(monkeypatch, dtype, expected):
    monkeypatch.setattr(fm, "_flash_attn_imports", lambda: True)
    assert fm.resolve_attn_implementation("auto", "cuda", dtype) == expected
    assert fm.resolve_attn_implementation("auto", "cpu", dtype) == "sdpa"
    # the loader resolves "auto" by the dtype it loads in
    monkeypatch.setattr(fm, "_default_device", lambda: torch.device("cuda"))
    assert fm._load_kwargs(dtype, "auto", False)["attn_implementation"] == expected


def test_flash_attention_with_fp32_compute_is_refused(monkeypatch):
    monkeypatch.setattr(fm, "_flash_attn_imports", lambda: True)
    with pytest.raises(ValueError, match=r"needs model.dtype bfloat16 or float16 \(flash-attn rejects torch.float32"):
        fm.resolve_attn_implementation("flash_attention_2", "cuda", "float32")
    assert fm.resolve_attn_implementation("flash_attention_2", "cuda", "bfloat16") == "flash_attention_2"


# ------------------------------------------------------------------------------------ T4: varlen boundaries
def _samples(lengths, seed=0):
    from fastpo.rollout import Trajectory

    rng = np.random.default_rng(seed)
    return [Trajectory(rng.integers(3, 200, n).astype(np.int64), np.zeros(n, bool), group=i)
            for i, n in enumerate(lengths)]


def test_packed_flash_rows_carry_varlen_boundaries(tiny, monkeypatch):
    """Every attention layer of the actor and the critic receives cu_seq_lens_q/k (int32) and max_length_q/k (int)
    equal to what transformers would re-derive from the position ids (flash_attention_2 replaced by a recorder that
    checks them and runs sdpa per trajectory); the outputs equal each trajectory's forward alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from fastpo.microbatch import pack

    samples = _samples([7, 12, 5])
    (mb,) = pack(samples, [0, 1, 2], 100, torch.device("cpu"), "packed")
    (cu_ref, _), (max_ref, _) = prepare_fa_kwargs_from_position_ids(mb.position_ids)
    calls = []

    def recorder(module, q, k, v, attention_mask, **kwargs):
        cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        assert torch.equal(cu, kwargs["cu_seq_lens_k"]) and cu.dtype == torch.int32
        assert isinstance(max_len, int) and max_len == kwargs["max_length_k"]
        calls.append((cu.tolist(), max_len))
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            o, _ = sdpa_attention_forward(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, is_causal=True,
                                          scaling=kwargs.get("scaling"))
            outs.append(o)
        return torch.cat(outs, dim=1), None

    policy, critic = fm.load_policy(tiny, attn_implementation="sdpa"), fm.load_critic(tiny, attn_implementation="sdpa")
    for model, decoder in ((policy, policy.model), (critic, critic.backbone)):
        with torch.no_grad():
            assert "cu_seq_lens_q" not in mb.model_inputs(model)  # sdpa re-derives nothing: no extra kwargs
            expected = torch.cat([decoder(input_ids=torch.from_numpy(x.input_ids)[None]).last_hidden_state
                                  for x in samples], dim=1)
            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", recorder)
            decoder.config._attn_implementation = "flash_attention_2"
            inputs = mb.model_inputs(model)
            assert inputs["max_length_q"] == 12 and inputs["cu_seq_lens_q"].tolist() == [0, 7, 19, 24]
            calls.clear()
            got = decoder(**inputs).last_hidden_state
            model(**inputs)  # the root forward the trainer runs (CriticModel.forward passes them to its backbone)
        assert calls == [(cu_ref.tolist(), int(max_ref))] * 4  # 2 layers, 2 forwards
        assert torch.allclose(got, expected, atol=1e-5)
        monkeypatch.undo()


# -------------------------------------------------------------------------------------------- vLLM weight sync
class _Model:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded.extend((name, t.dtype, t.clone()) for name, t in weights)


class _Runner:
    def __init__(self, inplace: bool):
        self.model = _Model()
        self.reloaded = []  # the tensor names each in-place reload received
        if inplace:
            self.reload_weights = lambda weights_iterator=None, weights_path=None: self.reloaded.append(
                [name for name, _ in weights_iterator])

    def get_model(self):
        return self.model


class _OldRunner(_Runner):
    def reload_weights(self, weights_path=None):  # an older release: no weights_iterator
        raise AssertionError("must not be called")


class _Worker:
    def __init__(self, runner):
        self.model_runner = runner

    def reload_weights(self, weights_path=None):  # not what the probe reads: must never be called
        raise AssertionError("the push must call the reload_weights the probe inspected (the model runner's)")


class _LLM:
    def __init__(self, worker, log):
        self.worker, self.log = worker, log

    def collective_rpc(self, method, args=(), kwargs=None):
        self.log.append(method if isinstance(method, str) else method.__name__)
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")

    def wake_up(self, tags):
        self.log.append(f"wake_up:{tags[0]}")


class _Gathered:
    """A sharded-tensor stand-in: counts its gathers."""

    def __init__(self, t):
        self.t, self.gathers = t, 0
        self.dtype, self.shape = t.dtype, t.shape

    def numel(self):
        return self.t.numel()

    def element_size(self):
        return self.t.element_size()

    def full_tensor(self):
        self.gathers += 1
        return self.t


def _engine(worker, log, dtype=torch.bfloat16):
    from fastpo.engine.vllm import VLLMEngine
    from fastpo.engine.vllm_weights import worker_reload_takes_iterator

    engine = object.__new__(VLLMEngine)
    engine.llm, engine.bucket_bytes, engine._engine_dtype = _LLM(worker, log), 64, dtype
    engine._inplace_reload = worker_reload_takes_iterator(worker)
    engine._checkpoint_names, engine._asleep, engine._version = None, None, 0
    engine._tied, engine._weightless_layers, engine._on_cpu = False, set(), False
    return engine


def test_reload_support_is_read_from_the_worker():
    from fastpo.engine.vllm_weights import worker_reload_takes_iterator

    assert worker_reload_takes_iterator(_Worker(_Runner(inplace=True)))
    assert not worker_reload_takes_iterator(_Worker(_OldRunner(inplace=False)))
    assert not worker_reload_takes_iterator(_Worker(_Runner(inplace=False)))
    assert not worker_reload_takes_iterator(object())


def test_old_vllm_gets_weights_through_load_weights_in_engine_dtype_tied_gathered_once():
    worker, log = _Worker(_OldRunner(inplace=False)), []
    engine = _engine(worker, log)
    embed = _Gathered(torch.randn(10, 4))
    state = {"model.embed_tokens.weight": embed, "model.layers.0.mlp.weight": torch.randn(4, 4),
             "model.layers.0.step": torch.arange(3), "lm_head.weight": embed}
    engine.push_weights(state)
    assert log == ["worker_load_weights", "reset_prefix_cache"]
    loaded = worker.model_runner.model.loaded
    assert [n for n, _, _ in loaded] == list(state)
    assert [d for _, d, _ in loaded] == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16]
    assert torch.equal(loaded[0][2], embed.t.bfloat16()) and torch.equal(loaded[3][2], loaded[0][2])
    assert embed.gathers == 1
    assert torch.equal(loaded[2][2], torch.arange(3))


def test_new_vllm_keeps_in_place_reload_through_the_probed_method():
    # the worker's own reload_weights takes no weights_iterator (it raises if called): the probe read the model
    # runner's, and the push calls that same one
    worker, log = _Worker(_Runner(inplace=True)), []
    _engine(worker, log).push_weights({"model.norm.weight": torch.ones(4)})
    assert log == ["worker_reload_weights", "reset_prefix_cache"]
    assert worker.model_runner.reloaded == [["model.norm.weight"]]


def test_cuda_cache_is_emptied_before_waking(monkeypatch):
    from fastpo.engine import vllm as ev

    log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    monkeypatch.setattr(ev.gc, "collect", lambda: log.append("gc"))
    engine = _engine(_Worker(_Runner(inplace=True)), log)
    engine._asleep = 1
    assert engine.sync_weights({"model.norm.weight": torch.ones(4)}) == 1
    # cached blocks go back before each wake: the weights', then (after the push freed its buckets) the KV cache's
    assert log[:4] == ["gc", "empty_cache", "wake_up:weights", "worker_reload_weights"]
    assert log[log.index("worker_reload_weights") + 1:] == ["reset_prefix_cache", "gc", "empty_cache",
                                                            "wake_up:kv_cache", "reset_prefix_cache",
                                                            "_worker_set_version"]
    log.clear()
    engine._asleep = 1
    engine.wake_up()
    assert log == ["gc", "empty_cache", "wake_up:weights", "wake_up:kv_cache"]


def test_vllm_extra_is_pinned_to_the_supported_range():
    from pathlib import Path

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    (req,) = meta["project"]["optional-dependencies"]["vllm"]
    spec = SpecifierSet(req.removeprefix("vllm"))
    assert Version("0.32.0") in spec and Version("0.10.1") not in spec and Version("1.0") not in spec
