"""Trajectories as the trainer holds them and the micro-batches its forwards run on.

``Sample`` is one trajectory (numpy, picklable for the all-gather). ``pack`` groups consecutive trajectories into
micro-batches of at most ``max_tokens`` tokens; every per-token tensor of a micro-batch is PACKED ([N],
trajectories concatenated, ``cu_seqlens`` marking the boundaries). The forward sees a micro-batch in one of two
layouts (``optim.micro_batch_layout``; see ``fastpo.trainer``): packed (one row, position ids restarting per
trajectory) or padded (one right-padded row per trajectory, plain causal attention), and ``MicroBatch.to_packed``
brings a padded forward's output back into the packed order. ``lm_head_inputs`` reads the last hidden states and
the lm-head weight through the ROOT module's forward (FSDP2-safe), so logits are never built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn


@dataclass
class Sample:
    """One trajectory as the trainer sees it (numpy, picklable for the all-gather); token arrays are [T]."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    sample_logprobs: np.ndarray
    token_rewards: np.ndarray
    turn_end: np.ndarray
    score: float
    group: int
    exact: bool
    old_logp: np.ndarray | None = None
    """fp32 [T], filled by Trainer._score: the trainer's logp of each trained token (0 elsewhere)."""
    ref_logp: np.ndarray | None = None
    values: np.ndarray | None = None
    advantages: np.ndarray | None = None
    returns: np.ndarray | None = None


@dataclass
class MicroBatch:
    """Packed trajectories: ids / position_ids [1, N], cu_seqlens int64 [B + 1], indices into the sample list; in
    the padded layout also padded_ids [B, L] (right-padded with 0) and padded_index [N] (where each packed token
    sits in the flattened [B * L])."""

    indices: list[int]
    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    scale: float = 1.0
    padded_ids: Tensor | None = None
    padded_index: Tensor | None = None

    def to_packed(self, rows: Tensor) -> Tensor:
        """A forward's output in this micro-batch's layout ([1, N, ...] packed or [B, L, ...] padded) -> [1, N, ...]."""
        if self.padded_index is None:
            return rows
        return rows.reshape(-1, *rows.shape[2:]).index_select(0, self.padded_index)[None]


def pack(samples: list[Sample], indices: list[int], max_tokens: int, device: torch.device,
         padded: bool = False) -> list[MicroBatch]:
    """Greedy packing in order: consecutive trajectories while the micro-batch stays within `max_tokens` tokens;
    `padded` adds the padded layout's [B, L] ids (see the module docstring)."""
    groups: list[list[int]] = []
    used = max_tokens + 1
    for i in indices:
        n = len(samples[i].input_ids)
        if used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    out = []
    for g in groups:
        lens = [len(samples[i].input_ids) for i in g]
        ids = torch.from_numpy(np.concatenate([samples[i].input_ids for i in g])).to(device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)
        cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int64, device=device)
        mb = MicroBatch(g, ids[None], pos[None], cu)
        if padded:
            width = max(lens)
            rows = np.zeros((len(g), width), dtype=np.int64)
            for r, i in enumerate(g):
                rows[r, : lens[r]] = samples[i].input_ids
            mb.padded_ids = torch.from_numpy(rows).to(device)
            flat = np.concatenate([r * width + np.arange(n) for r, n in enumerate(lens)])
            mb.padded_index = torch.from_numpy(flat).to(device)
        out.append(mb)
    return out


def cat_tokens(samples: list[Sample], indices: list[int], field: str, device: torch.device) -> Tensor:
    """Packed [N] tensor of one per-token field over the given trajectories."""
    return torch.from_numpy(np.concatenate([getattr(samples[i], field) for i in indices])).to(device)


def split_tokens(values: Tensor, cu_seqlens: Tensor) -> list[np.ndarray]:
    """Packed [N] -> one numpy array per trajectory."""
    cu = cu_seqlens.tolist()
    flat = values.detach().float().cpu().numpy()
    return [flat[cu[i]:cu[i + 1]].copy() for i in range(len(cu) - 1)]


def lm_head_inputs(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor | None]:
    """Last hidden states [1, N, H] in packed token order (after the final norm), lm-head weight [V, H] and bias of
    a causal LM, from the ROOT forward with ``logits_to_keep=1`` (FSDP2-safe; see the module docstring), in the
    micro-batch's layout."""
    captured: list[Tensor] = []
    decoder = model.get_decoder()
    handle = decoder.register_forward_hook(lambda mod, args, out: captured.append(out.last_hidden_state))
    try:
        if mb.padded_ids is None:
            model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=1)
        else:
            model(input_ids=mb.padded_ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    head = model.get_output_embeddings()
    return mb.to_packed(captured[0]), head.weight, getattr(head, "bias", None)
