"""vLLM's GPU path, checked on CPU with a stand-in vLLM (no vLLM import, no GPU): what VLLMEngine asks of vLLM on a
CUDA machine (CUDA graphs, a KV cache sized from the batch, a step token budget, the ipc weight-transfer engine),
which weight path it takes for what the installed vLLM offers, the worker context of a reload, and the ipc push.
tests/test_cuda_paths.py has the reload / load_weights paths and the wake order."""

from __future__ import annotations

import contextlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from fastpo.engine import vllm as ev
from fastpo.engine import vllm_weights as vw

# ------------------------------------------------------------------------------------ choosing the push path


def _modules(ipc_engine: bool = True, transfer_field: bool = True, missing: str | None = None):
    """A stand-in ``import_module`` over fake vLLM modules: with or without the ipc engine class and the
    EngineArgs field, or without one module (ImportError)."""
    from dataclasses import field, make_dataclass

    fields = [("model", str, field(default=""))]
    if transfer_field:
        fields.append(("weight_transfer_config", object, field(default=None)))
    mods = {"vllm.distributed.weight_transfer.ipc_engine": SimpleNamespace(
                **({"IPCWeightTransferEngine": object} if ipc_engine else {})),
            "vllm.engine.arg_utils": SimpleNamespace(EngineArgs=make_dataclass("EngineArgs", fields))}

    def import_module(name):
        if name == missing or name not in mods:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return mods[name]

    return import_module


def test_ipc_support_is_read_from_what_vllm_has():
    assert vw.ipc_unavailable_reason(_modules()) is None
    assert "no weight-transfer API" in vw.ipc_unavailable_reason(
        _modules(missing="vllm.distributed.weight_transfer.ipc_engine"))
    assert "no IPCWeightTransferEngine" in vw.ipc_unavailable_reason(_modules(ipc_engine=False))
    assert "no weight_transfer_config" in vw.ipc_unavailable_reason(_modules(transfer_field=False))


def test_auto_takes_ipc_only_on_cuda_with_the_api():
    assert vw.choose_transfer("auto", on_cuda=True, ipc_reason=None) == "ipc"
    assert vw.choose_transfer("auto", on_cuda=True, ipc_reason="old vLLM") == "reload"
    assert vw.choose_transfer("auto", on_cuda=False, ipc_reason=None) == "reload"
    assert vw.choose_transfer("reload", on_cuda=True, ipc_reason=None) == "reload"
    assert vw.choose_transfer("ipc", on_cuda=True, ipc_reason=None) == "ipc"
    with pytest.raises(ValueError, match="needs CUDA"):
        vw.choose_transfer("ipc", on_cuda=False, ipc_reason=None)
    with pytest.raises(ValueError, match="not available: old vLLM"):
        vw.choose_transfer("ipc", on_cuda=True, ipc_reason="old vLLM")
    with pytest.raises(ValueError, match=r"weight_transfer must be one of \('auto', 'ipc', 'reload'\), got 'nccl'"):
        vw.choose_transfer("nccl", on_cuda=True, ipc_reason=None)


# ------------------------------------------------------------------------------------ the worker's context


