"""Triton kernels for per-token log-probabilities: from given logits, and fused with the lm-head matmul.

Imported lazily (only when the Triton path runs): this module imports triton at the top. Every kernel loads its
inputs in whatever dtype they come, casts to fp32 right after the load and accumulates in fp32; the only
low-precision compute is ``tl.dot`` on bf16/fp16 operands (fp32 accumulator) on a GPU. Under the Triton
interpreter (CPU tensors) the dot operands are cast to fp32 first, since the interpreter's bf16 arithmetic is
wrong. Entry points: :func:`selective_logprob_fwd` / ``_bwd`` and :func:`fused_linear_logprob_fwd` / ``_bwd``,
with the same signatures and results as their namesakes in ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Interpreter-friendly sizes on CPU tensors, MMA-friendly ones on a GPU.
_CPU = {"BLOCK_N": 16, "BLOCK_V": 512, "BLOCK_K": 32, "ROW_BLOCK": 4096, "GRAD_ELEMENTS": 1 << 16}
_GPU = {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": 64, "ROW_BLOCK": 4096, "GRAD_ELEMENTS": 1 << 29}


def _cfg(t: torch.Tensor) -> dict:
    return _GPU if t.is_cuda else _CPU


def _dot_opts(t: torch.Tensor) -> tuple[bool, str]:
    """(cast dot operands to fp32, tl.dot input_precision): bf16/fp16 tensor-core dots on a GPU; exact fp32
    ("ieee", no TF32) otherwise, and always fp32 operands under the interpreter."""
    half = t.dtype in (torch.bfloat16, torch.float16)
    return (not t.is_cuda) or not half, "tf32" if half else "ieee"


# --------------------------------------------------------------------------------------- logprob from logits
# Kernel: one program per row; loops over the vocab in BLOCK_V chunks with an online log-sum-exp, then reads
# the target logit directly. Layout: logits rows are (outer, inner) = divmod(row, rows_per_outer) with strides
# (stride_outer, stride_row) and a contiguous vocab dim, so [R, V] tensors and [B, T, V] slices such as
# logits[:, :-1] are read in place. Writes fp32 logp and lse per row. Backward: _selective_bwd_kernel.
@triton.jit
def _selective_fwd_kernel(logits_ptr, ids_ptr, logp_ptr, lse_ptr, V, rows_per_outer, stride_outer, stride_row,
                          inv_t, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // rows_per_outer) * stride_outer + (row % rows_per_outer) * stride_row
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    target = tl.load(ids_ptr + row).to(tl.int64)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.load(base + target).to(tl.float32) * inv_t - lse)


# Kernel: grid (rows, vocab blocks); recomputes p = exp(logits / T - lse) for its block and writes
# dL/dlogits = (g_logp * onehot + (g_lse - g_logp) * p) / T into a contiguous [R, V] tensor of the logits' dtype.
@triton.jit
def _selective_bwd_kernel(logits_ptr, ids_ptr, lse_ptr, g_ptr, glse_ptr, out_ptr, V, rows_per_outer, stride_outer,
                          stride_row, inv_t, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    base = logits_ptr + (row // rows_per_outer) * stride_outer + (row % rows_per_outer) * stride_row
    z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32) * inv_t
    g = tl.load(g_ptr + row).to(tl.float32)
    coef = tl.load(glse_ptr + row).to(tl.float32) - g
    target = tl.load(ids_ptr + row).to(tl.int64)
    grad = tl.exp(z - tl.load(lse_ptr + row)) * coef + tl.where(cols == target, g, 0.0)
    tl.store(out_ptr + row * V + cols, (grad * inv_t).to(out_ptr.dtype.element_ty), mask=ok)


def _row_layout(logits: torch.Tensor) -> tuple[int, int, int]:
    if logits.dim() == 2:
        return max(logits.shape[0], 1), 0, logits.stride(0)
    return max(logits.shape[1], 1), logits.stride(0), logits.stride(1)


def selective_logprob_fwd(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """logits ``[R, V]`` or ``[B, T, V]`` (vocab dim contiguous), ids of shape logits.shape[:-1] ->
    fp32 (logp, lse) of ids' shape."""
    vocab = logits.shape[-1]
    logp = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    if ids.numel():
        inner, s_outer, s_row = _row_layout(logits)
        block = min(_cfg(logits)["ROW_BLOCK"], triton.next_power_of_2(vocab))
        _selective_fwd_kernel[(ids.numel(),)](logits, ids.contiguous(), logp, lse, vocab, inner, s_outer, s_row,
                                              1.0 / temperature, BLOCK_V=block)
    return logp, lse


def selective_logprob_bwd(grad_logp, grad_lse, logits, ids, lse, temperature: float) -> torch.Tensor:
    """Gradient w.r.t. logits (contiguous, logits' shape and dtype)."""
    vocab = logits.shape[-1]
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if ids.numel():
        inner, s_outer, s_row = _row_layout(logits)
        block = min(_cfg(logits)["ROW_BLOCK"], triton.next_power_of_2(vocab))
        grid = (ids.numel(), triton.cdiv(vocab, block))
        _selective_bwd_kernel[grid](logits, ids.contiguous(), lse, grad_logp.float().contiguous(),
                                    grad_lse.float().contiguous(), out, vocab, inner, s_outer, s_row,
                                    1.0 / temperature, BLOCK_V=block)
    return out


