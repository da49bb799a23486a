"""The micro-batches the trainer's forwards run on, packed from ``fastpo.rollout.Trajectory`` objects.

``pack`` groups consecutive trajectories into
micro-batches of at most ``max_tokens`` tokens; every per-token tensor of a micro-batch is PACKED ([N],
trajectories concatenated, ``cu_seqlens`` marking the boundaries). The forward sees a micro-batch in one of three
layouts (``optim.micro_batch_layout``; see ``fastpo.trainer``): packed (one row, position ids restarting per
trajectory), padded (one right-padded row per trajectory, plain causal attention) or shared (one row per group:
the prompt prefix its trajectories have in common once, then each trajectory's own tokens, with a 4D mask that lets
each of them see the prefix and itself only, and position ids continuing from the prefix; the forward of a prefix
shared by G completions runs once instead of G times, and its gradient is the sum of theirs).
``MicroBatch.to_packed`` brings a row layout's output back into the packed order. ``lm_head_inputs`` reads the last
hidden states and the lm-head weight through the ROOT module's forward (FSDP2-safe), so logits are never built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from .rollout import Trajectory

LAYOUTS = ("packed", "padded", "shared")


@dataclass
class MicroBatch:
    """Packed trajectories: ids / position_ids [1, N], cu_seqlens int64 [B + 1], indices into the sample list. The
    row layouts (padded, shared) add padded_ids [R, L] (right-padded with 0) and padded_index [N] (where each packed
    token's output sits in the flattened [R * L]; in the shared layout the prefix tokens of a group's trajectories
    all point at the one copy in their row); the shared layout also row_pos [R, L] (position ids) and row_mask bool
    [R, 1, L, L] (True = may attend). ``max_seqlen`` is the longest trajectory (host int, known when packing)."""

    indices: list[int]
    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    scale: float = 1.0
    padded_ids: Tensor | None = None
    padded_index: Tensor | None = None
    row_pos: Tensor | None = None
    row_mask: Tensor | None = None
    max_seqlen: int = 0

    def to_packed(self, rows: Tensor) -> Tensor:
        """A forward's output in this micro-batch's layout ([1, N, ...] packed or [R, L, ...] rows) -> [1, N, ...].
        Shared prefix positions are gathered once per trajectory, so their gradients add up in the one copy."""
        if self.padded_index is None:
            return rows
        return rows.reshape(-1, *rows.shape[2:]).index_select(0, self.padded_index)[None]

    def model_inputs(self, model: nn.Module) -> dict[str, Tensor]:
        """Keyword arguments of a transformers forward over this micro-batch in its layout. The shared layout's
        mask goes in as a 4D mask (used as given by transformers): boolean for sdpa, additive (0 / dtype min) for
        eager attention; flash_attention_2 takes no such mask. Packed rows under flash_attention_2 also carry the
        varlen boundaries (``cu_seq_lens_q/k`` int32 [B + 1], ``max_length_q/k`` int): transformers would
        otherwise re-derive them from the position ids in every layer, with a host sync each time."""
        if self.padded_ids is None:
            inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
            if _attn_implementation(model) == "flash_attention_2":
                cu = self.cu_seqlens.to(torch.int32)
                max_len = self.max_seqlen or int(torch.diff(self.cu_seqlens).max())
                inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
            return inputs
        if self.row_mask is None:
            return {"input_ids": self.padded_ids}
        attn = _attn_implementation(model)
        if attn == "flash_attention_2":
            raise ValueError("optim.micro_batch_layout=shared needs a 4D attention mask, which flash_attention_2 does "
                             "not take: use packed (or auto) with flash_attention_2")
        mask = self.row_mask
        if attn != "sdpa":
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return {"input_ids": self.padded_ids, "position_ids": self.row_pos, "attention_mask": mask}


def _attn_implementation(model: nn.Module) -> str | None:
    """The transformers attention implementation of a causal LM, a peft model or a ``CriticModel``."""
    config = getattr(model, "config", None) or model.backbone.config
    return getattr(config, "_attn_implementation", None)


def token_cost(model: nn.Module) -> float:
    """The linear-layer FLOPs of one position relative to one attention pair, per layer: (8H^2 + 6HI) / 4H =
    2H + 1.5I for hidden size H and MLP width I (q/k/v/o taken as H x H, a gated MLP; an attention pair is a
    length-H dot product for the score plus one for the value). The shared layout's cost estimate; 0 when the
    model has no transformers config (then attention alone decides)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "backbone", None), "config", None)
    h = getattr(config, "hidden_size", 0) or 0
    i = getattr(config, "intermediate_size", None) or 4 * h
    return float(2 * h + 1.5 * i)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _row_cost(widths: list[int], token_cost: float) -> float:
    """Estimated forward cost of rows padded to one width W: R * (token_cost * W + W^2) (every position runs the
    linear layers; dense attention scores every pair of the row)."""
    w = max(widths)
    return len(widths) * (token_cost * w + w * w)


def _clusters(trajs: list[Trajectory], g: list[int]) -> list[tuple[int, list[int]]]:
    """The trajectories of one micro-batch grouped by Trajectory.group, in order of first appearance: (shared prefix
    length, members). The prefix is the shortest common prefix of each member with the group's first member (0 for
    a group of one: it shares nothing)."""
    by_group: dict[int, list[int]] = {}
    for i in g:
        by_group.setdefault(trajs[i].group, []).append(i)
    out = []
    for members in by_group.values():
        head = trajs[members[0]].input_ids
        p = min((_lcp(head, trajs[i].input_ids) for i in members[1:]), default=0)
        out.append((p, members))
    return out