def test_reload_runs_in_the_workers_config_and_device_context(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def current_config(config):
        entered.append(("config", config))
        yield

    @contextlib.contextmanager
    def cuda_device(device):
        entered.append(("device", str(device)))
        yield

    fake_config = types.ModuleType("vllm.config")
    fake_config.set_current_vllm_config = current_config
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", fake_config)
    monkeypatch.setattr(torch.cuda, "device", cuda_device)

    def reload_weights(weights_iterator):
        entered.append(("reload", [n for n, _ in weights_iterator]))

    worker = SimpleNamespace(vllm_config="cfg", device=torch.device("cuda", 0),
                             model_runner=SimpleNamespace(reload_weights=reload_weights))
    vw.worker_reload_weights(worker, iter([("a", torch.ones(1))]))
    assert entered == [("config", "cfg"), ("device", "cuda:0"), ("reload", ["a"])]
    entered.clear()
    worker.device = torch.device("cpu")  # a CPU worker: the config only
    vw.worker_reload_weights(worker, iter([("b", torch.ones(1))]))
    assert entered == [("config", "cfg"), ("reload", ["b"])]


# ------------------------------------------------------------------------------------ the ipc push


class _IpcLLM:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "update_weights":
            names = kwargs["update_info"]["names"]
            if self.fail_at is not None and len([c for c in self.calls if c[0] == "update_weights"]) == self.fail_at:
                raise RuntimeError("worker failed")
            self.calls.append((method, names))
        else:
            self.calls.append((method,))
        return [None]


def test_ipc_push_is_one_session_with_a_call_per_bucket(monkeypatch):
    monkeypatch.setattr(vw, "ipc_update_info", lambda bucket: ({"names": [n for n, _ in bucket]}, []))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    llm = _IpcLLM()
    vw.push_ipc(llm, [[("l0.a", None), ("l0.b", None)], [("l1.a", None)]])
    assert llm.calls == [("start_weight_update",), ("update_weights", ["l0.a", "l0.b"]),
                         ("update_weights", ["l1.a"]), ("finish_weight_update",)]
    llm = _IpcLLM(fail_at=1)
    with pytest.raises(RuntimeError, match="worker failed"):  # the worker's error, not finish's
        vw.push_ipc(llm, [[("l0.a", None)], [("l1.a", None)]])
    assert llm.calls[-1] == ("finish_weight_update",)


def test_engine_pushes_through_ipc_when_chosen(monkeypatch):
    pushed = []
    monkeypatch.setattr(ev, "push_ipc", lambda llm, buckets: pushed.append([[n for n, _ in b] for b in buckets]))
    engine = object.__new__(ev.VLLMEngine)
    engine.llm = SimpleNamespace(reset_prefix_cache=lambda: pushed.append("reset"))
    engine.bucket_bytes, engine._engine_dtype, engine.weight_transfer = 1, torch.bfloat16, "ipc"
    engine._inplace_reload, engine._weightless_layers = False, set()  # ipc does not depend on the reload probe
    engine.push_weights({"model.layers.0.a": torch.ones(2), "model.layers.1.a": torch.ones(2)})
    assert pushed == [[["model.layers.0.a"], ["model.layers.1.a"]], "reset"]


def test_engine_refuses_to_keep_caches_across_a_push():
    """rollout.partial_kv keep is the built-in engine's: vLLM's sync_weights refuses keep_cache before it pushes."""
    engine = object.__new__(ev.VLLMEngine)
    engine.llm = SimpleNamespace(reset_prefix_cache=lambda: pytest.fail("nothing may be pushed or reset"))
    with pytest.raises(ValueError, match=r"VLLMEngine.sync_weights\(keep_cache=True\): vLLM holds no session's KV"):
        engine.sync_weights({"model.layers.0.a": torch.ones(2)}, keep_cache=True)


# ------------------------------------------------------------------------------------ what vLLM is asked for


def test_kv_cache_bytes_for_a_batch():
    config = SimpleNamespace(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, num_hidden_layers=24)
    per_token = 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 KV heads of 64, bf16: 12 KiB (Qwen2.5-0.5B)
    # 1000 tokens are 63 blocks of 16, plus one spare block per sequence
    assert ev.kv_cache_bytes_for_batch(config, torch.bfloat16, 128, 1000) == 128 * 64 * 16 * per_token
    with pytest.raises(ValueError, match="num_seqs and max_model_len must be >= 1, got 0 and 1000"):
        ev.kv_cache_bytes_for_batch(config, torch.bfloat16, 0, 1000)


class _Worker:
    def __init__(self, ipc: bool, log: list):
        self.device = torch.device("cpu")
        model = SimpleNamespace(modules=lambda: iter(()))
        self.model_runner = SimpleNamespace(get_model=lambda: model, reload_weights=lambda weights_iterator: None)
        if ipc:
            self.weight_transfer_engine = object()
            for name in vw.IPC_WORKER_METHODS:
                setattr(self, name, lambda *a, _name=name, **k: log.append((_name, k)))


class _LLM:
    """vllm.LLM's surface that VLLMEngine's constructor uses; records its keyword arguments."""

    workers_have_ipc = True
    log: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.worker = _Worker(self.workers_have_ipc, self.log)
        model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=False),
                                       get_vocab_size=lambda: 100, max_model_len=kwargs.get("max_model_len", 512),
                                       dtype=torch.bfloat16)
        scheduler = SimpleNamespace(max_num_seqs=kwargs.get("max_num_seqs", 256))
        self.llm_engine = SimpleNamespace(model_config=model_config,
                                          vllm_config=SimpleNamespace(scheduler_config=scheduler))

    def collective_rpc(self, method, args=(), kwargs=None):
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a,
                                                                                                 **k))
        return [fn(*args, **(kwargs or {}))]


