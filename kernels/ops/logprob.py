"""Triton kernels for per-token log-probabilities: from given logits, and fused with the lm-head matmul.

Imported lazily (only when the Triton path runs): this module imports triton at the top. Every kernel loads its
inputs in whatever dtype they come, casts to fp32 right after the load and accumulates in fp32; the only
low-precision compute is ``tl.dot`` on a GPU: bf16/fp16 operands as they are, fp32 operands as TF32 unless
``FASTPO_KERNELS_FP32=ieee`` (fp32 accumulator in every case). Under the Triton interpreter (CPU tensors) the
dot operands are cast to fp32 first and the dot is exact, since the interpreter's bf16 arithmetic is wrong.
Entry points: :func:`selective_logprob_fwd` / ``_bwd`` and :func:`fused_linear_logprob_fwd` / ``_bwd``, with the
same signatures and results as their namesakes in ``reference.py``. CUDA tile configs: ``GPU_TILES``, checked by
``python -m fastpo.kernels.aot`` (compiled for sm_90a / sm_80, no spills).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

# Interpreter-friendly sizes on CPU tensors (the interpreter runs on CPU, where only exactness matters).
_CPU = {"BLOCK_N": 16, "BLOCK_V": 512, "BLOCK_K": 32, "GROUP_V": 8, "num_warps": 4, "num_stages": 3,
        "ROW_BLOCK": 4096, "GRAD_ELEMENTS": 1 << 16, "DOT_F32": True, "PREC": "ieee"}
#: Vocab block and warps of the per-row selective-logprob kernels on CUDA.
ROW_BLOCK, ROW_WARPS = 4096, 4
#: Elements of the backward's dL/dlogits chunk buffer on CUDA (2^29: 1 GiB in bf16; for N below ~3.5K tokens
#: the whole N x V gradient of a 151K vocab fits in one chunk).
GRAD_ELEMENTS = 1 << 29
#: CUDA tiles of the fused linear-logprob kernels (forward and grad), per dot mode, chosen from the sm_90a /
#: sm_80 compile table of ``python -m fastpo.kernels.aot`` (docs/KERNELS.md): the largest tiles that compile
#: without spills on both archs. "half": bf16 / fp16 operands; "tf32": fp32 operands rounded to TF32 on the
#: tensor cores (fp32 accumulation); "ieee": exact fp32 FMAs, no tensor cores (FASTPO_KERNELS_FP32=ieee).
#: 128 x 256 tiles spill on both archs; 64 x 128 with 4 warps spills in tf32 on sm_80. ieee: 64 x 64 x 16 with 4
#: warps spills 8 bytes in the forward on sm_90a (168 registers); with 8 warps it needs 128 and spills nothing.
GPU_TILES = {
    "half": {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    "tf32": {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    "ieee": {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_K": 16, "num_warps": 8, "num_stages": 2},
}
FP32_MODES = ("tf32", "ieee")


def fp32_mode() -> str:
    """How fp32 operands enter ``tl.dot`` on CUDA: ``FASTPO_KERNELS_FP32=tf32`` (default: tensor cores, inputs
    rounded to TF32's 10-bit mantissa, fp32 accumulation) or ``ieee`` (exact fp32, several times slower; the
    GPU test run uses it to compare against fp32 truth at fp32 tolerances)."""
    mode = os.environ.get("FASTPO_KERNELS_FP32", "").strip().lower() or "tf32"
    if mode not in FP32_MODES:
        raise ValueError(f"FASTPO_KERNELS_FP32 must be one of {FP32_MODES} (or unset), got {mode!r}")
    return mode


def gpu_config(kind: str, mode: str) -> dict:
    """Launch config of the fused kernels on CUDA: ``kind`` "fwd" or "grad", ``mode`` a key of GPU_TILES ->
    tiles, warps, stages, GROUP_V, GRAD_ELEMENTS and the dot options (DOT_F32: cast operands to fp32 first;
    PREC: tl.dot input_precision)."""
    if kind not in ("fwd", "grad") or mode not in GPU_TILES:
        raise ValueError(f"gpu_config: kind must be 'fwd' or 'grad' and mode one of {tuple(GPU_TILES)}, got "
                         f"{kind!r}, {mode!r}")
    return dict(GPU_TILES[mode], GROUP_V=8, GRAD_ELEMENTS=GRAD_ELEMENTS, ROW_BLOCK=ROW_BLOCK,
                DOT_F32=mode == "ieee", PREC="ieee" if mode == "ieee" else "tf32")


def _cfg(t: torch.Tensor, kind: str = "fwd") -> dict:
    """The config for a kernel on ``t``'s device and dtype. Under the interpreter (CPU tensors) dot operands are
    always fp32 and exact, since the interpreter's bf16 arithmetic is wrong."""
    if not t.is_cuda:
        return _CPU
    half = t.dtype in (torch.bfloat16, torch.float16)
    return gpu_config(kind, "half" if half else fp32_mode())


