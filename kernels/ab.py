"""A/B of the fused logprob's Triton kernels at one shape: tiled (the default) against persistent.

``ab_logprob(n_tokens, hidden, vocab)`` times :func:`fastpo.kernels.fused_linear_logprob`, forward alone and
forward + backward, once per kernel choice (``FASTPO_FLP_KERNEL``: ``tiled``, ``persistent``, ``persistent-ptr``),
on the same inputs, and reports per kernel the median times, TFLOP/s, the peak extra memory and the largest
difference of its results from the first kernel's. The GPU suite calls it to decide the default with numbers;
``python -m fastpo.kernels.ab --tokens 8192 --hidden 4096 --vocab 151936`` prints the rows as JSON lines. It runs
on CPU tensors too (under ``TRITON_INTERPRET=1``), where only the agreement columns mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from .ops.library import FLP_KERNELS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def kernel_choice(kernel: str) -> Iterator[None]:
    """FASTPO_FLP_KERNEL = kernel inside the block (and the Triton backend), restored after."""
    saved = {k: os.environ.get(k) for k in ("FASTPO_FLP_KERNEL", "FASTPO_KERNELS")}
    os.environ["FASTPO_FLP_KERNEL"] = kernel
    os.environ["FASTPO_KERNELS"] = "triton"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` in ms over ``iters`` runs after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for an all-zero b)."""
    scale = b.abs().max().item()
    return (a.float() - b.float()).abs().max().item() / scale if scale else 0.0


def ab_logprob(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype | str = torch.bfloat16,
               device: str | torch.device = "cuda", kernels: Sequence[str] = ("tiled", "persistent"),
               iters: int = 10, warmup: int = 2, backward: bool = True, return_entropy: bool = False,
               seed: int = 0) -> list[dict]:
    """Times and cross-checks the fused logprob's Triton kernels at one shape.

    Inputs: hidden ``[n_tokens, hidden]`` ~ N(0, 1), weight ``[vocab, hidden]`` ~ N(0, 1) / sqrt(hidden), random
    ids, in ``dtype`` (a torch dtype or "bf16" / "fp16" / "fp32") on ``device``; the loss is logp.sum() (plus the
    entropy's with return_entropy). Per kernel of ``kernels`` (values of FASTPO_FLP_KERNEL), one dict:

    * ``kernel``, ``device`` (the device's name), ``n_tokens``, ``hidden``, ``vocab``, ``dtype``;
    * ``fwd_ms`` / ``fwd_bwd_ms``: median over ``iters`` runs after ``warmup`` (the first warmup run includes the
      JIT compile), ``fwd_bwd_ms`` None without ``backward``;
    * ``fwd_tflops`` / ``fwd_bwd_tflops``: 2 N V H (forward) and 8 N V H (forward, recompute, dX and dW GEMMs)
      FLOP over those times;
    * ``peak_mib``: peak CUDA memory of one forward + backward above what was allocated before it (None on CPU);
    * ``max_abs_diff_logp``, ``max_rel_diff_d_hidden``, ``max_rel_diff_d_weight``: against the first kernel's
      results (0 for the first row; rel = max |a - b| / max |b|).
    """
    from . import fused_linear_logprob  # the package's public entry: validation, dispatch, autograd

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)} or a torch dtype, got {dtype!r}")
        dtype = DTYPES[dtype]
    for name, value in (("n_tokens", n_tokens), ("hidden", hidden), ("vocab", vocab), ("iters", iters)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    bad = [k for k in kernels if k not in FLP_KERNELS]
    if bad or not kernels:
        raise ValueError(f"kernels must be a non-empty list of {FLP_KERNELS}, got {list(kernels)!r}")
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (n_tokens,), generator=gen).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    flop = 2.0 * n_tokens * vocab * hidden

    def forward(h: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        out = fused_linear_logprob(h, wt, ids, return_entropy=return_entropy)
        return out[0].sum() + out[1].sum() if return_entropy else out.sum()

    def train_step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, wt = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        loss = forward(h, wt)
        loss.backward()
        return loss, h.grad, wt.grad

    rows: list[dict] = []
    first: dict = {}
    for kernel in kernels:
        with kernel_choice(kernel), torch.no_grad():
            logp = fused_linear_logprob(x, w, ids)
            fwd_ms = _median_ms(lambda: fused_linear_logprob(x, w, ids), device, warmup, iters)
        row = {"kernel": kernel, "device": name, "n_tokens": n_tokens, "hidden": hidden, "vocab": vocab,
               "dtype": str(dtype).removeprefix("torch."), "fwd_ms": fwd_ms, "fwd_tflops": flop / fwd_ms / 1e9,
               "fwd_bwd_ms": None, "fwd_bwd_tflops": None, "peak_mib": None,
               "max_abs_diff_logp": (logp - first["logp"]).abs().max().item() if first else 0.0,
               "max_rel_diff_d_hidden": None, "max_rel_diff_d_weight": None}
        if backward:
            with kernel_choice(kernel):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                _, d_h, d_w = train_step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                row["fwd_bwd_ms"] = _median_ms(train_step, device, warmup, iters)
            row["fwd_bwd_tflops"] = 4 * flop / row["fwd_bwd_ms"] / 1e9
            row["max_rel_diff_d_hidden"] = _max_rel(d_h, first["d_h"]) if first else 0.0
            row["max_rel_diff_d_weight"] = _max_rel(d_w, first["d_w"]) if first else 0.0
            first.setdefault("d_h", d_h)
            first.setdefault("d_w", d_w)
        first.setdefault("logp", logp)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels", default="tiled,persistent", help=f"comma-separated, of {FLP_KERNELS}")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    args = parser.parse_args(argv)
    rows = ab_logprob(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.kernels.split(","),
                      args.iters, backward=not args.no_backward)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
