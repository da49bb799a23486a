"""``torch.library`` custom ops (namespace ``fastpo``): one per kernel, each with a fake (meta) implementation
and, where differentiable, an autograd formula (the logprob ops call a backward custom op; the losses return
their per-token derivative from the forward and the backward scales it). They are opaque to ``torch.compile``
(``fullgraph=True`` works) and pick a backend at run time:

* CUDA tensors -> the Triton kernels in ``logprob.py`` / ``losses.py`` / ``advantages.py``;
* CPU tensors -> ``fastpo.kernels.reference`` (chunked torch);
* ``FASTPO_KERNELS=triton|torch`` forces one (Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set before
  triton is imported; the test suite does that).

Data-dependent input checks (token ids inside [0, vocab)) run here, inside the op, before any launch: one
min/max reduction and one host sync.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .. import reference as ref
from .. import reference_gigpo

BACKENDS = ("triton", "torch")
#: Values of FASTPO_FLP_KERNEL: which Triton kernels run fused_linear_logprob (see :func:`flp_kernel`).
FLP_KERNELS = ("tiled", "persistent", "persistent-ptr")


def backend_for(t: Tensor) -> str:
    """'triton' or 'torch' for an op whose main input is ``t`` (see the module docstring)."""
    choice = os.environ.get("FASTPO_KERNELS", "").strip().lower()
    if choice in ("", "auto"):
        return "triton" if t.is_cuda else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"FASTPO_KERNELS must be one of {BACKENDS} (or unset), got {choice!r}")
    if choice == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("FASTPO_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before importing "
                           "triton), or use CUDA tensors")
    return choice


def triton_module(name: str) -> ModuleType:
    """Import ``fastpo.kernels.ops.<name>`` (which imports triton), with a clear error when triton is missing."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as exc:
        if "triton" not in str(exc):
            raise
        raise ImportError("fastpo.kernels: the Triton path was selected (CUDA tensors or FASTPO_KERNELS=triton) but "
                          "triton is not importable; install it (pip install triton) or set FASTPO_KERNELS=torch"
                          ) from exc


def flp_kernel() -> str:
    """The Triton kernels of ``fused_linear_logprob`` (forward and backward), from ``FASTPO_FLP_KERNEL``, read at
    every call: ``tiled`` (default: ``logprob.py``, one program per tile), ``persistent`` (``flp_persistent.py``:
    ~one program per SM slot, one pipelined loop over vocab tiles x K, TMA descriptors on sm_90+) or
    ``persistent-ptr`` (the persistent kernels with pointer loads everywhere). The default stays ``tiled`` until
    a GPU run of ``fastpo.kernels.ab.ab_logprob`` says otherwise."""
    choice = os.environ.get("FASTPO_FLP_KERNEL", "").strip().lower() or "tiled"
    if choice not in FLP_KERNELS:
        raise ValueError(f"FASTPO_FLP_KERNEL must be one of {FLP_KERNELS} (or unset), got {choice!r}")
    return choice


def _flp_impl(hidden: Tensor) -> tuple[ModuleType, dict]:
    """(module, extra keyword arguments) serving fused_linear_logprob's forward / backward on ``hidden``."""
    kind = flp_kernel()  # checked on either backend, so a misspelt value never passes silently
    if backend_for(hidden) != "triton":
        return ref, {}
    if kind == "tiled":
        return triton_module("logprob"), {}
    return triton_module("flp_persistent"), ({"tma": False} if kind == "persistent-ptr" else {})


def check_ids(ids: Tensor, vocab: int, name: str = "ids") -> None:
    """ValueError unless every id is in [0, vocab); one aminmax + one host sync."""
    if ids.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.stack(torch.aminmax(ids)).tolist())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} must lie in [0, {vocab}) (the vocab size), got values in [{lo}, {hi}]")


def check_cu_seqlens(cu_seqlens: Tensor | None, n_tokens: int) -> None:
    """ValueError unless cu_seqlens starts at 0, never decreases and ends within the N packed tokens (one sync):
    the kernels index memory with it."""
    if cu_seqlens is None or cu_seqlens.numel() == 0:
        return
    steps = cu_seqlens[1:] - cu_seqlens[:-1]
    low = steps.min() if steps.numel() else cu_seqlens[0] * 0
    first, last, low = (int(x) for x in torch.stack([cu_seqlens[0], cu_seqlens[-1], low]).tolist())
    if first != 0 or low < 0 or last > n_tokens:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at most at N = {n_tokens}, got "
                         f"start {first}, end {last}, smallest step {low}")


