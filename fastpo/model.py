"""Load the policy, the critic and the tokenizer from a local directory or a Hugging Face hub id.

    tok = load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")          # padding side left, pad token set
    policy = load_policy(path, dtype="bfloat16", gradient_checkpointing=True)
    critic = load_critic(path, dtype="bfloat16")                # backbone + nn.Linear(hidden, 1) -> values [B, T]
    hidden, weight, bias = policy_hidden_states(policy, input_ids, attention_mask)
    logp = fastpo.kernels.fused_linear_logprob(hidden, weight, targets, bias, temperature=T)  # no [B, T, V] logits
    policy = load_policy(path, lora_rank=8, lora_alpha=16)      # peft LoRA: base frozen, adapters trainable
    state = merged_state_dict(policy)                           # plain names, W + alpha/r * B @ A (model untouched)
    attn = resolve_attn_implementation("auto", device, "bfloat16")  # flash_attention_2 for bf16 / fp16 on CUDA
    policy = load_policy(path, liger_kernel=True)               # Liger RMSNorm / RoPE / SwiGLU (CUDA only)
    skeleton = load_policy(path, meta=True)                     # parameters on the meta device, nothing read

Every loader finds its model with ``fastpo.model_path.resolve_model_path`` ("tiny", a run folder, a model folder or
a hub id; offline, a hub id must be in the Hugging Face cache): a bad path or id is one ValueError line at once.

transformers 5.x: ``dtype=`` (not ``torch_dtype=``); fast tokenizers reload as ``TokenizersBackend``.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .model_path import resolve_model_path

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
VALUE_HEAD_FILE = "value_head.safetensors"
#: ``model.attn_implementation`` choices; "auto" is resolved by :func:`resolve_attn_implementation`.
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")
#: Liger-Kernel patches fastpo applies (keyword arguments of ``apply_liger_kernel_to_<arch>``, passed where the
#: function has them): RMSNorm, RoPE and the gated MLP. Never its (fused linear) cross-entropy: fastpo computes
#: logprobs from hidden states with ``fastpo.kernels.fused_linear_logprob`` and never builds logits, and Liger's
#: fused-linear-CE forward would replace the causal LM's forward that the trainer hooks.
LIGER_PATCHES = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A torch dtype from a dtype or one of "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be a floating dtype in {sorted(set(_DTYPES.values()), key=str)}, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; accepted: {sorted(_DTYPES)} or a torch floating dtype")


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _flash_attn_imports() -> bool:
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError):  # absent, or built against another torch / CUDA (undefined symbols)
        return False
    return True


#: Compute dtypes flash-attn kernels take (it rejects fp32 inputs).
FLASH_ATTN_DTYPES = (torch.bfloat16, torch.float16)


def resolve_attn_implementation(requested: str, device: torch.device | str | None = None,
                                dtype: torch.dtype | str | None = None) -> str:
    """The attention implementation to load models with (``model.attn_implementation``).

    Args:
        requested: "auto", "sdpa", "eager" or "flash_attention_2".
        device: where the model will run; None = CUDA when available, else CPU.
        dtype: the compute dtype of attention (``model.dtype``: under mixed precision the compute dtype, not the
            fp32 master weights'); None = not known here, device and package alone decide.

    Returns:
        "auto" -> "flash_attention_2" when the compute dtype is bf16 or fp16, the device is CUDA and the
        ``flash_attn`` package imports, else "sdpa"; any other choice as is.

    Raises:
        ValueError: an unknown choice, or "flash_attention_2" without a CUDA device, with fp32 compute, or without
            ``flash_attn``.
    """
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}, got {requested!r}")
    device = _default_device() if device is None else torch.device(device)
    dtype = None if dtype is None else resolve_dtype(dtype)
    low_precision = dtype is None or dtype in FLASH_ATTN_DTYPES
    if requested == "auto":
        flash = device.type == "cuda" and low_precision and _flash_attn_imports()
        return "flash_attention_2" if flash else "sdpa"
    if requested == "flash_attention_2":
        if device.type != "cuda":
            raise ValueError(f"model.attn_implementation='flash_attention_2' needs a CUDA device, but this run uses "
                             f"{device}; choose 'auto' or 'sdpa'")
        if not low_precision:
            raise ValueError(f"model.attn_implementation='flash_attention_2' needs model.dtype bfloat16 or float16 "
                             f"(flash-attn rejects {dtype}); choose 'auto' or 'sdpa', or a lower model.dtype")
        if not _flash_attn_imports():
            raise ValueError("model.attn_implementation='flash_attention_2' but the flash_attn package does not "
                             "import; pip install flash-attn --no-build-isolation (built for this torch and CUDA), "
                             "or choose 'auto' or 'sdpa'")
    return requested


def liger_patch_function(model_type: str) -> Any:
    """Liger-Kernel's ``apply_liger_kernel_to_<arch>`` for a transformers ``model_type`` (e.g. "qwen2").

    Raises:
        ImportError: liger-kernel is not installed.
        ValueError: Liger-Kernel has no patches for `model_type` (the message lists the supported ones).
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise ImportError("model.liger_kernel=true but liger-kernel is not installed; pip install liger-kernel "
                          "(it needs a CUDA GPU and Triton), or set model.liger_kernel false") from exc
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        raise ValueError(f"model.liger_kernel=true: Liger-Kernel has no patches for model_type {model_type!r}; "
                         f"supported: {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}; set model.liger_kernel false")
    return fn


def apply_liger_kernel(path_or_id: str | os.PathLike, device: torch.device | str | None = None,
                       trust_remote_code: bool = False) -> str:
    """Patch transformers' modeling code for the architecture of `path_or_id` with Liger-Kernel's RMSNorm, RoPE and
    SwiGLU (``LIGER_PATCHES``). Call it before the model is built: it replaces classes / functions in the
    ``transformers.models.<arch>`` module, for every model of that architecture built afterwards in this process
    (the engine and reference copies included).

    Args:
        path_or_id: local directory or hub id (only its ``config.json`` is read).
        device: where the model will run; None = CUDA when available, else CPU.
        trust_remote_code: forwarded to ``AutoConfig.from_pretrained``.

    Returns:
        the patched ``model_type``.

    Raises:
        ValueError: not a CUDA device (Liger's kernels are Triton GPU kernels), or an unsupported architecture.
        ImportError: liger-kernel is not installed.
    """
    from transformers import AutoConfig

    device = _default_device() if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"model.liger_kernel=true needs a CUDA GPU (Liger-Kernel's Triton kernels), but this run "
                         f"uses {device}; set model.liger_kernel false")
    name = resolve_model_path(path_or_id)
    model_type = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code).model_type
    fn = liger_patch_function(model_type)
    accepted = inspect.signature(fn).parameters
    fn(**{k: v for k, v in LIGER_PATCHES.items() if k in accepted})
    return model_type


