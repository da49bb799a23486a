"""Sampling of the built-in engine: per-request random streams, top-k / top-p masks and inverse-CDF draws.

    u = request_uniforms(seeds, steps)                  # float64 [R, steps], a function of (seed, step) only
    tokens, logp, raw = sample_tokens(logits, u[:, t], temperature, top_k, top_p)

A request's draws depend only on its seed and its own logits, never on the other rows of the batch: that is what
makes a request's tokens independent of what else the engine is decoding (lock-step batch or continuous batching).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import GREEDY_EPS

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def request_uniforms(seeds: Sequence[int], steps: int) -> np.ndarray:
    """The random stream of each request: ``u[i, t]`` in [0, 1) is the t-th draw of request i.

    A function of ``(seeds[i], t)`` only (splitmix64 seeded with a mix of the seed), so it does not depend on the
    batch, the device or torch's global RNG. Returns float64 [len(seeds), steps] with 53 random bits each.
    """
    mask = (1 << 64) - 1
    with np.errstate(over="ignore"):
        state = _mix64(np.array([int(s) & mask for s in seeds], dtype=np.uint64) ^ np.uint64(0x5851F42D4C957F2D))
        counters = state[:, None] + np.arange(1, steps + 1, dtype=np.uint64)[None, :] * _GOLDEN_GAMMA
        bits = _mix64(counters)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k and then top-p exclude (vLLM's order: top-p acts on the top-k renormalised
    distribution; ties at the k-th value are kept). logits: [B, V] fp32 (already divided by the temperature)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p  # the kept prefix is the smallest one whose mass reaches top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: [B, V] (any float dtype; computed in fp32).
        uniforms: [B] float64 in [0, 1): each row's draw (``request_uniforms``); unused when greedy.
        temperature: < 1e-5 means argmax.
        top_k, top_p: restrict the tokens that can be drawn (``apply_top_k_top_p``).

    Returns:
        tokens [B] int64; logprobs [B] fp32 = ``log_softmax(logits / T)`` at the token over the full vocab (T = 1
        when greedy); raw_logprobs [B] fp32 = ``log_softmax(logits)`` at the token.
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    if temperature < GREEDY_EPS:
        tokens = logits.argmax(dim=-1)
        picked = raw.gather(1, tokens[:, None]).squeeze(1)
        return tokens, picked, picked
    scaled = logits if temperature == 1.0 else logits / temperature
    logp = raw if temperature == 1.0 else torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total: never step past the last token that may be drawn.
    last_allowed = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    tokens = torch.minimum(tokens, last_allowed)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), raw.gather(1, tokens[:, None]).squeeze(1)
