"""FSDP2 wrapping of the actor / critic, mixed precision, activation checkpointing, full state dicts.

    model = shard_model(model, mixed_precision=torch.bfloat16, activation_checkpointing=True)
    state = full_state_dict(model)          # {name: full CPU tensor}: weight sync to the engine, HF export
    model = load_sharded(lambda meta: load_policy(path, meta=meta), device, meta_init=True)  # rank 0 reads only

Layout: every decoder layer (``model.<...>.layers[i]``) is its own ``fully_shard`` unit and the root module is
the last unit (embeddings, final norm, lm head / value head: tied weights stay in one unit). Always run the
ROOT module's forward (the trainer gets hidden states with ``logits_to_keep=1`` and a hook on the decoder,
``fastpo.trainer.lm_head_inputs``): FSDP2 keeps the root's parameters unsharded after its forward, so the
lm-head weight read after the forward is the gathered full weight, and its gradient is reduce-scattered by the
root's post-backward like any other. Calling the decoder alone would skip the root's hooks.

LoRA (a ``peft.PeftModel``, or a ``CriticModel`` whose backbone is one) shards the same way: each unit then holds
frozen base weights beside trainable adapter weights, which FSDP2 allows (only parameters with a gradient are
reduce-scattered; checked against a single process in tests/test_lora.py). :func:`full_state_dict` returns such a
model's weights merged, under the plain model's names.

Meta-device init (:func:`load_sharded`, ``model.meta_init``): under torchrun only rank 0 reads the checkpoint; the
other ranks build the architecture on the meta device (``load_policy(..., meta=True)``), every rank shards it, the
meta ranks allocate their shards (``to_empty``), and rank 0's full state dict is broadcast into the shards
(``set_model_state_dict(..., broadcast_from_rank0=True)``). Non-persistent buffers (the rotary ``inv_freq``) are not
in a state dict: rank 0 broadcasts them too. Tied embeddings stay one parameter (the meta model is tied by
``from_config`` like the loaded one). LoRA models take the normal path (every rank loads): peft's adapter
construction on meta tensors is not supported here.

Without a process group (``python -m fastpo.train``) :func:`shard_model` only applies activation checkpointing:
one code path, no sharding. Mixed precision (``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``) is
applied whenever the caller passes a compute dtype, on any device; the trainer passes one exactly when
``model.dtype`` is lower than fp32 and then loads the parameters in fp32, so AdamW updates fp32 master weights and
keeps fp32 states (bf16 parameters would round most updates at lr 1e-6 away). FSDP2 needs a process group for that
even in a single process: :func:`init_single_rank_group` creates a world-1 one (HashStore, no port), so
``python -m fastpo.train`` on one GPU runs the same FSDP2 path as torchrun with one rank.

The critic's value head is its own FSDP2 unit with an fp32 policy under mixed precision: the root unit's bf16
policy would otherwise cast the head's weight to bf16 while ``CriticModel.forward`` feeds it fp32 hidden states
(a dtype mismatch at the first critic forward), and values would be computed in bf16. At world 1 the decoder layers
keep their gathered weights after forward (``reshard_after_forward=False``): there is nothing to free by
resharding, only copies to redo in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .. import distributed as du
from ..model import is_lora, merged_state_dict


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM or a ``CriticModel`` (the first ``nn.ModuleList`` named ``layers``)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            return list(module)
    raise ValueError(f"{type(model).__name__} has no ModuleList named 'layers'; cannot shard it per decoder layer")


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (transformers' non-reentrant gradient checkpointing)."""
    target = getattr(model, "backbone", model)  # CriticModel keeps the transformer in .backbone
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(target).__name__} does not support gradient checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    target.config.use_cache = False


def init_single_rank_group(device: torch.device | str) -> bool:
    """Create a world-1 process group (nccl on CUDA, gloo on CPU; an in-memory store, no port) when none exists, so
    that a single process can use FSDP2 (mixed precision over fp32 master weights). Returns True when it created
    one; :func:`fastpo.distributed.shutdown` destroys it like torchrun's."""
    if du.is_distributed():
        return False
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def needs_master_weights(compute_dtype: torch.dtype | str) -> bool:
    """True when `compute_dtype` (a torch dtype or its name, e.g. "bfloat16") is lower than fp32: the trained
    models are then loaded in fp32 and run under FSDP2 mixed precision in `compute_dtype`."""
    from ..model import resolve_dtype

    return resolve_dtype(compute_dtype) != torch.float32


