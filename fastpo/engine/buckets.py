"""Buckets of a state dict for a weight push: about ``bucket_bytes`` each, a decoder layer never split, tensors
gathered (DTensors) and cast one bucket at a time, so the full model never exists twice on a rank.

    for bucket in iter_buckets(actor.state_dict(), 256 * 2**20, torch.bfloat16):
        engine_worker.load_weights(bucket)       # [(name, tensor), ...]
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _layer_key(name: str) -> str:
    """The decoder layer a tensor belongs to (``model.layers.3``), or its own name for the rest."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def iter_buckets(state: Mapping[str, Any], bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split a state dict, in order, into buckets of about ``bucket_bytes`` (never splitting a decoder layer, so a
    fused vLLM layer always receives all its pieces together). Tensors stay lazy until their bucket is yielded:
    DTensors are gathered (``full_tensor``) then, one bucket at a time. With `dtype`, floating tensors come out in
    it (a DTensor is cast before its gather). A tensor object listed under several names (tied weights) is gathered
    once and kept until its last name has been yielded."""
    counts: dict[int, int] = {}
    for value in state.values():
        counts[id(value)] = counts.get(id(value), 0) + 1
    shared: dict[int, torch.Tensor] = {}
    bucket: list[tuple[str, Any]] = []
    size, last_layer = 0, None
    for name, value in state.items():
        layer = _layer_key(name)
        if bucket and size >= bucket_bytes and layer != last_layer:
            yield _materialise(bucket, dtype, counts, shared)
            bucket, size = [], 0
        bucket.append((name, value))
        floating = dtype is not None and value.dtype.is_floating_point
        size += value.numel() * (dtype.itemsize if floating else value.element_size())
        last_layer = layer
    if bucket:
        yield _materialise(bucket, dtype, counts, shared)


def _materialise(bucket: list[tuple[str, Any]], dtype: torch.dtype | None, counts: dict[int, int],
                 shared: dict[int, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, value in bucket:
        key = id(value)
        if key in shared:
            tensor = shared[key]
        else:
            tensor = value
            cast = dtype is not None and value.dtype.is_floating_point and value.dtype != dtype
            if cast and isinstance(value, torch.Tensor):
                tensor = tensor.to(dtype)  # a DTensor casts its local shard: the all-gather moves dtype's bytes
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if cast:
                tensor = tensor.to(dtype)  # no-op unless it was a LoRAMergedWeight
            tensor = tensor.detach()
        counts[key] -= 1
        if counts[key] > 0:
            shared[key] = tensor
        else:
            shared.pop(key, None)
        out.append((name, tensor))
    return out
