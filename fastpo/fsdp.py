"""The trained models: FSDP2 wrapping, mixed precision over fp32 master weights, activation checkpointing,
optimisers, full state dicts.

    models = build_trained_models(cfg, model_path, device)   # actor (+ critic, reference), AdamW, schedules
    model = shard_model(model, mixed_precision=torch.bfloat16, activation_checkpointing=True)
    state = full_state_dict(model)          # {name: full tensor}: weight sync to the engine, HF export
    model = load_sharded(lambda meta: load_policy(path, meta=meta), device, meta_init=True)  # rank 0 reads only

Every decoder layer is its own ``fully_shard`` unit and the root module the last (embeddings, final norm, lm head:
tied weights stay in one unit). Always run the ROOT module's forward (``microbatch.lm_head_inputs`` reads hidden
states with ``logits_to_keep=1`` and a hook on the decoder): FSDP2 keeps the root's parameters unsharded after its
forward, so the lm-head weight read then is the full weight; calling the decoder alone would skip the root's hooks.
LoRA models shard the same way (frozen base weights beside trainable adapters in a unit). Meta-device init: under
torchrun only rank 0 reads the checkpoint, the others build the architecture on the meta device and receive rank
0's weights and non-persistent buffers (the rotary ``inv_freq``) by broadcast into their shards.

A compute dtype below fp32 runs as FSDP2 mixed precision over fp32 parameters, so AdamW updates fp32 master
weights (bf16 parameters would round most updates at lr 1e-6 away); a single process gets a world-1 process group
for it (:func:`init_single_rank_group`). The critic's value head is its own unit with an fp32 policy (the root's
bf16 policy would cast its weight while it is fed fp32 hidden states). At world 1 the decoder layers keep their
gathered weights after forward (``reshard_after_forward=False``): there is nothing to free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from . import distributed as du
from .model import is_lora, merged_state_dict


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
    from .model import resolve_dtype

    return resolve_dtype(compute_dtype) != torch.float32


def make_adamw(params: Any, device: torch.device | str, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused (one kernel for all parameters) on CUDA; elsewhere torch's
    default implementation, which the CPU tests and checkpoints were made with. Fused on CPU was tried (2026-12-07):
    3.2x faster per step on 52M parameters (2.52x TRL's steps/s instead of ~2.4x), but the demo's 3-seed mean gain
    fell from +15.0 to +9.4 points with it (its rounding moves every run onto another path, and these three landed
    lower), so the CPU default stays the per-tensor loop (docs/BENCHMARKS.md, "Performance vs TRL")."""
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
    kwargs: dict[str, Any] = {"mesh": _mesh()}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    head = getattr(model, "value_head", None)
    if mixed_precision is not None and isinstance(head, nn.Module):
        # its own unit, computed in fp32 (module docstring); the unit casts its input to fp32 as well
        fully_shard(head, reshard_after_forward=reshard_after_forward, mesh=kwargs["mesh"],
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    fully_shard(model, **kwargs)
    return model


def _mesh() -> Any:
    """The 1-D device mesh over every rank, on the process group's device: CUDA under nccl, CPU under gloo. FSDP2's
    own default mesh is on CUDA whenever CUDA is available, which would move a CPU-rank run (gloo; the test suite on a
    GPU machine) onto the GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda" if "nccl" in str(dist.get_backend()) else "cpu", (dist.get_world_size(),))


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


@dataclass
class TrainedModels:
    """The models a StarPO run trains (FSDP2-sharded under a process group) with their optimisers and schedules.

    ``critic`` (and its optimiser, schedule) is None for estimators without a critic; ``ref`` is the frozen
    reference policy when a KL term needs one and the actor is not LoRA (then the reference is the actor with its
    adapter disabled, ``ref`` None). ``layout`` is the resolved micro-batch layout."""

    actor: nn.Module
    actor_optim: torch.optim.Optimizer
    actor_sched: Any
    critic: nn.Module | None = None
    critic_optim: torch.optim.Optimizer | None = None
    critic_sched: Any = None
    ref: nn.Module | None = None
    layout: str = "padded"

    def stateful(self) -> dict[str, Any]:
        """What a checkpoint holds (torch.distributed.checkpoint's stateful objects)."""
        objs: dict[str, Any] = {"actor": self.actor, "actor_optim": self.actor_optim, "actor_sched": self.actor_sched}
        if self.critic is not None:
            objs.update(critic=self.critic, critic_optim=self.critic_optim, critic_sched=self.critic_sched)
        return objs


def constant_schedule(optim: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps`` optimiser steps, then the constant lr (StarPO's schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps
                                             else 1.0)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimiser holds: all of them, or under LoRA the adapters (and the critic's value head)."""
    return [p for p in model.parameters() if p.requires_grad]


def build_trained_models(cfg: Any, model_path: str, device: torch.device) -> TrainedModels:
    """Actor (and critic, reference) of a ``fastpo.config.Config`` loaded from ``model_path``, sharded, with AdamW and
    the warmup-then-constant schedule. A compute dtype below fp32 runs as FSDP2 mixed precision over fp32 master
    weights and fp32 AdamW states, with or without torchrun (a single process gets a world-1 process group)."""
    from . import algorithms
    from .model import load_critic, load_policy, resolve_attn_implementation, resolve_model_path

    m, o = cfg.model, cfg.optim
    master = needs_master_weights(m.dtype)
    if master:
        init_single_rank_group(device)
    dtype = torch.float32 if master else m.dtype
    lora = {"lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha, "lora_target_modules": m.lora_target_modules,
            "lora_seed": cfg.trainer.seed}
    attn = resolve_attn_implementation(m.attn_implementation, device, m.dtype)
    # Liger patches transformers' modules in place: every model built afterwards (engine, reference) uses them
    common = {"attn_implementation": attn, "liger_kernel": m.liger_kernel}
    # under torchrun only rank 0 reads the weights, the others get them by broadcast into their shards; LoRA models
    # load on every rank (peft on meta tensors is unsupported)
    meta_init = m.meta_init and m.lora_rank == 0
    shard = {"mixed_precision": getattr(torch, m.dtype) if master else None,
             "activation_checkpointing": m.gradient_checkpointing}
    adamw = {"lr": o.actor_lr, "betas": o.betas, "weight_decay": o.weight_decay}
    actor = load_sharded(lambda meta: load_policy(model_path, dtype=dtype, meta=meta, **common, **lora), device,
                         meta_init, **shard)
    actor_optim = make_adamw(trainable_parameters(actor), device, **adamw)
    out = TrainedModels(actor, actor_optim, constant_schedule(actor_optim, o.warmup_steps))
    if algorithms.needs_critic(cfg.algorithm):
        path = resolve_model_path(m.critic_path) if m.critic_path else model_path
        out.critic = load_sharded(lambda meta: load_critic(path, dtype=dtype, head_seed=cfg.trainer.seed, meta=meta,
                                                           **common, **lora), device, meta_init, **shard)
        out.critic_optim = make_adamw(trainable_parameters(out.critic), device, **{**adamw, "lr": o.critic_lr})
        out.critic_sched = constant_schedule(out.critic_optim, o.warmup_steps)
    if algorithms.needs_reference(cfg.algorithm) and not is_lora(actor):
        out.ref = load_policy(model_path, dtype=m.dtype, attn_implementation=attn).to(device)
        out.ref.eval()
        out.ref.requires_grad_(False)
    attn_used = getattr(getattr(actor, "config", None), "_attn_implementation", None)
    layout = o.micro_batch_layout
    if layout == "auto":
        layout = "packed" if attn_used == "flash_attention_2" else "shared"
    if layout == "shared" and attn_used == "flash_attention_2":
        raise ValueError("optim.micro_batch_layout=shared needs a 4D attention mask, which flash_attention_2 does "
                         "not take: use packed or auto with model.attn_implementation=flash_attention_2")
    out.layout = layout
    return out