def _empty(device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def _out(x: Tensor, like: Tensor) -> Tensor:
    """Outputs are fp32, or fp64 for fp64 inputs (reference.compute_dtype): the Triton path computes in fp32."""
    return x.to(ref.compute_dtype(like))


# ----------------------------------------------------------------------------------------------- logprob ops
@torch.library.custom_op("fastpo::selective_logprob", mutates_args=())
def selective_logprob(logits: Tensor, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """logits [R, V] or [B, T, V] (vocab dim contiguous), ids logits.shape[:-1] -> fp32 (logp, lse)."""
    check_ids(ids, logits.shape[-1])
    if ids.numel() == 0:  # an empty batch: the same empty result on both backends (the torch path stacks rows)
        cd = ref.compute_dtype(logits)
        return logits.new_empty(ids.shape, dtype=cd), logits.new_empty(ids.shape, dtype=cd)
    if backend_for(logits) == "triton":
        logp, lse = triton_module("logprob").selective_logprob_fwd(logits, ids, temperature)
        return _out(logp, logits), _out(lse, logits)
    if logits.dim() == 2:
        return ref.selective_logprob_fwd(logits, ids, temperature)
    outs = [ref.selective_logprob_fwd(logits[b], ids[b], temperature) for b in range(logits.shape[0])]
    return torch.stack([o[0] for o in outs]).view(ids.shape), torch.stack([o[1] for o in outs]).view(ids.shape)


@selective_logprob.register_fake
def _(logits: Tensor, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    cd = ref.compute_dtype(logits)
    return logits.new_empty(ids.shape, dtype=cd), logits.new_empty(ids.shape, dtype=cd)


@torch.library.custom_op("fastpo::selective_logprob_backward", mutates_args=())
def selective_logprob_backward(grad_logp: Tensor, grad_lse: Tensor, logits: Tensor, ids: Tensor, lse: Tensor,
                               temperature: float) -> Tensor:
    if ids.numel() == 0:
        return torch.zeros_like(logits)
    if backend_for(logits) == "triton":
        return triton_module("logprob").selective_logprob_bwd(grad_logp, grad_lse, logits, ids, lse, temperature)
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab) if logits.dim() == 2 or logits.is_contiguous() else None
    if rows is not None:
        out = ref.selective_logprob_bwd(grad_logp.reshape(-1), grad_lse.reshape(-1), rows, ids.reshape(-1),
                                        lse.reshape(-1), temperature)
        return out.view(logits.shape)
    return torch.stack([ref.selective_logprob_bwd(grad_logp[b], grad_lse[b], logits[b], ids[b], lse[b], temperature)
                        for b in range(logits.shape[0])])


@selective_logprob_backward.register_fake
def _(grad_logp: Tensor, grad_lse: Tensor, logits: Tensor, ids: Tensor, lse: Tensor, temperature: float) -> Tensor:
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _selective_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    logits, ids, temperature = inputs
    ctx.save_for_backward(logits, ids, output[1])
    ctx.temperature = temperature


def _selective_backward(ctx: Any, grad_logp: Tensor, grad_lse: Tensor) -> tuple[Tensor, None, None]:
    logits, ids, lse = ctx.saved_tensors
    grad = selective_logprob_backward(grad_logp, grad_lse, logits, ids, lse, ctx.temperature)
    return grad, None, None


selective_logprob.register_autograd(_selective_backward, setup_context=_selective_setup)


@torch.library.custom_op("fastpo::fused_linear_logprob", mutates_args=())
def fused_linear_logprob(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, temperature: float,
                         return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] or None, ids [N] -> fp32 (logp [N], entropy [N] or [0], lse [N])."""
    check_ids(ids, weight.shape[0])
    if ids.numel() == 0:  # an empty batch: nothing to tile over, on either backend
        empty = hidden.new_empty((0,), dtype=ref.compute_dtype(hidden))
        return empty, empty.clone(), empty.clone()
    impl, extra = _flp_impl(hidden)
    outs = impl.fused_linear_logprob_fwd(hidden, weight, bias, ids, temperature, return_entropy, **extra)
    return tuple(_out(x, hidden) for x in outs)


@fused_linear_logprob.register_fake
def _(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, temperature: float,
      return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    n = hidden.shape[0]
    new = lambda size: hidden.new_empty(size, dtype=ref.compute_dtype(hidden))
    return new((n,)), new((n if return_entropy else 0,)), new((n,))


@torch.library.custom_op("fastpo::fused_linear_logprob_backward", mutates_args=())
def fused_linear_logprob_backward(grad_logp: Tensor, grad_entropy: Tensor, grad_lse: Tensor, hidden: Tensor,
                                  weight: Tensor, bias: Tensor | None, ids: Tensor, lse: Tensor, entropy: Tensor,
                                  temperature: float, need_weight: bool = True,
                                  need_bias: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(d_hidden, d_weight, d_bias); d_weight / d_bias are empty [0] tensors when not needed (a frozen lm-head
    or no bias): the backward then skips their GEMM / reduction."""
    if ids.numel() == 0:  # no token contributes: zero gradients (the kernels' accumulators would stay unwritten)
        return (torch.zeros_like(hidden), torch.zeros_like(weight) if need_weight else _empty(hidden.device),
                torch.zeros_like(bias) if bias is not None and need_bias else _empty(hidden.device))
    impl, extra = _flp_impl(hidden)
    d_hidden, d_weight, d_bias = impl.fused_linear_logprob_bwd(grad_logp, grad_entropy, grad_lse, hidden, weight,
                                                               bias, ids, lse, entropy, temperature, need_weight,
                                                               need_bias, **extra)
    return (d_hidden, d_weight if d_weight is not None else _empty(hidden.device),
            d_bias if d_bias is not None else _empty(hidden.device))


@fused_linear_logprob_backward.register_fake
def _(grad_logp: Tensor, grad_entropy: Tensor, grad_lse: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None,
      ids: Tensor, lse: Tensor, entropy: Tensor, temperature: float, need_weight: bool = True,
      need_bias: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    empty = hidden.new_empty((0,), dtype=torch.float32)
    d_bias = torch.empty_like(bias) if bias is not None and need_bias else empty
    return torch.empty_like(hidden), torch.empty_like(weight) if need_weight else empty, d_bias


def _flp_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    hidden, weight, bias, ids, temperature, _ = inputs
    ctx.save_for_backward(hidden, weight, bias, ids, output[2], output[1])
    ctx.temperature = temperature


def _flp_backward(ctx: Any, grad_logp: Tensor, grad_entropy: Tensor, grad_lse: Tensor) -> tuple:
    hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
    need_weight, need_bias = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
    d_hidden, d_weight, d_bias = fused_linear_logprob_backward(grad_logp, grad_entropy, grad_lse, hidden, weight,
                                                               bias, ids, lse, entropy, ctx.temperature,
                                                               need_weight, need_bias)
    return (d_hidden, d_weight if need_weight else None, d_bias if need_bias else None, None, None, None)


fused_linear_logprob.register_autograd(_flp_backward, setup_context=_flp_setup)


# ------------------------------------------------------------------------------------------------ loss ops
# The losses are weighted token sums, so their forward also returns the per-token derivative (when need_grad) and
# the backward is a scale of it: no backward op, no recompute.
@torch.library.custom_op("fastpo::ppo_loss", mutates_args=())
def ppo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor, mask: Tensor,
             ref_logp: Tensor | None, entropy: Tensor | None, eps_low: float, eps_high: float, clip_c: float,
             kl_coef: float, kl_type: int, entropy_coef: float, need_grad: bool,
             is_weight: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted PPO loss over same-shape token tensors -> (loss [], stats fp32 [6], dloss/dlogp or [0]); see
    ``reference.ppo_loss_fwd``. is_weight: per-token off-policy weight on the clipped term (detached), or None."""
    impl = triton_module("losses") if backend_for(logp) == "triton" else ref
    loss, stats, d_logp = impl.ppo_loss_fwd(logp, old_logp, advantages, weights, mask, ref_logp, entropy, eps_low,
                                            eps_high, clip_c, kl_coef, kl_type, entropy_coef, need_grad, is_weight)
    return _out(loss, logp), stats, _out(d_logp, logp)


@ppo_loss.register_fake
def _(logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor, mask: Tensor, ref_logp: Tensor | None,
      entropy: Tensor | None, eps_low: float, eps_high: float, clip_c: float, kl_coef: float, kl_type: int,
      entropy_coef: float, need_grad: bool, is_weight: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    cd = ref.compute_dtype(logp)
    return (logp.new_empty((), dtype=cd), logp.new_empty((6,), dtype=torch.float32),
            logp.new_empty(logp.shape if need_grad else (0,), dtype=cd))


def _ppo_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    logp, entropy, weights, entropy_coef = inputs[0], inputs[6], inputs[3], inputs[12]
    ctx.save_for_backward(output[2], weights if entropy is not None else None)
    ctx.meta = (logp.dtype, entropy.dtype if entropy is not None else None, entropy_coef, inputs[13])


def _ppo_backward(ctx: Any, grad_loss: Tensor, _grad_stats: Tensor, _grad_d: Tensor) -> tuple:
    d_logp, weights = ctx.saved_tensors
    logp_dtype, entropy_dtype, entropy_coef, need_grad = ctx.meta
    if not need_grad and ctx.needs_input_grad[0]:  # (not d_logp.numel(): an empty logp has an empty gradient)
        raise RuntimeError("fastpo::ppo_loss was called with need_grad=False; pass a logp that requires grad")
    g_logp = (grad_loss * d_logp).to(logp_dtype)
    g_ent = (-entropy_coef * grad_loss * weights).to(entropy_dtype) if entropy_dtype is not None else None
    return (g_logp, None, None, None, None, None, g_ent) + (None,) * 8  # is_weight is a constant


ppo_loss.register_autograd(_ppo_backward, setup_context=_ppo_setup)


@torch.library.custom_op("fastpo::value_loss", mutates_args=())
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, weights: Tensor, mask: Tensor, clip: float,
               need_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted clipped value loss -> (loss [], stats fp32 [2] = [n_clipped, n_masked], dloss/dvalues or [0])."""
    impl = triton_module("losses") if backend_for(values) == "triton" else ref
    loss, stats, d_values = impl.value_loss_fwd(values, old_values, returns, weights, mask, clip, need_grad)
    return _out(loss, values), stats, _out(d_values, values)


@value_loss.register_fake
def _(values: Tensor, old_values: Tensor, returns: Tensor, weights: Tensor, mask: Tensor, clip: float,
      need_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    cd = ref.compute_dtype(values)
    return (values.new_empty((), dtype=cd), values.new_empty((2,), dtype=torch.float32),
            values.new_empty(values.shape if need_grad else (0,), dtype=cd))


def _value_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[2])
    ctx.values_dtype = inputs[0].dtype


def _value_backward(ctx: Any, grad_loss: Tensor, _grad_stats: Tensor, _grad_d: Tensor) -> tuple:
    (d_values,) = ctx.saved_tensors
    if d_values.numel() == 0 and ctx.needs_input_grad[0]:
        raise RuntimeError("fastpo::value_loss was called with need_grad=False; pass values that require grad")
    return ((grad_loss * d_values).to(ctx.values_dtype),) + (None,) * 6


value_loss.register_autograd(_value_backward, setup_context=_value_setup)


# ---------------------------------------------------------------------------------------- advantage ops
# Advantages are constants of the loss: these ops take detached inputs (functional.py detaches) and have no
# autograd formula.
@torch.library.custom_op("fastpo::gae_advantages", mutates_args=())
def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, reset: Tensor | None,
                   cu_seqlens: Tensor | None, gamma: float, lam: float, whiten: bool) -> tuple[Tensor, Tensor]:
    """Multi-turn GAE (+ optional segment resets) -> fp32 (advantages, returns) of mask's shape."""
    check_cu_seqlens(cu_seqlens, mask.shape[0])
    if backend_for(mask) == "triton":
        adv, ret = triton_module("advantages").gae_scan(rewards, values, mask, gamma, lam, reset, cu_seqlens)
        return (ref.masked_whiten(adv, mask) if whiten else adv), ret
    r, v, m, rs = ref.padded_view([rewards, values, mask, reset], cu_seqlens)
    return ref.unpad(ref.gae_scan(r, v, m, gamma, lam, rs, whiten), cu_seqlens, mask.shape[0])


@gae_advantages.register_fake
def _(rewards: Tensor, values: Tensor, mask: Tensor, reset: Tensor | None, cu_seqlens: Tensor | None, gamma: float,
      lam: float, whiten: bool) -> tuple[Tensor, Tensor]:
    return mask.new_empty(mask.shape, dtype=torch.float32), mask.new_empty(mask.shape, dtype=torch.float32)


@torch.library.custom_op("fastpo::grpo_advantages", mutates_args=())
def grpo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, cu_seqlens: Tensor | None,
                    norm_by_std: bool, eps: float) -> Tensor:
    """GRPO advantages broadcast to trained tokens -> fp32 of mask's shape."""
    check_cu_seqlens(cu_seqlens, mask.shape[0])
    if backend_for(mask) == "triton":
        return triton_module("advantages").grpo_advantages(scores, group_ids, mask, norm_by_std, eps, cu_seqlens)[1]
    return ref.grpo_advantages(scores, group_ids, mask, norm_by_std, eps, cu_seqlens)


@grpo_advantages.register_fake
def _(scores: Tensor, group_ids: Tensor, mask: Tensor, cu_seqlens: Tensor | None, norm_by_std: bool,
      eps: float) -> Tensor:
    return mask.new_empty(mask.shape, dtype=torch.float32)


def check_turn_layout(cu_turns: Tensor, n_turns: int, turn_ids: Tensor) -> None:
    """ValueError unless cu_turns starts at 0, never decreases and ends at M = n_turns, and every turn id lies in
    [-1, M) (one sync): the GiGPO kernels index memory with both."""
    steps = cu_turns[1:] - cu_turns[:-1]
    ids = turn_ids if turn_ids.numel() else cu_turns.new_full((1,), -1)
    stats = torch.stack([cu_turns[0], cu_turns[-1], steps.min() if steps.numel() else cu_turns[0] * 0,
                         ids.min().to(cu_turns.dtype), ids.max().to(cu_turns.dtype)])
    first, last, low, lo, hi = (int(x) for x in stats.tolist())
    if first != 0 or low < 0 or last != n_turns:
        raise ValueError(f"cu_turns must start at 0, be non-decreasing and end at M = {n_turns} (len(turn_keys)), "
                         f"got start {first}, end {last}, smallest step {low}")
    if lo < -1 or hi >= n_turns:
        raise ValueError(f"turn_ids must lie in [-1, {n_turns}) (-1: no turn; M = len(turn_keys)), got values in "
                         f"[{lo}, {hi}]")


@torch.library.custom_op("fastpo::gigpo_advantages", mutates_args=())
def gigpo_advantages(scores: Tensor, group_ids: Tensor, turn_keys: Tensor, turn_rewards: Tensor, cu_turns: Tensor,
                     turn_ids: Tensor, mask: Tensor, step_weight: float, step_gamma: float, norm_by_std: bool,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """GiGPO -> (token advantages fp32 [N], step advantages fp32 [M], step group sizes int64 [M])."""
    check_turn_layout(cu_turns, turn_keys.shape[0], turn_ids)
    args = (scores, group_ids, turn_keys, turn_rewards, cu_turns, turn_ids, mask, step_weight, step_gamma,
            norm_by_std, eps)
    if backend_for(mask) == "triton":
        return triton_module("gigpo").gigpo_advantages(*args)
    return reference_gigpo.gigpo_advantages(*args)


@gigpo_advantages.register_fake
def _(scores: Tensor, group_ids: Tensor, turn_keys: Tensor, turn_rewards: Tensor, cu_turns: Tensor, turn_ids: Tensor,
      mask: Tensor, step_weight: float, step_gamma: float, norm_by_std: bool,
      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    m = turn_keys.shape[0]
    return (mask.new_empty(mask.shape, dtype=torch.float32), turn_keys.new_empty((m,), dtype=torch.float32),
            turn_keys.new_empty((m,), dtype=torch.int64))