def load_tokenizer(
    path_or_id: str | os.PathLike,
    padding_side: str = "left",
    require_chat_template: bool = True,
    trust_remote_code: bool = False,
) -> Any:
    """Load a tokenizer with an explicit padding side and a pad token.

    Args:
        path_or_id: local directory or hub id.
        padding_side: "left" (generation) or "right".
        require_chat_template: raise when the tokenizer has no chat template (the rollout renders chats).
        trust_remote_code: forwarded to ``AutoTokenizer.from_pretrained``.

    Returns:
        the tokenizer; ``pad_token`` is the tokenizer's own, else ``<|endoftext|>`` when in the vocab, else eos.
    """
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    name = resolve_model_path(path_or_id, "tokenizer")
    tok = AutoTokenizer.from_pretrained(name, padding_side=padding_side, trust_remote_code=trust_remote_code)
    tok.padding_side = padding_side
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        if "<|endoftext|>" in vocab:
            tok.pad_token = "<|endoftext|>"
        elif tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            raise ValueError(f"tokenizer {name!r} has neither a pad nor an eos token; pass a tokenizer that has one")
    if require_chat_template and not getattr(tok, "chat_template", None):
        raise ValueError(
            f"tokenizer {name!r} has no chat template; pass an instruct model's tokenizer (e.g."
            " Qwen/Qwen2.5-0.5B-Instruct) or a directory with chat_template.jinja"
        )
    return tok