# ------------------------------------------------------------------------------------- fused linear logprob
# Kernel: grid (token blocks, vocab splits). A program owns BLOCK_N tokens and one contiguous vocab range; it
# walks the range in BLOCK_V tiles, each tile z = (x @ w.T + b) / T computed by tl.dot over H in BLOCK_K steps
# (fp32 accumulator), and keeps per token an online log-sum-exp (max m, sum s), the entropy accumulator
# t = sum exp(z - m) (z - m) and the target logit. Never writes logits: only 4 fp32 partials per (split, token)
# to part[4, SPLIT, N], combined by the host (``_combine``). pid 0 is the fastest grid axis, so the token
# blocks of one split run together and read the same lm-head tiles from L2. Layout: x [N, H], w [V, H] and b
# [V] contiguous. Backward recomputes the tiles (_flp_grad_kernel).
@triton.jit
def _flp_fwd_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, part_ptr, N, V, H, v_per_split, inv_t,
                    HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    v_lo = split * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    target = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * H
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * H
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc=acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        target += tl.sum(tl.where(cols[None, :] == ids[:, None], z, 0.0), 1)
        m_new = tl.maximum(m_i, tl.max(z, 1))
        alpha = tl.exp(m_i - m_new)
        zc = z - m_new[:, None]
        p = tl.exp(zc)
        if WANT_ENT:
            shift = tl.where(s_i > 0, m_i - m_new, 0.0)
            t_i = alpha * (t_i + shift * s_i) + tl.sum(p * tl.where(col_ok[None, :], zc, 0.0), 1)
        s_i = s_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = part_ptr + split * N + rows
    tl.store(out, m_i, mask=row_ok)
    tl.store(out + n_splits * N, s_i, mask=row_ok)
    tl.store(out + 2 * n_splits * N, t_i, mask=row_ok)
    tl.store(out + 3 * n_splits * N, target, mask=row_ok)