def make_adamw(params: Any, device: torch.device | str, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused (one kernel for all parameters) on CUDA; elsewhere torch's
    default implementation, which the CPU tests and checkpoints were made with."""
    return torch.optim.AdamW(params, fused=torch.device(device).type == "cuda", **kwargs)


def shard_model(
    model: nn.Module,
    mixed_precision: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """Wrap `model` in place with FSDP2 when a process group exists (no-op sharding for a single process).

    Args:
        model: a transformers causal LM or a ``fastpo.model.CriticModel`` (fp32 master weights recommended
            with mixed precision).
        mixed_precision: compute dtype of the all-gathered parameters (gradients are reduced in fp32), on any
            device; None computes in the parameters' dtype. A ``CriticModel``'s value head always computes in fp32.
        activation_checkpointing: recompute decoder layers in backward.
        reshard_after_forward: free the gathered layer weights after forward (ZeRO-3); False keeps them (ZeRO-2);
            None = True when the process group has more than one rank, False at world 1.

    Returns:
        the same module object (its parameters become DTensors when sharded).
    """
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if not du.is_distributed():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if reshard_after_forward is None:
        reshard_after_forward = dist.get_world_size() > 1
    kwargs: dict[str, Any] = {}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    head = getattr(model, "value_head", None)
    if mixed_precision is not None and isinstance(head, nn.Module):
        # its own unit, computed in fp32 (module docstring); the unit casts its input to fp32 as well
        fully_shard(head, reshard_after_forward=reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of `model`; collective under FSDP2 (every rank must call it).

    Names are those of the unwrapped module (what ``HFEngine.sync_weights`` and ``save_pretrained`` expect): a
    peft LoRA model comes back with its adapters merged into the base weights under the plain model's names
    (``fastpo.model.merged_state_dict``; the model itself is not modified). Every rank gets the full tensors on the
    parameters' device (``cpu_offload`` would leave ranks > 0 empty)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_model_state_dict(model, options=options)
    return merged_state_dict(model, state) if is_lora(model) else state


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> buffer for every buffer registered with ``persistent=False`` (absent from state dicts)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def load_sharded(
    load: Callable[[bool], nn.Module],
    device: torch.device | str,
    meta_init: bool = True,
    **shard_kwargs: Any,
) -> nn.Module:
    """Load a model onto `device` and :func:`shard_model` it, reading the checkpoint on rank 0 only when `meta_init`.

    Args:
        load: ``load(meta)`` returns the model: read from disk (on CPU) when `meta` is False, built on the meta
            device from its config when True (e.g. ``lambda meta: load_policy(path, meta=meta)``). Both must build
            the same modules, parameter names and tied parameters.
        device: where the model runs.
        meta_init: with a process group, rank 0 calls ``load(False)`` and the other ranks ``load(True)``; the
            weights, persistent and non-persistent buffers then come from rank 0 (broadcast). Without a process
            group, or False: every rank calls ``load(False)``.
        shard_kwargs: :func:`shard_model`'s keyword arguments.

    Returns:
        the sharded model; its full parameters and buffers equal ``load(False)``'s on every rank.
    """
    device = torch.device(device)
    if not (meta_init and du.is_distributed()):
        return shard_model(load(False).to(device), **shard_kwargs)
    main = dist.get_rank() == 0
    model = load(not main)
    if is_lora(model):
        raise ValueError("meta init does not support LoRA models; load them with meta_init=False")
    # rank 0's full tensors as loaded (on CPU), taken before `to` and fully_shard replace the parameters: once
    # sharded, the device holds only the shards, and the broadcast moves one tensor at a time to it
    state = model.state_dict() if main else {}
    if main:
        model.to(device)
    shard_model(model, **shard_kwargs)
    if not main:
        model.to_empty(device=device)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del state
    for buf in non_persistent_buffers(model).values():
        dist.broadcast(buf.data, src=0)
    return model
