"""Persistent variants of the fused linear-logprob kernels (forward and grad), for Hopper first.

Same entry points, arguments and results as ``logprob.fused_linear_logprob_fwd`` / ``_bwd``; selected with
``FASTPO_FLP_KERNEL=persistent`` (see ``library.flp_kernel``); the tiled kernels of ``logprob.py`` stay the
default and the fallback until a GPU run decides (``fastpo.kernels.ab.ab_logprob``). What differs:

* **Persistent grid.** About one program per resident CTA slot (SMs x CTAs per SM of the compiled kernel), each
  looping over its share of the work: (token block, vocab split) items in the forward, logits tiles in the grad.
* **One software-pipelined loop.** Inside a program, the loop runs over (vocab tile x K step) flattened into a
  single ``tl.range(..., num_stages=NUM_STAGES)``; a tile's epilogue (the online log-sum-exp update and target
  gather, or the dL/dlogits write) sits under ``if k == last`` in the same loop body, so the pipeliner issues the
  next tile's first loads before that epilogue runs, instead of draining and refilling at every vocab tile as the
  tiled kernel's nested loops do.
* **TMA descriptors** for x and W (``tl.make_tensor_descriptor``, built in the kernel) where the Triton version has
  them and the device is sm_90 or newer, with 16-byte aligned bases and rows; plain pointer loads (the cp.async
  path) otherwise: sm_80, the interpreter, ragged strides, or ``FASTPO_FLP_KERNEL=persistent-ptr``. In-kernel
  descriptors need a scratch allocator (``triton.set_allocator``): a torch one is installed before each TMA launch.

The tile math (K step, epilogues, tile order) is the tiled kernels' own ``@triton.jit`` helpers, so both compute
the same sums in the same order per tile; with the same vocab splits the results are bitwise equal under the
interpreter (tested). Tiles per dot mode: ``GPU_TILES`` (compile table in docs/KERNELS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logprob import (
    GRAD_ELEMENTS,
    ROW_BLOCK,
    _cfg,
    _dot_acc,
    _fwd_item,
    _grad_tile_coords,
    _grad_tile_store,
    _lse_update,
    _slots,
    _store_partials,
    _xw_step,
    flp_backward,
    flp_forward,
    fp32_mode,
)

#: CUDA tiles per dot mode (keys as logprob.GPU_TILES). The 128 x 128 accumulator of 8 warps leaves registers
#: for the epilogue's temporaries; 4 stages of 128 x 64 bf16 x and W tiles (128 KiB) keep 3 tiles of loads in
#: flight while an epilogue runs, within sm_90's 227 KiB and sm_80's 163 KiB of shared memory per CTA.
GPU_TILES = {
    "half": {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "tf32": {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4},
    "ieee": {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_K": 16, "num_warps": 8, "num_stages": 2},
}
#: Stages of the grad kernel where they differ from GPU_TILES. Its epilogue (p, log p and the gradient of a whole
#: tile live at once) leaves fewer registers than the forward's: with bf16 / fp16 tiles, 3 or 4 stages spill
#: 28-32 bytes on sm_80 (255 registers); 2 stages do not (253), and still issue the next tile's first loads
#: before the epilogue.
GRAD_STAGES = {"half": 2}


def gpu_config(kind: str, mode: str) -> dict:
    """Launch config of the persistent kernels on CUDA (``kind`` "fwd" or "grad", ``mode`` a key of GPU_TILES),
    with the same extra keys as ``logprob.gpu_config``."""
    if kind not in ("fwd", "grad") or mode not in GPU_TILES:
        raise ValueError(f"gpu_config: kind must be 'fwd' or 'grad' and mode one of {tuple(GPU_TILES)}, got "
                         f"{kind!r}, {mode!r}")
    stages = GRAD_STAGES.get(mode, GPU_TILES[mode]["num_stages"]) if kind == "grad" else GPU_TILES[mode]["num_stages"]
    return dict(GPU_TILES[mode], num_stages=stages, GROUP_V=8, GRAD_ELEMENTS=GRAD_ELEMENTS, ROW_BLOCK=ROW_BLOCK,
                DOT_F32=mode == "ieee", PREC="ieee" if mode == "ieee" else "tf32")


def _config(t: torch.Tensor, kind: str) -> dict:
    if not t.is_cuda:
        return _cfg(t, kind)  # the interpreter's tiles: exact fp32 dots
    half = t.dtype in (torch.bfloat16, torch.float16)
    return gpu_config(kind, "half" if half else fp32_mode())


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether the TMA path can serve these row-major 2-D tensors: CUDA sm_90 or newer, a Triton with
    ``tl.make_tensor_descriptor`` and ``triton.set_allocator``, and 16-byte aligned bases and row strides (the
    descriptor's requirement)."""
    first = tensors[0]
    if not first.is_cuda or not hasattr(tl, "make_tensor_descriptor") or not hasattr(triton, "set_allocator"):
        return False
    if torch.cuda.get_device_capability(first.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(-1) == 1
               for t in tensors)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for in-kernel tensor descriptors (a few hundred bytes per program), from torch's caching
    allocator on the current device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _prepare_tma(use: bool, t: torch.Tensor) -> None:
    # set per launch: the allocator is a context variable, and autograd runs the backward on another thread; the
    # interpreter (CPU tensors) emulates descriptors without scratch
    if use and t.is_cuda and hasattr(triton, "set_allocator"):
        triton.set_allocator(_scratch)