@pytest.fixture
def fake_gpu_vllm(monkeypatch):
    """A vLLM that reports CUDA, on a "GPU" of 80 GiB; the model's config is Qwen2.5-0.5B's attention shape."""
    vllm = types.ModuleType("vllm")
    vllm.LLM = _LLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: False, is_cuda_alike=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * 2**30, 80 * 2**30))
    config = SimpleNamespace(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, num_hidden_layers=24,
                             dtype=torch.bfloat16)
    monkeypatch.setattr(ev, "_text_config", lambda path: config)
    monkeypatch.setattr(ev, "ipc_unavailable_reason", lambda: None)
    _LLM.log, _LLM.workers_have_ipc = [], True
    return config


def test_gpu_engine_asks_vllm_for_graphs_a_batch_sized_cache_and_ipc(fake_gpu_vllm):
    engine = ev.VLLMEngine("/no/model", None, dtype="bfloat16", max_model_len=1000, max_num_seqs=128)
    kwargs = engine.llm.kwargs
    assert kwargs["enforce_eager"] is False  # CUDA graphs for decoding
    assert kwargs["kv_cache_memory_bytes"] == ev.kv_cache_bytes_for_batch(fake_gpu_vllm, torch.bfloat16, 128, 1000)
    assert "gpu_memory_utilization" not in kwargs
    assert kwargs["max_num_seqs"] == 128 and kwargs["max_num_batched_tokens"] == 16384  # min(128 x 1000, 16384)
    assert kwargs["weight_transfer_config"] == {"backend": "ipc"} and engine.weight_transfer == "ipc"
    assert ("init_weight_transfer_engine", {"init_info": {"packed": False}}) in _LLM.log
    # a small batch: the token budget is the batch's tokens; tests pass enforce_eager=True
    engine = ev.VLLMEngine("/no/model", None, dtype="bfloat16", max_model_len=100, max_num_seqs=4,
                           enforce_eager=True, weight_transfer="reload")
    assert engine.llm.kwargs["max_num_batched_tokens"] == 400 and engine.llm.kwargs["enforce_eager"] is True
    assert "weight_transfer_config" not in engine.llm.kwargs and engine.weight_transfer == "reload"


def test_gpu_engine_caps_the_cache_and_falls_back_without_worker_support(fake_gpu_vllm):
    _LLM.workers_have_ipc = False
    engine = ev.VLLMEngine("/no/model", None, dtype="bfloat16", max_model_len=32768, max_num_seqs=4096,
                           gpu_memory_utilization=0.5)
    assert engine.llm.kwargs["kv_cache_memory_bytes"] == 40 * 2**30  # 0.5 of 80 GiB: the batch would need more
    assert engine.weight_transfer == "reload"  # the LLM has the config, its workers no transfer engine
    with pytest.raises(ValueError, match="workers have no weight-transfer engine"):
        ev.VLLMEngine("/no/model", None, dtype="bfloat16", max_num_seqs=4, max_model_len=64, weight_transfer="ipc")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        ev.VLLMEngine("/no/model", None, max_num_seqs=0)


def test_without_a_batch_gpu_memory_utilization_decides(fake_gpu_vllm):
    kwargs = ev.VLLMEngine("/no/model", None, dtype="bfloat16", gpu_memory_utilization=0.3).llm.kwargs
    assert kwargs["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in kwargs
    assert "max_num_batched_tokens" not in kwargs
