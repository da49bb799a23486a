"""Grouped-query attention for the built-in engine's CPU forwards, without copying the KV cache per head.

The engine always passes transformers an additive 4D mask ([R, 1, P, W]: slots of different lengths share one
forward). With a mask, transformers' ``sdpa`` attention repeats each key / value head ``heads / kv_heads`` times
(``repeat_kv``: one [R, heads, W, head_dim] copy of K and of V per layer and forward) because its fused GQA path is
only taken without a mask. On a CPU, where decoding is bound by memory traffic, that copy costs about as much as the
attention itself: on the 52M bench model (12 heads, 2 KV heads, 8 layers) it is ~1.3 ms of a layer's 1.6 ms at
batch 8 and 232 columns. PyTorch's CPU kernel takes the mask and ``enable_gqa=True`` together and gives the same
numbers (bit for bit in the engine tests), so the engine's forwards use it on CPU.

A decode step (one query per row) goes further: the query heads that share a KV head are passed as that KV head's
queries ([R, kv_heads, heads / kv_heads, D] against [R, kv_heads, W, D]), so the kernel reads each KV head once per
layer instead of once per query head. On the bench model with 31 rows of ~900 columns that took the attention of a
layer from 2.2 to 1.8 ms in the engine (bf16; the cache no longer fits the CPU's caches there) and 2.2x less in
fp32 when it does. Same dot products and softmax per query, another summation order: logprobs move by ~3e-6 in fp32.

Only the engine's forwards switch (``gqa_attention``, a context manager around one forward): the trainer's forward
and CUDA forwards keep the model's own attention (with a mask, CUDA's fused kernels do not take ``enable_gqa``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface

#: The name the engine's attention is registered under in transformers' attention registry.
NAME = "fastpo_gqa_sdpa"


def _gqa_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. query [R, heads, P, D]; key, value [R, kv_heads, W, D]; attention_mask
    additive [R, 1, P, W] (the engine always passes one). Returns ([R, P, heads, D], None)."""
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length == 1 and heads != kv_heads and (attention_mask is None or attention_mask.shape[1:3] == (1, 1)):
        # decode: the heads that share a KV head become that head's queries, so each KV head is read once per
        # forward, not once per query head (1.75-3x faster on the bench model). Per row and per query the same
        # dot products and online softmax; only float rounding differs (2.7e-7 in fp32).
        grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=attention_mask is None and bool(is_causal) and query.shape[2] > 1,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, _gqa_sdpa)


def _grouped(model: nn.Module) -> bool:
    """True when the model's layers have fewer KV heads than query heads (otherwise there is nothing to save)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    return (getattr(config, "num_key_value_heads", None) or heads) < heads


@contextlib.contextmanager
def gqa_attention(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run the forwards inside with the mask-and-GQA SDPA when the model uses ``sdpa`` on a CPU and its attention is
    grouped; otherwise change nothing. The model's attention setting is restored on exit, also on an error."""
    config = model.config
    if device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa" or not _grouped(model):
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