# Kernel: persistent forward. Work items are (token block, vocab split) pairs numbered split-major (the token
# blocks of one split are consecutive, so programs running side by side read the same lm-head tiles from L2);
# program p takes items p, p + P, ... For each item, one pipelined loop over (vocab tile x K step) of its split
# accumulates the logits tile and, at the last K step, folds it into the online log-sum-exp (_lse_update) and
# resets the accumulator. Writes the same [4, splits, N] partials as _flp_fwd_kernel.
@triton.jit
def _flp_fwd_persistent_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, part_ptr, N, V, H, v_per_split, splits, inv_t,
                               HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, DOT_F32: tl.constexpr,
                               PREC: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    n_blocks = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(H, BLOCK_K)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[N, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[H, 1], block_shape=[BLOCK_V, BLOCK_K])
    for item in range(tl.program_id(0), n_blocks * splits, tl.num_programs(0)):
        pid_n = item % n_blocks
        split = item // n_blocks
        rows, row_ok, ids, x_rows, v_lo, v_hi, m_i, s_i, t_i, target = _fwd_item(
            x_ptr, ids_ptr, pid_n, split, N, V, H, v_per_split, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for it in tl.range(0, tl.cdiv(v_hi - v_lo, BLOCK_V) * k_tiles, num_stages=NUM_STAGES):
            vt = it // k_tiles
            kt = it - vt * k_tiles
            v0 = v_lo + vt * BLOCK_V
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < v_hi
            if USE_TMA:
                acc = _dot_acc(x_desc.load([pid_n * BLOCK_N, kt * BLOCK_K]), w_desc.load([v0, kt * BLOCK_K]), acc,
                               DOT_F32, PREC)
            else:
                acc = _xw_step(x_rows, w_ptr + cols.to(tl.int64)[:, None] * H, row_ok, col_ok, kt * BLOCK_K, H, acc,
                               DOT_F32, PREC, BLOCK_K)
            if kt == k_tiles - 1:
                m_i, s_i, t_i, target = _lse_update(acc, cols, col_ok, ids, b_ptr, inv_t, m_i, s_i, t_i, target,
                                                    HAS_BIAS, WANT_ENT)
                acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        _store_partials(part_ptr, split, splits, N, rows, row_ok, m_i, s_i, t_i, target)


# Kernel: persistent grad over one vocab chunk [v_lo, v_lo + Vc). Tiles are numbered in _grad_tile_coords' grouped
# order; program p takes tiles p, p + P, ... in one pipelined loop over (its tiles x K step): the logits tile is
# accumulated as in the forward and, at the last K step, its dL/dlogits is written to the chunk buffer
# (_grad_tile_store) and the accumulator reset, while the next tile's loads are already in flight.
@triton.jit
def _flp_grad_persistent_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, g_ptr, glse_ptr, gent_ptr, out_ptr,
                                N, V, H, v_lo, Vc, inv_t,
                                HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, DOT_F32: tl.constexpr,
                                PREC: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
                                NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    v_blocks = tl.cdiv(Vc, BLOCK_V)
    k_tiles = tl.cdiv(H, BLOCK_K)
    my_tiles = tl.cdiv(n_blocks * v_blocks - pid, n_progs)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[N, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[H, 1], block_shape=[BLOCK_V, BLOCK_K])
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for it in tl.range(0, my_tiles * k_tiles, num_stages=NUM_STAGES):
        j = it // k_tiles
        kt = it - j * k_tiles
        pid_n, pid_v = _grad_tile_coords(pid + j * n_progs, n_blocks, v_blocks, GROUP_V)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = v_lo + local
        row_ok = rows < N
        col_ok = (local < Vc) & (cols < V)
        if USE_TMA:
            acc = _dot_acc(x_desc.load([pid_n * BLOCK_N, kt * BLOCK_K]), w_desc.load([v_lo + pid_v * BLOCK_V,
                                                                                     kt * BLOCK_K]), acc, DOT_F32, PREC)
        else:
            acc = _xw_step(x_ptr + rows.to(tl.int64)[:, None] * H, w_ptr + cols.to(tl.int64)[:, None] * H, row_ok,
                           col_ok, kt * BLOCK_K, H, acc, DOT_F32, PREC, BLOCK_K)
        if kt == k_tiles - 1:
            _grad_tile_store(acc, rows, cols, local, row_ok, col_ok, Vc, b_ptr, ids_ptr, lse_ptr, ent_ptr, g_ptr,
                             glse_ptr, gent_ptr, out_ptr, inv_t, HAS_BIAS, HAS_GENT)
            acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)