# Kernel: grid over (token blocks x vocab blocks) of one vocab chunk [v_lo, v_lo + Vc), grouped GROUP_V vocab
# blocks at a time so that a group's lm-head tiles stay in L2 while every token block passes over them.
# Recomputes the logits tile exactly as the forward (tl.dot over H) and writes dL/dlogits of the tile,
# (g_logp * onehot + p * (g_lse - g_logp - g_ent * (log p + entropy))) / T, into the chunk buffer G [N, Vc]
# (hidden's dtype). The host then does dX += G @ w[chunk], dW[chunk] = G.T @ x, db[chunk] = G.sum(0) as GEMMs.
@triton.jit
def _flp_grad_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, g_ptr, glse_ptr, gent_ptr, out_ptr,
                     N, V, H, v_lo, Vc, inv_t,
                     HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    v_blocks = tl.cdiv(Vc, BLOCK_V)
    per_group = GROUP_V * n_blocks
    first_v = (pid // per_group) * GROUP_V
    group_v = tl.minimum(v_blocks - first_v, GROUP_V)
    pid_v = first_v + (pid % per_group) % group_v
    pid_n = (pid % per_group) // group_v
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v_lo + local
    row_ok = rows < N
    col_ok = (local < Vc) & (cols < V)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * H
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * H
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc=acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(glse_ptr + rows, mask=row_ok, other=0.0) - g
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    logp = acc * inv_t - lse[:, None]
    p = tl.exp(logp)
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        grad = p * (coef[:, None] - g_ent[:, None] * (logp + ent[:, None]))
    else:
        grad = p * coef[:, None]
    grad += tl.where(cols[None, :] == ids[:, None], g[:, None], 0.0)
    grad = tl.where(row_ok[:, None] & col_ok[None, :], grad * inv_t, 0.0)
    out = out_ptr + rows.to(tl.int64)[:, None] * Vc + local[None, :]
    tl.store(out, grad.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (local < Vc)[None, :])


def _n_splits(hidden: torch.Tensor, n_token_blocks: int, vocab: int, block_v: int) -> int:
    """Vocab splits so that the forward grid fills the GPU (one per SM is plenty); 1 under the interpreter."""
    if not hidden.is_cuda:
        return 1
    sms = torch.cuda.get_device_properties(hidden.device).multi_processor_count
    want = max(1, triton.cdiv(2 * sms, n_token_blocks))
    return max(1, min(want, triton.cdiv(vocab, block_v)))


def _combine(part: torch.Tensor):
    """[4, S, N] partials (max, sum, entropy acc, target) -> (lse, entropy, target) fp32 [N]."""
    m, s, t, target = part[0], part[1], part[2], part[3].sum(0)
    m_max = m.amax(0)
    scale = torch.exp(m - m_max)
    total = (s * scale).sum(0)
    shift = torch.where(s > 0, m - m_max, 0.0)
    t_total = (scale * (t + shift * s)).sum(0)
    log_total = torch.log(total)
    return m_max + log_total, log_total - t_total / total, target


def fused_linear_logprob_fwd(hidden, weight, bias, ids, temperature: float, return_entropy: bool):
    """hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, ids ``[N]`` -> fp32 (logp [N], entropy [N] or
    [0], lse [N]). Contiguous inputs of one dtype."""
    n_tokens, hid = hidden.shape
    vocab = weight.shape[0]
    cfg = _cfg(hidden)
    dot_f32, prec = _dot_opts(hidden)
    n_blocks = triton.cdiv(n_tokens, cfg["BLOCK_N"])
    splits = _n_splits(hidden, n_blocks, vocab, cfg["BLOCK_V"])
    v_per_split = triton.cdiv(triton.cdiv(vocab, splits), cfg["BLOCK_V"]) * cfg["BLOCK_V"]
    splits = triton.cdiv(vocab, v_per_split)
    part = torch.empty(4, splits, n_tokens, dtype=torch.float32, device=hidden.device)
    if n_tokens:
        _flp_fwd_kernel[(n_blocks, splits)](
            hidden, weight, bias if bias is not None else hidden, ids, part, n_tokens, vocab, hid, v_per_split,
            1.0 / temperature, HAS_BIAS=bias is not None, WANT_ENT=return_entropy, DOT_F32=dot_f32, PREC=prec,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
        )
    lse, entropy, target = _combine(part)
    if not return_entropy:
        entropy = torch.empty(0, dtype=torch.float32, device=hidden.device)
    return target - lse, entropy, lse


def fused_linear_logprob_bwd(grad_logp, grad_entropy, grad_lse, hidden, weight, bias, ids, lse, entropy,
                             temperature):
    """Recomputing backward. Loops over vocab chunks of at most GRAD_ELEMENTS / N columns (and token chunks when
    N alone exceeds that): the Triton kernel writes the chunk's dL/dlogits, cuBLAS does the three GEMMs. Peak
    extra memory: one [tokens, Vc] buffer in hidden's dtype plus an fp32 dX accumulator [N, H]."""
    n_tokens, hid = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    cfg = _cfg(hidden)
    dot_f32, prec = _dot_opts(hidden)
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    zeros = torch.zeros(n_tokens, dtype=torch.float32, device=dev)
    g = grad_logp.float().contiguous() if grad_logp is not None else zeros
    g_lse = grad_lse.float().contiguous() if grad_lse is not None else zeros
    has_gent = grad_entropy is not None and grad_entropy.numel() > 0
    g_ent = grad_entropy.float().contiguous() if has_gent else zeros
    ent = entropy if has_gent else zeros
    token_chunk = max(bn, min(n_tokens, cfg["GRAD_ELEMENTS"] // bv))
    vocab_chunk = max(bv, min(triton.cdiv(vocab, bv) * bv, (cfg["GRAD_ELEMENTS"] // max(token_chunk, 1)) // bv * bv))
    d_hidden = torch.zeros(n_tokens, hid, dtype=torch.float32, device=dev)
    single = token_chunk >= n_tokens
    d_weight = torch.empty_like(weight) if single else torch.zeros(weight.shape, dtype=torch.float32, device=dev)
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if bias is not None else None
    buf = torch.empty(min(token_chunk, n_tokens) * vocab_chunk, dtype=hidden.dtype, device=dev)
    for n0 in range(0, n_tokens, token_chunk):
        n1 = min(n0 + token_chunk, n_tokens)
        rows = n1 - n0
        x = hidden[n0:n1]
        for v0 in range(0, vocab, vocab_chunk):
            width = min(vocab_chunk, vocab - v0)
            grad = buf[: rows * width].view(rows, width)
            grid = (triton.cdiv(rows, bn) * triton.cdiv(width, bv),)
            _flp_grad_kernel[grid](
                x, weight, bias if bias is not None else hidden, ids[n0:n1], lse[n0:n1], ent[n0:n1] if has_gent
                else ent, g[n0:n1], g_lse[n0:n1], g_ent[n0:n1] if has_gent else g_ent, grad, rows, vocab, hid,
                v0, width, 1.0 / temperature, HAS_BIAS=bias is not None, HAS_GENT=has_gent, DOT_F32=dot_f32,
                PREC=prec, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=cfg["BLOCK_K"], GROUP_V=8,
            )
            w_chunk = weight[v0 : v0 + width]
            d_hidden[n0:n1] += torch.mm(grad, w_chunk).float()
            if single:
                d_weight[v0 : v0 + width] = torch.mm(grad.t(), x)
            else:
                d_weight[v0 : v0 + width] += torch.mm(grad.t(), x).float()
            if d_bias is not None:
                d_bias[v0 : v0 + width] += grad.sum(0, dtype=torch.float32)
    return (d_hidden.to(hidden.dtype), d_weight.to(weight.dtype),
            d_bias.to(bias.dtype) if d_bias is not None else None)