def ctas_per_sm(regs: int, num_warps: int, shared: int, regs_per_sm: int = 65536, smem_per_sm: int = 233472,
                max_threads: int = 2048) -> int:
    """Resident CTAs per SM of a kernel using ``regs`` registers per thread, ``num_warps`` warps and ``shared``
    bytes of shared memory per CTA. Registers are allocated per warp in 256-register units (8 per thread) and
    the driver reserves 1 KiB of shared memory per CTA. Defaults: an sm_90 SM (H100 / H200)."""
    warp_regs = -(-max(regs, 1) // 8) * 8 * 32
    by_regs = regs_per_sm // (warp_regs * num_warps)
    by_smem = smem_per_sm // (shared + 1024) if shared else by_regs
    return max(0, min(by_regs, by_smem, max_threads // (32 * num_warps), 32))


def n_splits(n_token_blocks: int, n_vocab_blocks: int, slots: int, max_splits: int = 64) -> int:
    """Vocab splits of the fused forward for ``slots`` = SMs x resident CTAs per SM of the launched config. With
    s splits the grid has blocks * s CTAs of equal work V / s, so the run time is proportional to
    ceil(blocks * s / slots) / s (waves times the share of the vocab). Returns the smallest s in
    [1, min(n_vocab_blocks, max_splits)] within 5% of the best (fewer splits: fewer partials to combine): the last
    wave is never mostly idle (at least 94% of the slots busy over the whole run once blocks * max_splits >= 3 x
    slots), where a fixed target of 2 x SMs CTAs left up to a third of them idle."""
    if n_token_blocks < 1 or n_vocab_blocks < 1 or slots < 1:
        raise ValueError(f"n_splits needs positive counts, got n_token_blocks={n_token_blocks}, "
                         f"n_vocab_blocks={n_vocab_blocks}, slots={slots}")
    cost = [-(-n_token_blocks * s // slots) / s for s in range(1, min(n_vocab_blocks, max_splits) + 1)]
    best = min(cost)
    return next(s for s, c in enumerate(cost, 1) if c <= best * 1.05)


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


def selective_logprob_fwd(logits: torch.Tensor, ids: torch.Tensor,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[R, V]`` or ``[B, T, V]`` (vocab dim contiguous), ids of shape logits.shape[:-1] ->
    fp32 (logp, lse) of ids' shape."""
    vocab = logits.shape[-1]
    logp = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    if ids.numel():
        inner, s_outer, s_row = _row_layout(logits)
        block = min(_cfg(logits)["ROW_BLOCK"], triton.next_power_of_2(vocab))
        _selective_fwd_kernel[(ids.numel(),)](logits, ids.contiguous(), logp, lse, vocab, inner, s_outer, s_row,
                                              1.0 / temperature, BLOCK_V=block, num_warps=ROW_WARPS)
    return logp, lse


def selective_logprob_bwd(grad_logp: torch.Tensor, grad_lse: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                          lse: torch.Tensor, temperature: float) -> torch.Tensor:
    """Gradient w.r.t. logits (contiguous, logits' shape and dtype)."""
    vocab = logits.shape[-1]
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if ids.numel():
        inner, s_outer, s_row = _row_layout(logits)
        block = min(_cfg(logits)["ROW_BLOCK"], triton.next_power_of_2(vocab))
        grid = (ids.numel(), triton.cdiv(vocab, block))
        _selective_bwd_kernel[grid](logits, ids.contiguous(), lse, grad_logp.float().contiguous(),
                                    grad_lse.float().contiguous(), out, vocab, inner, s_outer, s_row,
                                    1.0 / temperature, BLOCK_V=block, num_warps=ROW_WARPS)
    return out


# ------------------------------------------------------------------------------------- fused linear logprob
# Tile helpers shared by the tiled kernels below and the persistent ones (flp_persistent.py); @triton.jit
# functions called from a kernel are inlined into it, so the kernels compute exactly what they did when these
# lines were written out in each. A logits tile is z = (x @ w.T + b) / T for BLOCK_N tokens x BLOCK_V vocab
# columns, accumulated in fp32 over H in BLOCK_K steps.
@triton.jit
def _dot_acc(x, w, acc, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """acc + x @ w.T for an x [BLOCK_N, BLOCK_K] and w [BLOCK_V, BLOCK_K] tile (operands cast to fp32 first when
    DOT_F32: the exact path and the interpreter)."""
    if DOT_F32:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc=acc, input_precision=PREC)


@triton.jit
def _xw_step(x_rows, w_rows, row_ok, col_ok, k0, H, acc, DOT_F32: tl.constexpr, PREC: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """One K step of a logits tile through pointer loads: x_rows / w_rows are [BLOCK_N, 1] / [BLOCK_V, 1] row
    pointers, k0 the first hidden column; masked rows, columns and the ragged end of H read 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < H
    x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    return _dot_acc(x, w, acc, DOT_F32, PREC)


@triton.jit
def _logits_tile(x_rows, w_rows, row_ok, col_ok, H, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """x @ w.T for one [BLOCK_N, BLOCK_V] tile (fp32, bias and temperature not applied): the K loop of the
    tiled kernels."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = _xw_step(x_rows, w_rows, row_ok, col_ok, k0, H, acc, DOT_F32, PREC, BLOCK_K)
    return acc


@triton.jit
def _fwd_item(x_ptr, ids_ptr, pid_n, split, N, V, H, v_per_split, BLOCK_N: tl.constexpr):
    """The start of one forward work item (token block pid_n, vocab split): its rows, their mask, target ids and
    x row pointers, the split's vocab range [v_lo, v_hi), and the zeroed online log-sum-exp state
    (m_i = -inf, s_i, t_i, target)."""
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    v_lo = split * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    target = tl.zeros([BLOCK_N], dtype=tl.float32)
    return rows, row_ok, ids, x_ptr + rows.to(tl.int64)[:, None] * H, v_lo, v_hi, m_i, s_i, t_i, target


@triton.jit
def _lse_update(acc, cols, col_ok, ids, b_ptr, inv_t, m_i, s_i, t_i, target, HAS_BIAS: tl.constexpr,
                WANT_ENT: tl.constexpr):
    """The forward's epilogue of one logits tile: adds the bias, scales by 1 / T, and folds the tile into the
    per-token online log-sum-exp (max m_i, sum s_i), the entropy accumulator t_i = sum exp(z - m) (z - m) and
    the target logit. Returns the updated (m_i, s_i, t_i, target)."""
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
    return m_new, s_i, t_i, target


@triton.jit
def _store_partials(part_ptr, split, splits, N, rows, row_ok, m_i, s_i, t_i, target):
    """Writes one (split, token block)'s 4 fp32 partials into part[4, splits, N]."""
    out = part_ptr + split * N + rows
    tl.store(out, m_i, mask=row_ok)
    tl.store(out + splits * N, s_i, mask=row_ok)
    tl.store(out + 2 * splits * N, t_i, mask=row_ok)
    tl.store(out + 3 * splits * N, target, mask=row_ok)


@triton.jit
def _grad_tile_coords(tile, n_blocks, v_blocks, GROUP_V: tl.constexpr):
    """(token block, vocab block) of grad tile number ``tile``: GROUP_V vocab blocks at a time, every token block
    of the group before the next group, so that a group's lm-head tiles stay in L2."""
    per_group = GROUP_V * n_blocks
    first_v = (tile // per_group) * GROUP_V
    group_v = tl.minimum(v_blocks - first_v, GROUP_V)
    pid_v = first_v + (tile % per_group) % group_v
    pid_n = (tile % per_group) // group_v
    return pid_n, pid_v


@triton.jit
def _grad_tile_store(acc, rows, cols, local, row_ok, col_ok, Vc, b_ptr, ids_ptr, lse_ptr, ent_ptr, g_ptr, glse_ptr,
                     gent_ptr, out_ptr, inv_t, HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr):
    """The grad's epilogue of one logits tile (acc = x @ w.T): writes dL/dlogits of the tile,
    (g_logp * onehot + p * (g_lse - g_logp - g_ent * (log p + entropy))) / T, into the chunk buffer
    out [N, Vc] at columns ``local`` (cols = v_lo + local are the vocab ids)."""
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


# Kernel: grid (token blocks, vocab splits). A program owns BLOCK_N tokens and one contiguous vocab range; it
# walks the range in BLOCK_V tiles (_logits_tile, then _lse_update). Never writes logits: only 4 fp32 partials
# per (split, token) to part[4, SPLIT, N], combined by the host (``_combine``). pid 0 is the fastest grid axis,
# so the token blocks of one split run together and read the same lm-head tiles from L2. Layout: x [N, H],
# w [V, H] and b [V] contiguous. Backward recomputes the tiles (_flp_grad_kernel).
@triton.jit
def _flp_fwd_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, part_ptr, N, V, H, v_per_split, inv_t,
                    HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    split = tl.program_id(1)
    rows, row_ok, ids, x_rows, v_lo, v_hi, m_i, s_i, t_i, target = _fwd_item(
        x_ptr, ids_ptr, tl.program_id(0), split, N, V, H, v_per_split, BLOCK_N)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        acc = _logits_tile(x_rows, w_ptr + cols.to(tl.int64)[:, None] * H, row_ok, col_ok, H, DOT_F32, PREC,
                           BLOCK_N, BLOCK_V, BLOCK_K)
        m_i, s_i, t_i, target = _lse_update(acc, cols, col_ok, ids, b_ptr, inv_t, m_i, s_i, t_i, target, HAS_BIAS,
                                            WANT_ENT)
    _store_partials(part_ptr, split, tl.num_programs(1), N, rows, row_ok, m_i, s_i, t_i, target)


# Kernel: grid over (token blocks x vocab blocks) of one vocab chunk [v_lo, v_lo + Vc), in _grad_tile_coords'
# grouped order. Recomputes the logits tile exactly as the forward and writes its dL/dlogits into the chunk
# buffer G [N, Vc] (hidden's dtype; _grad_tile_store). The host then does dX += G @ w[chunk],
# dW[chunk] = G.T @ x, db[chunk] = G.sum(0) as GEMMs.
@triton.jit
def _flp_grad_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, g_ptr, glse_ptr, gent_ptr, out_ptr,
                     N, V, H, v_lo, Vc, inv_t,
                     HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr):
    pid_n, pid_v = _grad_tile_coords(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(Vc, BLOCK_V), GROUP_V)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v_lo + local
    row_ok = rows < N
    col_ok = (local < Vc) & (cols < V)
    acc = _logits_tile(x_ptr + rows.to(tl.int64)[:, None] * H, w_ptr + cols.to(tl.int64)[:, None] * H, row_ok,
                       col_ok, H, DOT_F32, PREC, BLOCK_N, BLOCK_V, BLOCK_K)
    _grad_tile_store(acc, rows, cols, local, row_ok, col_ok, Vc, b_ptr, ids_ptr, lse_ptr, ent_ptr, g_ptr, glse_ptr,
                     gent_ptr, out_ptr, inv_t, HAS_BIAS, HAS_GENT)


_SLOTS: dict = {}


def _slots(kernel: triton.JITFunction, hidden: torch.Tensor, args: tuple, consts: dict) -> int:
    """SMs x resident CTAs per SM of ``kernel`` (a JITFunction) as it will launch with ``args`` / ``consts``
    (compiled once per kernel, device and specialisation through ``warmup``, which launches nothing); 1 under
    the interpreter, where more programs only cost time."""
    if not hidden.is_cuda:
        return 1
    key = (kernel.fn.__name__, hidden.device.index, hidden.dtype, tuple(sorted(consts.items())))
    if key not in _SLOTS:
        props = torch.cuda.get_device_properties(hidden.device)
        with torch.cuda.device(hidden.device):
            compiled = kernel.warmup(*args, grid=(1,), **consts)
            compiled._init_handles()  # loads the cubin: fills n_regs
        per_sm = ctas_per_sm(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
                             getattr(props, "regs_per_multiprocessor", 65536),
                             getattr(props, "shared_memory_per_multiprocessor", 233472),
                             getattr(props, "max_threads_per_multi_processor", 2048))
        _SLOTS[key] = props.multi_processor_count * max(per_sm, 1)
    return _SLOTS[key]


def _combine(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[4, S, N] partials (max, sum, entropy acc, target) -> (lse, entropy, target) fp32 [N]."""
    m, s, t, target = part[0], part[1], part[2], part[3].sum(0)
    m_max = m.amax(0)
    scale = torch.exp(m - m_max)
    total = (s * scale).sum(0)
    shift = torch.where(s > 0, m - m_max, 0.0)
    t_total = (scale * (t + shift * s)).sum(0)
    log_total = torch.log(total)
    return m_max + log_total, log_total - t_total / total, target


#: launch(args, consts, splits, v_per_split): runs a forward kernel that fills args[4] = part [4, splits, N].
FwdLaunch = Callable[[list, dict, int, int], None]


def flp_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                temperature: float, return_entropy: bool, cfg: dict, slots: Callable[[list, dict], int],
                launch: FwdLaunch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host side of a fused forward, shared by the tiled and the persistent kernels: the vocab splits
    (``n_splits`` over ``slots(args, consts)`` resident programs), the [4, S, N] partials, one ``launch`` and
    the combine. ``args`` are the common kernel arguments (x, w, b, ids, part, N, V, H, v_per_split, inv_t)."""
    n_tokens, hid = hidden.shape
    vocab = weight.shape[0]
    block_v = cfg["BLOCK_V"]
    n_blocks = triton.cdiv(n_tokens, cfg["BLOCK_N"])
    consts = {"HAS_BIAS": bias is not None, "WANT_ENT": return_entropy, "DOT_F32": cfg["DOT_F32"],
              "PREC": cfg["PREC"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_V": block_v, "BLOCK_K": cfg["BLOCK_K"],
              "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    args = [hidden, weight, bias if bias is not None else hidden, ids, None, n_tokens, vocab, hid, block_v,
            1.0 / temperature]
    splits = 1
    if n_tokens:
        args[4] = torch.empty(4, 1, n_tokens, dtype=torch.float32, device=hidden.device)  # for the warmup only
        splits = n_splits(n_blocks, triton.cdiv(vocab, block_v), slots(args, consts))
    v_per_split = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v
    splits = triton.cdiv(vocab, v_per_split)
    part = torch.empty(4, splits, n_tokens, dtype=torch.float32, device=hidden.device)
    if n_tokens:
        args[4], args[8] = part, v_per_split
        launch(args, consts, splits, v_per_split)
    lse, entropy, target = _combine(part)
    if not return_entropy:
        entropy = torch.empty(0, dtype=torch.float32, device=hidden.device)
    return target - lse, entropy, lse


def fused_linear_logprob_fwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             ids: torch.Tensor, temperature: float,
                             return_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, ids ``[N]`` -> fp32 (logp [N], entropy [N] or
    [0], lse [N]). Contiguous inputs of one dtype. The tiled kernel: grid (token blocks, vocab splits)."""
    n_blocks = triton.cdiv(hidden.shape[0], _cfg(hidden, "fwd")["BLOCK_N"])

    def launch(args: list, consts: dict, splits: int, v_per_split: int) -> None:
        _flp_fwd_kernel[(n_blocks, splits)](*args, **consts)

    return flp_forward(hidden, weight, bias, ids, temperature, return_entropy, _cfg(hidden, "fwd"),
                       lambda args, consts: _slots(_flp_fwd_kernel, hidden, tuple(args), consts), launch)


#: launch(x, ids, lse, ent, g, g_lse, g_ent, out, rows, v_lo, width, has_gent): writes one [rows, width]
#: dL/dlogits chunk (vocab columns [v_lo, v_lo + width) of the tokens in x) into ``out``.
GradLaunch = Callable[..., None]


def flp_backward(grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None, grad_lse: torch.Tensor | None,
                 hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                 lse: torch.Tensor, entropy: torch.Tensor, cfg: dict, launch: GradLaunch, need_weight: bool = True,
                 need_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The host side of a recomputing backward, shared by the tiled and the persistent grad kernels. Loops over
    vocab chunks of at most GRAD_ELEMENTS / N columns (and token chunks when N alone exceeds that): ``launch``
    writes the chunk's dL/dlogits, cuBLAS does the three GEMMs. Peak extra memory: one [tokens, Vc] buffer in
    hidden's dtype plus an fp32 dX accumulator [N, H]. Returns (d_hidden, d_weight or None when not
    need_weight, d_bias or None when there is no bias or not need_bias): a frozen lm-head (LoRA) skips the
    2NVH FLOP of dW."""
    n_tokens, hid = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
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
    single = token_chunk >= n_tokens > 0  # one token chunk writes every row of dW (none to write for N = 0)
    d_weight = None
    if need_weight:
        d_weight = torch.empty_like(weight) if single else torch.zeros(weight.shape, dtype=torch.float32, device=dev)
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if bias is not None and need_bias else None
    buf = torch.empty(min(token_chunk, n_tokens) * vocab_chunk, dtype=hidden.dtype, device=dev)
    for n0 in range(0, n_tokens, token_chunk):
        n1 = min(n0 + token_chunk, n_tokens)
        rows = n1 - n0
        x = hidden[n0:n1]
        for v0 in range(0, vocab, vocab_chunk):
            width = min(vocab_chunk, vocab - v0)
            grad = buf[: rows * width].view(rows, width)
            launch(x, ids[n0:n1], lse[n0:n1], ent[n0:n1] if has_gent else ent, g[n0:n1], g_lse[n0:n1],
                   g_ent[n0:n1] if has_gent else g_ent, grad, rows, v0, width, has_gent)
            w_chunk = weight[v0 : v0 + width]
            d_hidden[n0:n1] += torch.mm(grad, w_chunk).float()
            if d_weight is not None and single:
                d_weight[v0 : v0 + width] = torch.mm(grad.t(), x)
            elif d_weight is not None:
                d_weight[v0 : v0 + width] += torch.mm(grad.t(), x).float()
            if d_bias is not None:
                d_bias[v0 : v0 + width] += grad.sum(0, dtype=torch.float32)
    return (d_hidden.to(hidden.dtype), d_weight.to(weight.dtype) if d_weight is not None else None,
            d_bias.to(bias.dtype) if d_bias is not None else None)


def fused_linear_logprob_bwd(grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                             grad_lse: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                             temperature: float, need_weight: bool = True, need_bias: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Recomputing backward (see :func:`flp_backward`) with the tiled grad kernel: one program per tile."""
    cfg = _cfg(hidden, "grad")
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]

    def launch(x: torch.Tensor, ids_c: torch.Tensor, lse_c: torch.Tensor, ent_c: torch.Tensor, g_c: torch.Tensor,
               glse_c: torch.Tensor, gent_c: torch.Tensor, out: torch.Tensor, rows: int, v0: int, width: int,
               has_gent: bool) -> None:
        grid = (triton.cdiv(rows, bn) * triton.cdiv(width, bv),)
        _flp_grad_kernel[grid](
            x, weight, bias if bias is not None else hidden, ids_c, lse_c, ent_c, g_c, glse_c, gent_c, out, rows,
            weight.shape[0], hidden.shape[1], v0, width, 1.0 / temperature, HAS_BIAS=bias is not None,
            HAS_GENT=has_gent, DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"], BLOCK_N=bn, BLOCK_V=bv,
            BLOCK_K=cfg["BLOCK_K"], GROUP_V=cfg["GROUP_V"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    return flp_backward(grad_logp, grad_entropy, grad_lse, hidden, weight, bias, ids, lse, entropy, cfg, launch,
                        need_weight, need_bias)