def _programs(override: int | None, slots: int, work: int) -> int:
    if override is not None and override < 1:
        raise ValueError(f"programs must be >= 1 (or None: one per resident CTA slot), got {override}")
    return max(1, min(override if override is not None else slots, work))


def fused_linear_logprob_fwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             ids: torch.Tensor, temperature: float, return_entropy: bool, *, tma: bool | None = None,
                             programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``logprob.fused_linear_logprob_fwd``, with the persistent forward kernel. ``tma``: None picks TMA
    descriptors where :func:`tma_supported`, False forces pointer loads, True forces descriptors (also under
    the interpreter, which emulates them: the tests use it). ``programs``: the persistent grid size (None: the
    resident CTA slots of the device, 1 under the interpreter; the tests use more to exercise the work loop)."""
    cfg = _config(hidden, "fwd")
    use_tma = tma_supported(hidden, weight) if tma is None else bool(tma)
    n_blocks = triton.cdiv(hidden.shape[0], cfg["BLOCK_N"])
    extra = {"USE_TMA": use_tma, "NUM_STAGES": cfg["num_stages"]}

    def with_splits(args: list, splits: int) -> list:
        return args[:9] + [splits] + args[9:]

    def slots(args: list, consts: dict) -> int:
        return _slots(_flp_fwd_persistent_kernel, hidden, tuple(with_splits(args, 1)), dict(consts, **extra))

    def launch(args: list, consts: dict, splits: int, v_per_split: int) -> None:
        grid = (_programs(programs, slots(args, consts), n_blocks * splits),)
        _prepare_tma(use_tma, hidden)
        _flp_fwd_persistent_kernel[grid](*with_splits(args, splits), **consts, **extra)

    return flp_forward(hidden, weight, bias, ids, temperature, return_entropy, cfg, slots, launch)


def fused_linear_logprob_bwd(grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                             grad_lse: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                             temperature: float, need_weight: bool = True, need_bias: bool = True, *,
                             tma: bool | None = None, programs: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """As ``logprob.fused_linear_logprob_bwd`` (same chunking, same GEMMs), with the persistent grad kernel
    writing each dL/dlogits chunk; ``tma`` and ``programs`` as in :func:`fused_linear_logprob_fwd` (the TMA
    check covers every token chunk: hidden's rows are 16-byte multiples, so their starts are aligned too)."""
    cfg = _config(hidden, "grad")
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    use_tma = tma_supported(hidden, weight) if tma is None else bool(tma)
    b_arg = bias if bias is not None else hidden

    def launch(x: torch.Tensor, ids_c: torch.Tensor, lse_c: torch.Tensor, ent_c: torch.Tensor, g_c: torch.Tensor,
               glse_c: torch.Tensor, gent_c: torch.Tensor, out: torch.Tensor, rows: int, v0: int, width: int,
               has_gent: bool) -> None:
        args = (x, weight, b_arg, ids_c, lse_c, ent_c, g_c, glse_c, gent_c, out, rows, weight.shape[0],
                hidden.shape[1], v0, width, 1.0 / temperature)
        consts = {"HAS_BIAS": bias is not None, "HAS_GENT": has_gent, "DOT_F32": cfg["DOT_F32"],
                  "PREC": cfg["PREC"], "USE_TMA": use_tma, "BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": cfg["BLOCK_K"],
                  "GROUP_V": cfg["GROUP_V"], "NUM_STAGES": cfg["num_stages"], "num_warps": cfg["num_warps"],
                  "num_stages": cfg["num_stages"]}
        tiles = triton.cdiv(rows, bn) * triton.cdiv(width, bv)
        grid = (_programs(programs, _slots(_flp_grad_persistent_kernel, hidden, args, consts), tiles),)
        _prepare_tma(use_tma, hidden)
        _flp_grad_persistent_kernel[grid](*args, **consts)

    return flp_backward(grad_logp, grad_entropy, grad_lse, hidden, weight, bias, ids, lse, entropy, cfg, launch,
                        need_weight, need_bias)