def _require_peft(lora_rank: int) -> Any:
    """The peft module when LoRA is requested (lora_rank > 0), else None; checked before any weights load."""
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0 (0 = no LoRA), got {lora_rank!r}")
    if lora_rank == 0:
        return None
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            f"LoRA was requested (lora_rank={lora_rank}) but peft is not installed; pip install peft==0.21.2 (or "
            "fastpo[lora]) or set lora_rank=0"
        ) from exc
    return peft


def parse_target_modules(spec: str | list[str] | tuple[str, ...]) -> str | list[str]:
    """peft's ``target_modules`` from the config string: "all-linear" (every linear layer but the output head) or
    comma-separated module-name suffixes ("q_proj,v_proj" -> ["q_proj", "v_proj"]); lists pass through."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    if not names or not all(names):
        raise ValueError(f"lora_target_modules must be 'all-linear' or comma-separated module names, got {spec!r}")
    return "all-linear" if names == ["all-linear"] else names


def lora_rank_limit(model: nn.Module, target_modules: str | list[str] | tuple[str, ...]) -> tuple[int, str] | None:
    """(the largest useful LoRA rank, the layer that sets it): the smallest min(in_features, out_features) over the
    ``nn.Linear`` layers `target_modules` selects as peft does ("all-linear": every linear layer but the output
    head; names: modules whose name is, or ends with, one of them). None when it selects no linear layer. Works on a
    meta-device skeleton (no weights read)."""
    targets = parse_target_modules(target_modules)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    best: tuple[int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if targets != "all-linear" and not any(name == t or name.endswith("." + t) for t in targets):
            continue
        limit = min(module.in_features, module.out_features)
        if best is None or limit < best[0]:
            best = (limit, f"{name}: {module.in_features} -> {module.out_features}")
    return best


def _apply_lora(peft: Any, model: nn.Module, rank: int, alpha: int, target_modules: str | list[str],
                seed: int = 0) -> nn.Module:
    """Wrap `model` with a LoRA adapter (no dropout: the trainer's forwards stay deterministic). Base weights are
    frozen by peft; only ``lora_A`` / ``lora_B`` train. ``lora_A`` is drawn under ``torch.manual_seed(seed)`` in a
    forked RNG: every rank builds the same adapter whatever its own (rank-dependent) seed, so FSDP2's shards form
    one consistent model and 1 and N ranks start equal. Only ``nn.Linear`` targets are accepted, because
    :func:`merged_state_dict` merges ``W + scaling * B @ A`` for those alone."""
    if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha < 1:
        raise ValueError(f"lora_alpha must be an int >= 1, got {alpha!r}")
    limit = lora_rank_limit(model, target_modules)
    # a rank past a layer's narrower side adds no expressiveness, only adapter size (100000 x 128 took minutes)
    if limit is not None and rank > limit[0]:
        raise ValueError(f"lora_rank {rank} exceeds the smallest adapted layer ({limit[1]}); choose lora_rank <= "
                         f"{limit[0]}")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=parse_target_modules(target_modules),
                             lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config)
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    others = sorted({type(m).__name__ for m in wrapped.modules() if isinstance(m, LoraLayer)
                     and not isinstance(m, LoraLinear)})
    if others:
        raise ValueError(f"lora_target_modules={target_modules!r} adapts {others} layers; only linear layers are "
                         f"supported (use 'all-linear' or names of nn.Linear modules)")
    return wrapped


def is_lora(model: nn.Module) -> bool:
    """True when `model` (or a ``CriticModel``'s backbone) carries a peft LoRA adapter."""
    if "peft" not in sys.modules:  # never imported: no peft model can exist
        return False
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


class LoRAMergedWeight:
    """A LoRA layer's merged weight ``W + scaling * B @ A`` [out, in], computed when read.

    Stands in a state dict where a sharded (DTensor) weight would: ``numel`` / ``element_size`` size it for
    bucketing, ``full_tensor()`` gathers the three pieces (collective under FSDP2: every rank reads the entries in
    the same order) and merges in fp32, returning the weight's dtype. Plain tensors merge the same way."""

    def __init__(self, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                 fan_in_fan_out: bool = False):
        self.base, self.lora_a, self.lora_b = base, lora_a, lora_b
        self.scaling, self.fan_in_fan_out = float(scaling), fan_in_fan_out
        self.shape, self.dtype = base.shape, base.dtype

    def numel(self) -> int:
        return self.base.numel()

    def element_size(self) -> int:
        return self.base.element_size()

    def full_tensor(self) -> torch.Tensor:
        def full(t: torch.Tensor) -> torch.Tensor:
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

        base, a, b = full(self.base), full(self.lora_a), full(self.lora_b)
        delta = b.float() @ a.float()
        if self.fan_in_fan_out:
            delta = delta.T
        return (base.float() + delta * self.scaling).to(base.dtype)


def merged_state_dict(model: nn.Module, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain (un-peft) state dict of a LoRA model, adapters merged: what an engine or ``from_pretrained``
    expects. The training model is not modified (no in-place merge / unmerge, so its base weights stay bit-exact).

    Args:
        model: a ``peft.PeftModel`` (possibly FSDP2-sharded) or a module containing one.
        state: `model`'s state dict (full tensors, or DTensors from ``model.state_dict()`` under FSDP2); None reads
            ``model.state_dict()``.

    Returns:
        name -> tensor in `state`'s order with peft's prefixes removed (``base_model.model.``, ``.base_layer``) and
        the ``lora_A`` / ``lora_B`` entries dropped; each adapted weight is merged at once when its pieces are plain
        tensors, else a :class:`LoRAMergedWeight` (gathered and merged on ``full_tensor()``).
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    state = model.state_dict() if state is None else state
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    peft_prefixes = [f"{name}.base_model.model." if name else "base_model.model."
                     for name, m in model.named_modules() if isinstance(m, PeftModel)]

    def plain(key: str) -> str:
        for prefix in peft_prefixes:
            if key.startswith(prefix):
                return prefix[: -len("base_model.model.")] + key[len(prefix):]
        return key

    out: dict[str, Any] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if ".base_layer." not in key:
            out[plain(key)] = value
            continue
        path, _, leaf = key.rpartition(".base_layer.")
        layer = layers.get(path)
        if layer is None:
            raise ValueError(f"state entry {key!r} has no LoRA layer {path!r} in the model")
        if leaf == "weight":
            adapters = [a for a in layer.active_adapters if a in layer.lora_A]
            for adapter in adapters:
                if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
                    raise ValueError(f"{path}: DoRA / lora_bias adapters cannot be merged by fastpo")
                merged = LoRAMergedWeight(value, state[f"{path}.lora_A.{adapter}.weight"],
                                          state[f"{path}.lora_B.{adapter}.weight"], layer.scaling[adapter],
                                          layer.fan_in_fan_out)
                value = merged if hasattr(value, "full_tensor") else merged.full_tensor()
        out[plain(f"{path}.{leaf}")] = value
    return out


def _load_kwargs(dtype: torch.dtype | str | None, attn_implementation: str | None, trust_remote_code: bool) -> dict:
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation in ("auto", "flash_attention_2"):  # checked here, not deep inside transformers
        # "auto" by the load dtype; an explicit flash_attention_2 may load fp32 master weights that FSDP2 mixed
        # precision computes in bf16, so its dtype was checked by the caller that knows the compute dtype
        compute = resolve_dtype(dtype) if attn_implementation == "auto" else None
        attn_implementation = resolve_attn_implementation(attn_implementation, dtype=compute)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def _build(auto_cls: Any, name: str, kwargs: dict, meta: bool) -> Any:
    """``auto_cls.from_pretrained(name)``, or with `meta` the same architecture built from its config on the meta
    device (no weights read: they arrive later, e.g. broadcast from rank 0 by ``fastpo.fsdp``)."""
    if not meta:
        return auto_cls.from_pretrained(name, **kwargs)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, trust_remote_code=kwargs["trust_remote_code"])
    with torch.device("meta"):
        return auto_cls.from_config(config, **kwargs)


def _check_meta(meta: bool, lora_rank: int) -> None:
    if meta and lora_rank:
        raise ValueError("meta=True does not support LoRA (lora_rank > 0): load the model normally")


def _enable_checkpointing(model: Any) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def load_policy(
    path_or_id: str | os.PathLike,
    dtype: torch.dtype | str | None = torch.float32,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    lora_target_modules: str | list[str] = "all-linear",
    trust_remote_code: bool = False,
    lora_seed: int = 0,
    liger_kernel: bool = False,
    meta: bool = False,
) -> Any:
    """Load a causal LM (``AutoModelForCausalLM``) as the policy.

    Args:
        path_or_id: local directory or hub id.
        dtype: parameter dtype (torch dtype or "float32" / "bfloat16" / "float16").
        gradient_checkpointing: recompute each layer in backward (non-reentrant); turns the KV cache off.
        attn_implementation: "auto", "sdpa", "eager", "flash_attention_2" (see
            :func:`resolve_attn_implementation`); None lets transformers choose.
        lora_rank: > 0 wraps the model with a peft LoRA adapter (peft must be installed): base weights frozen,
            ``lora_A`` / ``lora_B`` trainable, no dropout.
        lora_alpha: the adapter's update is scaled by ``lora_alpha / lora_rank``.
        lora_target_modules: "all-linear" (every linear layer but the lm head), comma-separated module-name
            suffixes ("q_proj,v_proj") or a list of them.
        trust_remote_code: forwarded to ``from_pretrained``.
        lora_seed: seed of the adapter's initialisation (independent of the global RNG state).
        liger_kernel: patch the architecture with Liger-Kernel first (:func:`apply_liger_kernel`; CUDA only).
        meta: build the architecture on the meta device without reading any weights (not with LoRA).

    Returns:
        the model in train mode (a ``peft.PeftModel`` when LoRA is on).
    """
    from transformers import AutoModelForCausalLM

    model, _ = _load(AutoModelForCausalLM, path_or_id, dtype, gradient_checkpointing, attn_implementation, lora_rank,
                     lora_alpha, lora_target_modules, trust_remote_code, lora_seed, liger_kernel, meta)
    model.train()
    return model


def _load(auto_cls: Any, path_or_id: str | os.PathLike, dtype: torch.dtype | str | None, gradient_checkpointing: bool,
          attn_implementation: str | None, lora_rank: int, lora_alpha: int, lora_target_modules: str | list[str],
          trust_remote_code: bool, lora_seed: int, liger_kernel: bool, meta: bool) -> tuple[Any, str]:
    """What ``load_policy`` and ``load_critic`` share: resolve the path, patch with Liger, build the `auto_cls`
    model, checkpointing, LoRA (arguments as ``load_policy``). Returns (model, the resolved folder or hub id)."""
    _check_meta(meta, lora_rank)
    peft = _require_peft(lora_rank)
    name = resolve_model_path(path_or_id)
    if liger_kernel:
        apply_liger_kernel(name, trust_remote_code=trust_remote_code)
    model = _build(auto_cls, name, _load_kwargs(dtype, attn_implementation, trust_remote_code), meta)
    if gradient_checkpointing:
        _enable_checkpointing(model)
    if peft is not None:
        model = _apply_lora(peft, model, lora_rank, lora_alpha, lora_target_modules, lora_seed)
    return model, name


class CriticModel(nn.Module):
    """A transformer backbone (no lm head) plus a scalar value head.

    ``forward(input_ids [B, T] int64, attention_mask [B, T] | None, position_ids [B, T] | None, **attn_kwargs)``
    returns the per-token values [B, T] float32: the value head runs in fp32 on the fp32-cast last hidden states.
    ``attn_kwargs`` go to the backbone (e.g. flash-attention's ``cu_seq_lens_q`` / ``max_length_q`` of packed rows,
    ``MicroBatch.model_inputs``).
    """

    def __init__(self, backbone: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head
        self.config = getattr(backbone, "config", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **attn_kwargs,
        )
        return self.value_head(out.last_hidden_state.float()).squeeze(-1)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the backbone (``save_pretrained``, safetensors; a LoRA backbone with its adapter merged, so
        ``load_critic(path)`` reloads it without peft) and the head (``value_head.safetensors``)."""
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        if is_lora(self.backbone):
            unwrap_peft(self.backbone).save_pretrained(str(path), state_dict=merged_state_dict(self.backbone),
                                                       safe_serialization=True)
        else:
            self.backbone.save_pretrained(str(path), safe_serialization=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(state, os.path.join(str(path), VALUE_HEAD_FILE))


def load_critic(
    path_or_id: str | os.PathLike,
    dtype: torch.dtype | str | None = torch.float32,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    lora_target_modules: str | list[str] = "all-linear",
    trust_remote_code: bool = False,
    head_seed: int = 0,
    lora_seed: int = 0,
    liger_kernel: bool = False,
    meta: bool = False,
) -> CriticModel:
    """Load the backbone of `path_or_id` (``AutoModel``: the causal LM without its head) and add a value head.

    The head is ``nn.Linear(hidden, 1)`` in fp32: loaded from ``value_head.safetensors`` when the directory has
    one (a saved critic), else initialised like verl's token-classification head (normal(0,
    ``initializer_range``), zero bias) with `head_seed`. With LoRA (``lora_rank > 0``) the backbone is a
    ``peft.PeftModel`` and only its adapters and the head train. With `meta` backbone and head are built on the meta
    device and nothing is read. Other arguments as in ``load_policy``.
    """
    from transformers import AutoModel

    backbone, name = _load(AutoModel, path_or_id, dtype, gradient_checkpointing, attn_implementation, lora_rank,
                           lora_alpha, lora_target_modules, trust_remote_code, lora_seed, liger_kernel, meta)
    config = backbone.config.get_text_config()
    head = nn.Linear(config.hidden_size, 1, dtype=torch.float32)  # on CPU also with meta: same global RNG draws
    head_file = os.path.join(name, VALUE_HEAD_FILE)
    if meta:
        head = head.to("meta")
    elif os.path.isfile(head_file):
        from safetensors.torch import load_file

        head.load_state_dict(load_file(head_file))
    else:
        gen = torch.Generator().manual_seed(head_seed)
        with torch.no_grad():
            head.weight.normal_(0.0, getattr(config, "initializer_range", 0.02), generator=gen)
            head.bias.zero_()
    device = next(backbone.parameters()).device
    critic = CriticModel(backbone, head.to(device))
    critic.train()
    return critic


class LMHeadInputs(NamedTuple):
    """What the lm head would consume: ``logits = hidden @ weight.T (+ bias)``.

    Attributes:
        hidden: last hidden states after the final norm, [B, T, H], the model's dtype.
        weight: the lm-head weight [V, H] (the embedding matrix when tied).
        bias: the lm-head bias [V] or None (Qwen, Llama: None).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


def unwrap_peft(model: Any) -> Any:
    """The transformers model inside a ``peft.PeftModel`` (its layers still hold the adapters); other models as is."""
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def policy_hidden_states(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> LMHeadInputs:
    """Run the policy's decoder without building logits.

    Args:
        model: a causal LM from ``load_policy`` (peft-wrapped or not).
        input_ids: [B, T] int64.
        attention_mask: [B, T] (1 = token, 0 = padding) or None.
        position_ids: [B, T] int64 or None (then 0..T-1; pass them for left padding or packed rows).

    Returns:
        ``LMHeadInputs(hidden [B, T, H], weight [V, H], bias [V] | None)``, so that
        ``fastpo.kernels.fused_linear_logprob(hidden, weight, ids, bias, temperature)`` equals
        ``log_softmax(model(...).logits / T)`` gathered at ``ids``.

    Under FSDP2 the decoder is called directly (not the root module), so its parameters must be unsharded by
    the decoder's own hooks (shard ``model.model`` as its own unit) and the lm-head weight gathered by the caller.
    """
    base = unwrap_peft(model)
    config = base.config.get_text_config()
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise ValueError(f"model config sets {attr}={getattr(config, attr)}; policy_hidden_states cannot apply it")
    decoder = base.get_decoder()
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    head = base.get_output_embeddings()
    return LMHeadInputs(out.last_hidden_state, head.weight, getattr(head, "bias", None))