def _shared_rows(trajs: list[Trajectory], g: list[int], token_cost: float):
    """The shared layout of one micro-batch: one row per group, [prefix once | each member's suffix], or None when
    it is not cheaper than one padded row per trajectory (by _row_cost). Returns (rows, positions, mask, index,
    order) where order lists the members row by row (the trajectories' order in the micro-batch)."""
    clusters = _clusters(trajs, g)
    widths = [p + sum(len(trajs[i].input_ids) - p for i in members) for p, members in clusters]
    if len(clusters) == len(g) or _row_cost(widths, token_cost) >= _row_cost(
            [len(trajs[i].input_ids) for i in g], token_cost):
        return None
    width = max(widths)
    rows = np.zeros((len(clusters), width), np.int64)
    pos = np.zeros((len(clusters), width), np.int64)
    seg = np.full((len(clusters), width), -2, np.int64)  # -1 prefix, k member k's suffix, -2 padding
    index, order = [], []
    for r, (p, members) in enumerate(clusters):
        rows[r, :p] = trajs[members[0]].input_ids[:p]
        pos[r, :p] = np.arange(p)
        seg[r, :p] = -1
        off = p
        for k, i in enumerate(members):
            ids = trajs[i].input_ids
            n = len(ids) - p
            rows[r, off:off + n] = ids[p:]
            pos[r, off:off + n] = np.arange(p, len(ids))
            seg[r, off:off + n] = k
            index.append(np.concatenate([r * width + np.arange(p), r * width + off + np.arange(n)]))
            order.append(i)
            off += n
    q, j = np.arange(width)[:, None], np.arange(width)[None, :]
    # a suffix token sees the prefix and its own earlier tokens; a prefix token its earlier prefix; a pad the prefix
    # and the pads before it (never an empty row, so no NaN in the softmax)
    mask = (j <= q)[None] & ((seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None]))
    return rows, pos, mask[:, None], np.concatenate(index), order


def pack(trajs: list[Trajectory], indices: list[int], max_tokens: int, device: torch.device, layout: str = "packed",
         token_cost: float = 0.0) -> list[MicroBatch]:
    """Greedy packing in order: consecutive trajectories while the micro-batch stays within `max_tokens` tokens.
    `layout` (one of LAYOUTS) adds the row layouts (see the module docstring). In the shared layout a trajectory
    counts only the tokens past its common prefix with the first trajectory of its group already in the
    micro-batch (what the forward runs), and each micro-batch takes shared rows only where _row_cost, with
    `token_cost` = linear-layer cost of one position in units of one attention pair, says they are cheaper than
    one padded row per trajectory (which it falls back to)."""
    if layout not in LAYOUTS:
        raise ValueError(f"micro-batch layout must be one of {LAYOUTS}, got {layout!r}")
    groups: list[list[int]] = []
    heads: dict[int, int] = {}
    used = max_tokens + 1
    for i in indices:
        ids = trajs[i].input_ids
        head = heads.get(trajs[i].group) if layout == "shared" else None
        n = len(ids) - (_lcp(trajs[head].input_ids, ids) if head is not None else 0)
        if used + n > max_tokens:
            groups.append([])
            heads, used, n = {}, 0, len(ids)
        heads.setdefault(trajs[i].group, i)
        groups[-1].append(i)
        used += n
    out = []
    for g in groups:
        shared = _shared_rows(trajs, g, token_cost) if layout == "shared" else None
        if shared is not None:
            g = shared[4]
        elif layout == "shared" and sum(len(trajs[i].input_ids) for i in g) > max_tokens:
            # packed by its shared size but cheaper as padded rows: re-pack by full lengths to stay in the budget
            out.extend(pack(trajs, g, max_tokens, device, "padded"))
            continue
        lens = [len(trajs[i].input_ids) for i in g]
        ids = torch.from_numpy(np.concatenate([trajs[i].input_ids for i in g])).to(device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)
        cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int64, device=device)
        mb = MicroBatch(g, ids[None], pos[None], cu, max_seqlen=max(lens))
        if shared is not None:
            rows, row_pos, mask, index, _ = shared
            mb.padded_ids, mb.row_pos = torch.from_numpy(rows).to(device), torch.from_numpy(row_pos).to(device)
            mb.row_mask, mb.padded_index = torch.from_numpy(mask).to(device), torch.from_numpy(index).to(device)
        elif layout != "packed":
            width = max(lens)
            rows = np.zeros((len(g), width), dtype=np.int64)
            for r, i in enumerate(g):
                rows[r, : lens[r]] = trajs[i].input_ids
            mb.padded_ids = torch.from_numpy(rows).to(device)
            flat = np.concatenate([r * width + np.arange(n) for r, n in enumerate(lens)])
            mb.padded_index = torch.from_numpy(flat).to(device)
        out.append(mb)
    return out


def cat_tokens(trajs: list[Trajectory], indices: list[int], field: str, device: torch.device) -> Tensor:
    """Packed [N] tensor of one per-token field over the given trajectories."""
    return torch.from_numpy(np.concatenate([getattr(trajs[i], field) for i in indices])).to(device)


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
        model(**mb.model_inputs(model), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    head = model.get_output_embeddings()
    return mb.to_packed(captured[0]), head.weight, getattr(head, "bias", None)
